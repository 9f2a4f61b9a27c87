"""Guards the public surface: every module is importable and every name in
an ``__all__`` exists."""

import importlib
import pkgutil

import pytest

import pyro_vinit

MODULES = sorted(
    info.name
    for info in pkgutil.walk_packages(pyro_vinit.__path__, prefix="pyro_vinit.")
)


@pytest.mark.parametrize("name", MODULES)
def test_all_names_exist(name):
    module = importlib.import_module(name)
    for attr in getattr(module, "__all__", []):
        assert hasattr(module, attr), f"{name}.__all__ lists missing {attr!r}"


def test_public_modules_have_all():
    public = [m for m in MODULES if not any(p.startswith("_") for p in m.split("."))]
    missing = [m for m in public if not hasattr(importlib.import_module(m), "__all__")]
    assert not missing, f"modules without __all__: {missing}"


def test_top_level_api():
    for name in ["AutoKTiedNormal", "AutoRadialNormal", "distributions"]:
        assert name in pyro_vinit.__all__
    assert pyro_vinit.distributions.RadialNormal is not None
    # Submodules are attributes after a plain ``import pyro_vinit``, as in Pyro.
    for name in ["data", "guides", "initialization", "metrics", "nn", "poutine", "schedules"]:
        assert name in pyro_vinit.__all__
        assert getattr(pyro_vinit, name) is importlib.import_module(f"pyro_vinit.{name}")
