"""A real SVI run: a small Bayesian MLP on scikit-learn's digits."""

import pyro
import pytest
import torch
from pyro.infer import SVI, Predictive, TraceMeanField_ELBO
from pyro.infer.autoguide import init_to_sample

from pyro_vinit import AutoKTiedNormal, AutoRadialNormal
from pyro_vinit.data import load_digits
from pyro_vinit.nn import BayesianClassifier, bayesianize, mlp


@pytest.mark.parametrize("Guide", [AutoKTiedNormal, AutoRadialNormal])
def test_digits_mlp_accuracy(Guide):
    x, y, x_test, y_test = load_digits()
    model = BayesianClassifier(bayesianize(mlp((64, 32, 10)), prior_scale=1.0), num_data=len(x))
    guide = Guide(model, init_scale=1e-2, init_loc_fn=init_to_sample)
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 1e-2}), TraceMeanField_ELBO())
    for _ in range(1000):
        idx = torch.randint(0, len(x), (256,))
        svi.step(x[idx], y[idx])
    logits = Predictive(model, guide=guide, num_samples=20, return_sites=["_RETURN"])(x_test)
    probs = logits["_RETURN"].softmax(-1).mean(0)
    accuracy = (probs.argmax(-1) == y_test).float().mean().item()
    # Measured at seed 0: 0.956 (k-tied), 0.967 (radial); chance is 0.1.
    assert accuracy >= 0.90
