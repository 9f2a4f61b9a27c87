"""Small test helpers (Pyro's tests/common.py is not installed with pyro-ppl)."""

import torch


def assert_close(actual, expected, atol=1e-6, rtol=1e-6, msg=""):
    """Element-wise closeness of tensors (or numbers), with a useful message."""
    actual = torch.as_tensor(actual)
    expected = torch.as_tensor(expected, dtype=actual.dtype, device=actual.device)
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol, msg=msg or None)
