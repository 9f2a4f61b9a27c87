"""
What DistributedDataParallel and a torch.optim optimizer need of a guide:
every parameter exists after one call (DDP broadcasts and the optimizer
holds exactly those), none appears later, and each step gives every one a
gradient (``find_unused_parameters=False``).
"""

from contextlib import nullcontext

import pyro
import pytest
import torch
from pyro.infer import Trace_ELBO, TraceMeanField_ELBO
from pyro.infer.autoguide import AutoNormal, init_to_sample
from torch import nn

from pyro_vinit import AutoKTiedNormal, AutoRadialNormal, init_guide_iblm
from pyro_vinit.nn import BayesianClassifier, bayesianize, mlp
from pyro_vinit.poutine import KLAnnealingMessenger, flipout, local_reparam

GUIDES = {
    "AutoKTiedNormal": (lambda m: AutoKTiedNormal(m, rank=2, init_loc_fn=init_to_sample),
                        TraceMeanField_ELBO, local_reparam),
    "AutoRadialNormal": (lambda m: AutoRadialNormal(m, init_loc_fn=init_to_sample),
                         TraceMeanField_ELBO, flipout),
    "AutoNormal": (lambda m: AutoNormal(m, init_loc_fn=init_to_sample), Trace_ELBO, None),
    "AutoNormal+LRT": (lambda m: AutoNormal(m, init_loc_fn=init_to_sample), Trace_ELBO,
                       local_reparam),
}


def _net(kind):
    if kind == "mlp":
        return mlp((16, 5, 3)), torch.randn(12, 16)
    cnn = nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(), nn.Flatten(), nn.Linear(2 * 2 * 2, 3))
    return cnn, torch.randn(12, 1, 4, 4)


def _shapes(guide):
    return {k: tuple(v.shape) for k, v in guide.state_dict().items()}


@pytest.mark.parametrize("module_local_params", [True, False], ids=["local", "param_store"])
@pytest.mark.parametrize("kind", ["mlp", "cnn"])
@pytest.mark.parametrize("name", list(GUIDES))
def test_parameters_complete_after_first_call(name, kind, module_local_params):
    make_guide, elbo, handler = GUIDES[name]
    with pyro.settings.context(module_local_params=module_local_params):
        net, x = _net(kind)
        x = x.double()
        y = torch.randint(0, 3, (len(x),))
        model = BayesianClassifier(bayesianize(net).double(), num_data=100)
        guide = make_guide(model)
        guide(x[:1], y[:1])
        before = _shapes(guide)
        assert before, "the guide has no parameters after its first call"
        loss_fn = elbo()(model, guide)
        params = list(loss_fn.parameters())
        assert {id(p) for p in params} == {id(p) for p in guide.parameters()}
        assert sum(p.numel() for p in params) == sum(
            v.numel() for v in guide.state_dict().values())

        optim = torch.optim.Adam(params, lr=0.01)
        annealing = KLAnnealingMessenger(0.5)
        for batch in (x[:4], x):  # another batch size than the first call's
            optim.zero_grad()
            with annealing, (handler() if handler else nullcontext()):
                loss = loss_fn(batch, y[: len(batch)])
            loss.backward()
            unused = [n for n, p in loss_fn.named_parameters() if p.grad is None]
            assert not unused, f"parameters without a gradient: {unused}"
            optim.step()
        assert _shapes(guide) == before
        # the optimizer trained the very tensors the guide reads
        assert all(p is q for p, q in zip(params, loss_fn.parameters()))


@pytest.mark.parametrize("name", ["AutoKTiedNormal", "AutoRadialNormal", "AutoNormal"])
def test_iblm_keeps_the_parameter_set(name):
    """I-BLM writes values only: the same parameters as after a plain first
    call, so the optimizer and DDP can be built after it."""
    make_guide = GUIDES[name][0]
    x, y = torch.randn(60, 16, dtype=torch.float64), torch.randint(0, 3, (60,))
    shapes = []
    for init in ("call", "iblm"):
        pyro.clear_param_store()
        model = BayesianClassifier(bayesianize(mlp((16, 5, 3))).double(), num_data=60)
        guide = make_guide(model)
        if init == "iblm":
            init_guide_iblm(guide, (x, y), batch_size=20)
        else:
            guide(x[:1], y[:1])
        shapes.append(_shapes(guide))
    assert shapes[0] == shapes[1]
