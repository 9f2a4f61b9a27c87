"""The op tables and rules of pyro_vinit.poutine._tensor_ops that are not tested
through the handlers."""

import functools

import pytest
import torch

from pyro_vinit.poutine._tensor_ops import getter, uses_values

_T = torch.Tensor
_t = torch.ones(2)


def _named(name):
    def func(*args, **kwargs):
        return _t

    func.__name__ = name
    return func


USES = {
    # (func as __torch_function__ receives it, what it returned, whether it computed with
    # the tensor's elements)
    "an operator": (_T.__add__, _t, True),
    "a reflected operator": (_T.__rmul__, _t, True),
    "a conversion": (_T.__bool__, True, True),
    "an element read": (_T.item, 1.0, True),
    "a function": (torch.exp, _t, True),
    "a function of several outputs": (torch.unbind, (_t, _t), True),
    "a callable without a name": (functools.partial(torch.exp), _t, True),
    "an attribute read": (getter("T"), _t, False),
    "a dunder of metadata": (_T.__hash__, 123, False),
    "a private method of torch's machinery": (_named("_private_op"), _t, False),
    "a query of metadata": (_T.stride, (1,), False),
    "a query that answers a bool": (_T.is_contiguous, True, False),
}


@pytest.mark.parametrize("case", sorted(USES))
def test_uses_values(case):
    func, out, expected = USES[case]
    assert uses_values(func, out) is expected
