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


@pytest.mark.parametrize("kwargs, match", [
    ({"elbo_module": TraceMeanField_ELBO()}, "elbo_module must be an ELBO module"),
    ({"annealing": 0.5}, "annealing must be a KLAnnealingMessenger"),
    ({"weight_noise": local_reparam()}, "not local_reparam()"),
])
def test_bad_arguments(kwargs, match):
    elbo, _, _ = _elbo_module()
    with pytest.raises(TypeError, match=match):
        HandledELBO(**{"elbo_module": elbo, **kwargs})
