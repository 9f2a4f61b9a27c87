"""The BatchNorm and pooling modules after a batched layer
(pyro_vinit.poutine._batched_modules), one at a time."""

import pyro
import pytest
import torch
from torch import nn

from pyro_vinit.poutine._batched_modules import BatchedModules
from tests.common import assert_close

_SAMPLES = "_num_predictive_samples"  # (the plate of Predictive(parallel=True))


class _FailsOnce(nn.MaxPool2d):
    failed = False

    def forward(self, x):
        if not self.failed:
            self.failed = True
            raise RuntimeError("a forward that fails")
        return super().forward(x)


@pytest.fixture
def batched():
    modules = BatchedModules()
    yield modules
    modules.close()


def test_pooling_folds_the_leading_dims_in_the_samples_plate_only(batched):
    pool = nn.MaxPool2d(2)
    x = torch.randn(3, 5, 4, 6, 6)  # (samples, rows, channels, height, width)
    batched.watch(x, 1)
    with pyro.plate(_SAMPLES, 3, dim=-2):
        out = pool(x)
    assert_close(out, torch.stack([pool(x[s]) for s in range(3)]))
    with pytest.raises(RuntimeError):  # (outside the plate: torch's own refusal)
        pool(x)


def test_a_failed_forward_leaves_no_folded_shape_behind(batched):
    pool = _FailsOnce(2)
    x = torch.randn(3, 5, 4, 6, 6)
    batched.watch(x, 1)
    with pyro.plate(_SAMPLES, 3, dim=-2), pytest.raises(RuntimeError, match="fails"):
        pool(x)
    plain = torch.randn(3, 4, 6, 6)
    assert pool(plain).shape == (3, 4, 3, 3)  # (not reshaped to the failed call's rows)


def test_close_removes_the_hooks():
    modules = BatchedModules()
    modules.watch(torch.zeros(2, 3, 4), 1)
    assert nn.modules.module._global_forward_pre_hooks
    modules.close()
    assert not nn.modules.module._global_forward_pre_hooks
    assert not nn.modules.module._global_forward_hooks
