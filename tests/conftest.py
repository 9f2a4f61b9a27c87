import os

import pyro
import pytest
import torch


def pytest_addoption(parser):
    parser.addoption(
        "--device", default="cpu",
        help="torch device of the device-aware tests (those taking the `device` fixture), "
             "e.g. cuda; `make gpu-check` runs them with --device cuda")


@pytest.fixture
def device(request):
    """The torch device of ``--device``; the test is skipped where it is not available."""
    name = request.config.getoption("--device")
    found = torch.device(name)
    if found.type == "cuda" and not torch.cuda.is_available():
        pytest.skip(f"--device {name}: CUDA is not available here")
    return found


@pytest.fixture(autouse=True)
def _pyro_defaults():
    """As in Pyro's own suite: seed, clear the param store, validate."""
    pyro.set_rng_seed(0)
    pyro.clear_param_store()
    with pyro.validation_enabled(True):
        yield
    pyro.clear_param_store()


def pytest_configure(config):
    # Two cores: one thread in each of pytest-xdist's two workers (`-n 2`), two without it.
    torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else 2)
    config.addinivalue_line(
        "markers", "device: takes the `device` fixture (selected by `make gpu-check`: -m device)")


# The modules of the smoke runs of the scripts, each test tens of seconds: run first, so
# that pytest-xdist's two workers (`make test`) are not left waiting on one at the end.
_SLOW_FIRST = ("test_benchmarks.py", "test_reproduce.py", "test_examples.py", "test_docs.py")


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: item.path.name not in _SLOW_FIRST)  # stable: order kept
    for item in items:
        if "device" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.device)
