"""The BatchNorm and pooling modules after a batched layer
(pyro_vinit.poutine._batched_modules), one at a time."""

import pyro
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from pyro_vinit.poutine._batched_modules import (
    BatchedModules,
    _conv,
    _flattened,
    _folds,
    _minus_one_first,
    _unfolds,
)
from tests.common import assert_close

_SAMPLES = "_num_predictive_samples"  # (the plate of Predictive(parallel=True))


class _FailsOnce(nn.BatchNorm2d):  # (a module whose input the hooks fold)
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


class _NormThenScale(nn.BatchNorm2d):  # (a module the hooks fold, with one of its own)
    def __init__(self):
        super().__init__(4)
        self.scale = nn.Identity()

    def forward(self, x):
        return self.scale(super().forward(x))


def test_a_folded_modules_inner_module_and_its_unfolded_output(batched):
    # the inner module runs on the folded rows, left alone; the unfolded output leads with
    # the sample dims, which a dim counted from the left would land on
    norm = _NormThenScale().eval()
    x = torch.randn(3, 5, 4, 6, 6)
    batched.watch(x, 1)
    with pyro.plate(_SAMPLES, 3, dim=-2):
        out = norm(x)
        with pytest.raises(ValueError, match="a dim counted from the left lands on them"):
            out.sum(1)
    assert_close(out, torch.stack([norm(x[s]) for s in range(3)]))


def test_a_failed_forward_leaves_no_folded_shape_behind(batched):
    norm = _FailsOnce(4).eval()
    x = torch.randn(3, 5, 4, 6, 6)
    batched.watch(x, 1)
    with pyro.plate(_SAMPLES, 3, dim=-2):
        with pytest.raises(RuntimeError, match="fails"):
            norm(x)
        assert_close(norm(x), torch.stack([norm(x[s]) for s in range(3)]))
    plain = torch.randn(3, 4, 6, 6)
    assert norm(plain).shape == (3, 4, 6, 6)  # (not reshaped to the failed call's rows)


def test_close_removes_the_hooks():
    modules = BatchedModules()
    modules.watch(torch.zeros(2, 3, 4), 1)
    assert nn.modules.module._global_forward_pre_hooks
    assert torch.overrides._get_current_function_mode_stack()
    modules.close()
    assert not nn.modules.module._global_forward_pre_hooks
    assert not nn.modules.module._global_forward_hooks
    assert not torch.overrides._get_current_function_mode_stack()


class _Mode(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def test_close_leaves_a_mode_entered_after_watch_on_the_stack():
    modules = BatchedModules()
    with _Mode() as outer:
        modules.watch(torch.zeros(2, 3, 4), 1)
        inner = _Mode()
        inner.__enter__()
        modules.close()
        assert torch.overrides._get_current_function_mode_stack() == [outer, inner]
        inner.__exit__(None, None, None)
    assert not torch.overrides._get_current_function_mode_stack()


def test_a_pooling_function_folds_the_leading_dims_in_the_samples_plate_only(batched):
    x = torch.randn(3, 5, 4, 6, 6)
    batched.watch(x, 1)
    with pyro.plate(_SAMPLES, 3, dim=-2):
        out, indices = F.max_pool2d(x, 2, return_indices=True)
        plain = F.max_pool2d(x[0], 2)  # (as many dims as the function takes: its own)
    assert_close(out, torch.stack([F.max_pool2d(x[s], 2) for s in range(3)]))
    assert indices.shape == out.shape and torch.equal(plain, out[0])
    with pytest.raises(RuntimeError):  # (outside the plate: torch's own refusal)
        F.max_pool2d(x, 2)


def test_a_batch_norm_module_folds_its_input_once(batched):
    # one row per sample, as many channels as the height: the function inside the module
    # gets (samples, channels, height, width), which it must not fold again
    norm = nn.BatchNorm2d(4).eval()
    norm.running_mean.normal_()
    x = torch.randn(3, 1, 4, 4, 5)
    batched.watch(x, 1)
    with pyro.plate(_SAMPLES, 3, dim=-2):
        out = norm(x)
    assert_close(out, torch.stack([norm(x[s]) for s in range(3)]))


def test_a_function_on_an_input_of_its_own_dims_is_left_alone(batched):
    # a plain (rows, channels, height, width) whose rows are as many as the samples
    x = torch.randn(3, 2, 4, 4)
    batched.watch(torch.randn(3, 5, 2), 1)
    with pyro.plate(_SAMPLES, 3, dim=-2):
        out = F.interpolate(x, size=(2, 2))
        conv = F.conv2d(x, torch.ones(1, 2, 3, 3))
    assert torch.equal(out, F.interpolate(x, size=(2, 2)))
    assert torch.equal(conv, F.conv2d(x, torch.ones(1, 2, 3, 3)))


@pytest.mark.parametrize("rows", [5, 1])
def test_the_other_arguments_from_a_batched_layer_fold_with_the_input(batched, rows):
    # (an argument computed from a batched layer with other leading dims: left alone)
    seen = []

    def func(a, b):
        seen.append((a.shape, b.shape))
        return a

    x = torch.randn(3, 5, 4, 6, 6)
    batched.watch(x, 1)
    with pyro.plate(_SAMPLES, 3, dim=-2):
        other = x[:, :rows] * 2  # (computed under the mode: marked)
        out = batched.call(func, lambda *args: 3, (x, other), {})
    assert out.shape == x.shape
    if rows == 5:
        assert seen == [((15, 4, 6, 6), (15, 4, 6, 6))]
    else:
        assert seen == [(x.shape, other.shape)]


@pytest.mark.parametrize("args, kwargs, expected", [
    ((-1,), {}, True),
    ((-1, 4), {}, True),
    ((4, -1), {}, False),
    (((-1, 4),), {}, True),
    (([4, -1],), {}, False),
    ((), {"shape": (-1, 4)}, True),
    ((), {"shape": (4, -1)}, False),
    ((), {"size": [-1]}, True),
    ((), {}, False),
])
def test_minus_one_first_reads_a_reshapes_shape_however_given(args, kwargs, expected):
    # x.reshape(-1, 4), x.reshape((-1, 4)), x.reshape(shape=(-1, 4)), x.view(size=[-1])
    assert _minus_one_first((torch.zeros(8),) + args, kwargs) is expected


class _Drawn(torch.Tensor):  # (a weight that is not a plain tensor, as a site's value)
    pass


@pytest.mark.parametrize("weight_at, bias_at", [("args", "args"), ("kwargs", "kwargs"),
                                                ("args", "kwargs")])
@pytest.mark.parametrize("drawn", [None, "weight", "bias"])
def test_conv_rule_folds_a_convolution_with_a_plain_weight_and_bias(weight_at, bias_at, drawn):
    # F.conv2d(x, w, b), F.conv2d(x, weight=w, bias=b), F.conv2d(x, w, bias=b): folded
    # (channels and two spatial dims kept) unless the weight or the bias is not plain
    x = torch.zeros(2, 3, 1, 4, 4)
    w, b = torch.zeros(5, 1, 3, 3), nn.Parameter(torch.zeros(5))
    w = w.as_subclass(_Drawn) if drawn == "weight" else w
    b = torch.zeros(5).as_subclass(_Drawn) if drawn == "bias" else b
    args, kwargs = (x,), {}
    for name, value, at in (("weight", w, weight_at), ("bias", b, bias_at)):
        if at == "args":
            args += (value,)
        else:
            kwargs[name] = value
    assert _conv(2, x, 2, args, kwargs) == (None if drawn else 3)


@pytest.mark.parametrize("func, args, kwargs, first", [
    (torch.Tensor.flatten, (1,), {}, 1),
    (torch.Tensor.flatten, (), {"start_dim": 1}, 1),
    (torch.flatten, (), {"start_dim": -2}, 2),
    (torch.Tensor.flatten, (), {}, 0),
    (torch.Tensor.unflatten, (), {"dim": 1, "sizes": (2, 2)}, 1),
    (torch.Tensor.reshape, (-1,), {}, None),
])
def test_flattened_reads_the_first_dim_however_given(func, args, kwargs, first):
    x = torch.zeros(2, 3, 4, 5)
    assert _flattened(func, (x,) + args, kwargs, x.dim()) == first


@pytest.mark.parametrize("func, args, kwargs, folds, unfolds", [
    # a flatten from the samples' dims folds them; one past them does not
    (torch.Tensor.flatten, (), {"start_dim": 1}, True, False),
    (torch.Tensor.flatten, (), {"start_dim": 2}, False, False),
    # a reshape whose shape leads with -1 folds, one of sizes may unfold
    (torch.Tensor.reshape, (), {"shape": (-1, 4)}, True, False),
    (torch.Tensor.reshape, (), {"shape": (2, 3, 4)}, False, True),
    # an unflatten of the first dim unfolds; of a sample dim it takes it into others
    # (a fold), of a later dim it does neither
    (torch.Tensor.unflatten, (), {"dim": 0, "sizes": (1, 2)}, True, True),
    (torch.Tensor.unflatten, (), {"dim": 1, "sizes": (1, 3)}, True, False),
    (torch.Tensor.unflatten, (), {"dim": 2, "sizes": (2, 2)}, False, False),
])
def test_folds_and_unfolds_read_keyword_arguments(func, args, kwargs, folds, unfolds):
    # of a tensor that leads with 2 sample dims
    x = torch.zeros(2, 3, 4)
    assert _folds(func, (x,) + args, kwargs, x.dim(), 2) is folds
    assert _unfolds(func, (x,) + args, kwargs, x.dim()) is unfolds


def test_watch_of_a_later_layer_marks_its_output_and_starts_nothing():
    # a run's later batched layers (lead 0) take their input's sample dims: their output
    # is marked, and no samples, mode or hooks start before the run's first
    batched = BatchedModules()
    out = torch.zeros(3, 4)
    batched.watch(out, 0)
    try:
        assert batched.carries((out,)) and batched.samples is None
        assert batched._mode is None and batched._handles == ()
    finally:
        batched.close()
