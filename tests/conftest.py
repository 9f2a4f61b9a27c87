import pyro
import pytest
import torch


@pytest.fixture(autouse=True)
def _pyro_defaults():
    """As in Pyro's own suite: seed, clear the param store, validate."""
    pyro.set_rng_seed(0)
    pyro.clear_param_store()
    with pyro.validation_enabled(True):
        yield
    pyro.clear_param_store()


def pytest_configure(config):
    torch.set_num_threads(2)
