"""Step 4 of I-BLM: the fits and the noise level written into the guide."""

import re

import pyro
import pyro.distributions as dist
import pytest
import torch
import torch.nn.functional as F
from pyro.infer.autoguide import AutoNormal

from pyro_vinit import init_guide_iblm

F64 = torch.float64


def _model(x, y=None):
    """y = x w + noise, w ~ N(0, 1), with a latent noise std sigma ~ LogNormal(0, 1)."""
    w = pyro.sample("w", dist.Normal(torch.tensor(0.0, dtype=F64), 1.0)
                    .expand([1, x.shape[1]]).to_event(2))
    sigma = pyro.sample("sigma", dist.LogNormal(torch.tensor(0.0, dtype=F64), 1.0))
    with pyro.plate("data", x.shape[0]):
        pyro.sample("obs", dist.Normal(F.linear(x, w).squeeze(-1), sigma), obs=y)


@pytest.mark.parametrize("n, spread", [(20, 0.1), (50, 0.1), (60, 120**-0.5), (800, 1600**-0.5)])
def test_noise_site_std_is_that_of_log_sigma_capped_at_a_tenth(n, spread):
    # the posterior std of log sigma from n residuals is about 1 / sqrt(2 n); at most 0.1
    x = torch.randn(n, 3, dtype=F64)
    y = x @ torch.tensor([1.0, -2.0, 0.5], dtype=F64) + 0.3 * torch.randn(n, dtype=F64)
    guide = AutoNormal(_model)
    init_guide_iblm(guide, (x, y), batch_size=min(n, 128), noise_scale=0.3)
    torch.testing.assert_close(guide.scales.sigma, torch.tensor(spread, dtype=F64), atol=0,
                               rtol=1e-12)


def test_a_module_local_noise_param_is_refused_and_the_guide_kept():
    # under module_local_params the regressor's learned noise is its module's own, not in
    # the param store through which I-BLM sets it: a clear error, the guide unchanged
    from pyro_vinit import AutoKTiedNormal
    from pyro_vinit.nn import BayesianRegressor, bayesianize, mlp

    x, y = torch.randn(64, 4), torch.randn(64)
    with pyro.settings.context(module_local_params=True):
        model = BayesianRegressor(bayesianize(mlp((4, 8, 1))), num_data=64, learn_noise=True)
        guide = AutoKTiedNormal(model, rank=2)
        guide(x, y)
        before = {k: v.detach().clone() for k, v in guide.state_dict().items()}
        message = ("I-BLM sets the model's learned noise param 'noise_scale' through Pyro's "
                   "param store, which does not hold it (under pyro.settings.set("
                   "module_local_params=True) it is its module's own): run I-BLM with "
                   "module_local_params=False, or pass init=None to fit")
        with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
            init_guide_iblm(guide, (x, y), batch_size=32)
        after = guide.state_dict()
        assert before.keys() == after.keys()
        assert all(torch.equal(before[k], after[k]) for k in before)


class _ParameterNoise(pyro.nn.PyroModule):
    """A PyroModule regressor whose log noise std is its own nn.Parameter."""

    def __init__(self, num_data, param_noise):
        super().__init__()
        self.fc = pyro.nn.PyroModule[torch.nn.Linear](3, 1).double()
        self.fc.weight = pyro.nn.PyroSample(dist.Normal(torch.tensor(0.0, dtype=F64), 1.0)
                                            .expand([1, 3]).to_event(2))
        self.fc.bias = pyro.nn.PyroSample(dist.Normal(torch.tensor(0.0, dtype=F64), 1.0)
                                          .expand([1]).to_event(1))
        if not param_noise:
            self.log_sigma = torch.nn.Parameter(torch.tensor(0.0, dtype=F64))
        self.num_data, self.param_noise = num_data, param_noise

    def forward(self, x, y=None):
        log_sigma = (pyro.param("log_sigma", torch.tensor(0.0, dtype=F64))
                     if self.param_noise else self.log_sigma)
        mean = self.fc(x).squeeze(-1)
        with pyro.plate("data", self.num_data, subsample_size=len(x)):
            pyro.sample("obs", dist.Normal(mean, log_sigma.exp()), obs=y)


def test_a_modules_own_noise_parameter_is_set_as_a_pyro_param_is():
    # a PyroModule's nn.Parameter ignores the value pyro.param returns, so the search for
    # its level, which substituted that value, saw exp(0) = 1 at every trial and refused
    x = torch.randn(300, 3, dtype=F64)
    y = x @ torch.tensor([1.0, -2.0, 0.5], dtype=F64) + 0.1 * torch.randn(300, dtype=F64)
    levels = []
    for param_noise in (True, False):
        pyro.clear_param_store()
        model = _ParameterNoise(300, param_noise)
        init_guide_iblm(AutoNormal(model), (x, y), batch_size=128)
        levels.append(pyro.get_param_store()["log_sigma"].detach().clone())
    torch.testing.assert_close(levels[1], levels[0], rtol=1e-9, atol=0)
    assert 0.05 < levels[0].exp() < 0.2  # the residuals' std, about 0.1
    assert torch.equal(model.log_sigma.detach(), levels[1])  # the module's own parameter


class _FlooredNoise(_ParameterNoise):
    def forward(self, x, y=None):  # a scale of at least 1: a std of 0.1 is out of reach
        mean = self.fc(x).squeeze(-1)
        with pyro.plate("data", self.num_data, subsample_size=len(x)):
            pyro.sample("obs", dist.Normal(mean, self.log_sigma.exp().clamp(min=1.0)), obs=y)


def test_a_noise_parameter_that_cannot_reach_the_level_is_left_as_it_was():
    x = torch.randn(300, 3, dtype=F64)
    y = x @ torch.tensor([1.0, -2.0, 0.5], dtype=F64) + 0.1 * torch.randn(300, dtype=F64)
    model = _FlooredNoise(300, param_noise=False)
    with torch.no_grad():
        model.log_sigma.fill_(0.25)
    with pytest.raises(ValueError, match="cannot make the likelihood's scale that"):
        init_guide_iblm(AutoNormal(model), (x, y), batch_size=128)
    assert model.log_sigma.item() == 0.25
