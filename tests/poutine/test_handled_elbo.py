"""HandledELBO: the ELBO module under the KL annealing and weight-noise handlers."""

import pyro
import pytest
import torch
from pyro.infer import TraceMeanField_ELBO
from pyro.infer.autoguide import AutoNormal

from pyro_vinit.nn import BayesianClassifier, bayesianize, mlp
from pyro_vinit.poutine import HandledELBO, KLAnnealingMessenger, local_reparam


def _elbo_module():
    with pyro.settings.context(module_local_params=True):
        model = BayesianClassifier(bayesianize(mlp((4, 6, 3))).double(), num_data=50)
        guide = AutoNormal(model)
        x = torch.randn(10, 4, dtype=torch.float64)
        y = torch.randint(0, 3, (10,))
        guide(x, y)
        return TraceMeanField_ELBO()(model, guide), x, y


def test_loss_is_the_elbo_under_the_handlers():
    elbo, x, y = _elbo_module()
    annealing = KLAnnealingMessenger(0.25)
    loss_fn = HandledELBO(elbo, annealing, local_reparam)
    pyro.set_rng_seed(1)
    actual = loss_fn(x, y)
    pyro.set_rng_seed(1)
    with KLAnnealingMessenger(0.25), local_reparam():
        expected = elbo(x, y)
    assert torch.equal(actual, expected)
    # the handlers act: another KL weight, or no local reparameterization, give other losses
    pyro.set_rng_seed(1)
    assert not torch.equal(HandledELBO(elbo, KLAnnealingMessenger(1.0), local_reparam)(x, y),
                           actual)
    pyro.set_rng_seed(1)
    assert not torch.equal(HandledELBO(elbo, annealing)(x, y), actual)


def test_a_fresh_weight_noise_handler_per_evaluation_and_annealing_state_kept():
    elbo, x, y = _elbo_module()
    made = []

    def weight_noise():
        made.append(local_reparam())
        return made[-1]

    annealing = KLAnnealingMessenger(lambda t: min(t / 2, 1.0))
    loss_fn = HandledELBO(elbo, annealing, weight_noise)
    for _ in range(3):
        loss_fn(x, y)
        annealing.step()
    assert len(made) == 3 and len({id(m) for m in made}) == 3
    assert loss_fn.annealing is annealing and annealing.iteration == 3


def test_parameters_are_the_elbo_modules():
    elbo, x, y = _elbo_module()
    loss_fn = HandledELBO(elbo, KLAnnealingMessenger(0.5), local_reparam)
    assert [id(p) for p in loss_fn.parameters()] == [id(p) for p in elbo.parameters()]
    loss_fn(x, y).backward()
    assert all(p.grad is not None for p in loss_fn.parameters())


def test_keyword_arguments_reach_the_model():
    elbo, x, y = _elbo_module()
    loss_fn = HandledELBO(elbo, KLAnnealingMessenger(0.5))
    pyro.set_rng_seed(2)
    positional = loss_fn(x, y)
    pyro.set_rng_seed(2)
    assert torch.equal(loss_fn(x, y=y), positional)


@pytest.mark.parametrize("kwargs, match", [
    ({"elbo_module": TraceMeanField_ELBO()},
     r"^HandledELBO: elbo_module must be an ELBO module, .* got TraceMeanField_ELBO$"),
    ({"annealing": 0.5},
     r"^HandledELBO: annealing must be a KLAnnealingMessenger or None, got float$"),
    ({"weight_noise": local_reparam()},
     r"^HandledELBO: weight_noise must be a function .*\), got LocalReparamMessenger$"),
])
def test_bad_arguments(kwargs, match):
    elbo, _, _ = _elbo_module()
    with pytest.raises(TypeError, match=match):
        HandledELBO(**{"elbo_module": elbo, **kwargs})


def test_guide_not_set_up_is_refused_with_what_to_do():
    # An autoguide that has not run has no parameters yet (DDP and optimizers would get
    # none): refused. Once set up, or a guide with no prototype trace (a function), it is
    # accepted.
    with pyro.settings.context(module_local_params=True):
        model = BayesianClassifier(bayesianize(mlp((4, 6, 3))), num_data=50)
        guide = AutoNormal(model)
        with pytest.raises(ValueError) as error:
            HandledELBO(TraceMeanField_ELBO()(model, guide))
        assert str(error.value) == (
            "HandledELBO: the guide has not been set up yet, so the ELBO module has no "
            "parameters (DistributedDataParallel and optimizers would get none): run "
            "guide(x, y) once on a batch, or init_guide_iblm(guide, (x, y)), before "
            "building the module")
        guide(torch.randn(10, 4), torch.randint(0, 3, (10,)))
        HandledELBO(TraceMeanField_ELBO()(model, guide))

        def function_guide(x, y=None):  # its parameters live in the param store
            pass

        HandledELBO(TraceMeanField_ELBO()(model, function_guide))


class _Loss(torch.nn.Module):
    # A user's own loss module around the ELBO module: it has no guide attribute.
    def __init__(self, elbo):
        super().__init__()
        self.inner = elbo

    def forward(self, x, y):
        return self.inner(x, y)


def test_a_loss_module_without_a_guide_is_accepted():
    # The set-up check reads a guide only where the module has one; the loss is the
    # wrapped module's under the handlers.
    elbo, x, y = _elbo_module()
    loss_fn = HandledELBO(_Loss(elbo), KLAnnealingMessenger(0.25))
    assert not hasattr(loss_fn.elbo, "guide")
    pyro.set_rng_seed(1)
    actual = loss_fn(x, y)
    pyro.set_rng_seed(1)
    with KLAnnealingMessenger(0.25):
        expected = elbo(x, y)
    assert torch.equal(actual, expected)
