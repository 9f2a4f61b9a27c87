import pyro
import pyro.distributions as dist
import pytest
import torch
import torch.nn.functional as F

from pyro_vinit.poutine import (
    FlipoutMessenger,
    LayerCallMessenger,
    LocalReparamMessenger,
    flipout,
    local_reparam,
)
from pyro_vinit.poutine._site_value import SiteValue

_FUNCTIONS = ("linear", "conv1d", "conv2d", "conv3d")
HANDLERS = [LayerCallMessenger, LocalReparamMessenger, FlipoutMessenger]


def _model(x):
    w = pyro.sample("w", dist.Normal(torch.zeros(3, 4), 1.0).to_event(2))
    return F.linear(x, w)


@pytest.mark.parametrize("handler", HANDLERS)
def test_functional_identity_restored(handler):
    before = {name: getattr(F, name) for name in _FUNCTIONS}
    with handler():
        _model(torch.randn(2, 4))
    assert {name: getattr(F, name) for name in _FUNCTIONS} == before
    with pytest.raises(KeyError):
        with handler():
            _model(torch.randn(2, 4))
            raise KeyError("inside")
    assert all(getattr(F, name) is fn for name, fn in before.items())
    assert not torch.overrides._is_torch_function_mode_enabled()
    # and a new handler can be entered afterwards
    with handler():
        _model(torch.randn(2, 4))


@pytest.mark.parametrize("outer", HANDLERS)
@pytest.mark.parametrize("inner", HANDLERS)
def test_nesting_raises(outer, inner):
    with outer():
        with pytest.raises(RuntimeError, match="nesting two layer-call handlers"):
            with inner():
                pass
    with inner():  # the failed entry left nothing behind
        _model(torch.randn(2, 4))


def test_handler_functions():
    assert isinstance(local_reparam(), LocalReparamMessenger)
    assert isinstance(flipout(), FlipoutMessenger)
    wrapped = local_reparam(_model, strict=True)
    assert wrapped(torch.randn(5, 4)).shape == (5, 3)
    with pytest.raises(ValueError, match="not callable"):
        local_reparam(3)
    with pytest.raises(TypeError, match="low_rank"):
        LocalReparamMessenger(low_rank="yes")
    with pytest.raises(TypeError, match="strict"):
        FlipoutMessenger(strict="yes")


def test_site_values_behave_like_tensors():
    with pytest.warns(UserWarning, match="'w': it never reached a layer call"), \
            LocalReparamMessenger():
        w = pyro.sample("w", dist.Normal(torch.zeros(3, 4), 1.0).to_event(2))
        assert isinstance(w, SiteValue) and w.is_deferred
        assert w.shape == (3, 4) and w.dtype == torch.float32 and w.dim() == 2
        assert w.is_deferred  # shape queries do not draw
        total = w.sum()
        assert not w.is_deferred and type(total) is torch.Tensor
    torch.testing.assert_close(total, w.concrete.sum())
    assert torch.equal(w + 1, w.concrete + 1)  # still usable after the context


class _Recorder(LayerCallMessenger):
    def __init__(self):
        super().__init__()
        self.calls = []

    def _process_layer_call(self, call):
        self.calls.append((call.op, call.weight_name, call.bias_name, dict(call.kwargs)))
        return None


def test_mode_sees_calls_and_sites():
    linear = torch.nn.Linear(4, 3)

    def model(x):
        w = pyro.sample("w", dist.Normal(torch.zeros(2, 3, 3, 3), 1.0).to_event(4))
        b = pyro.sample("b", dist.Normal(torch.zeros(2), 1.0).to_event(1))
        h = F.conv2d(x, w, b, stride=2)
        return linear(h.flatten(1)[:, :4])

    with _Recorder() as rec:
        model(torch.randn(1, 3, 8, 8))
    assert rec.calls == [
        ("conv2d", "w", "b", {"stride": 2, "padding": 0, "dilation": 1, "groups": 1}),
        ("linear", None, None, {}),
    ]
