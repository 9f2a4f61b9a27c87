"""Guards the public surface: every module is importable and every name in
an ``__all__`` exists."""

import importlib
import inspect
import pkgutil
import sys

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
    for name in ["AutoKTiedNormal", "AutoMeanFieldNormal", "AutoRadialNormal", "distributions",
                 "fit", "fit_config", "FitConfig", "FitHistory"]:
        assert name in pyro_vinit.__all__
    assert pyro_vinit.distributions.RadialNormal is importlib.import_module(
        "pyro_vinit.distributions.radial_normal"
    ).RadialNormal
    # Submodules are attributes after a plain ``import pyro_vinit``, as in Pyro.
    for name in ["data", "guides", "initialization", "metrics", "nn", "poutine", "schedules",
                 "training"]:
        assert name in pyro_vinit.__all__
        assert getattr(pyro_vinit, name) is importlib.import_module(f"pyro_vinit.{name}")


PACKAGES = ["pyro_vinit"] + [
    m for m in MODULES if hasattr(importlib.import_module(m), "__path__") and "._" not in m
]


@pytest.mark.parametrize("name", PACKAGES)
def test_reexports_are_the_defining_objects(name):
    # A package re-exports modules, classes and functions only, each the very object
    # that its defining module lists in its own __all__ (not a stale alias or a wrapper).
    package = importlib.import_module(name)
    for attr in package.__all__:
        obj = getattr(package, attr)
        if inspect.ismodule(obj):
            assert obj.__name__ == f"{name}.{attr}", attr
            continue
        assert inspect.isclass(obj) or inspect.isfunction(obj), f"{name}.{attr} is {obj!r}"
        defining = sys.modules[obj.__module__]
        assert obj.__name__ == attr, f"{name}.{attr} is {obj.__module__}.{obj.__name__}"
        assert attr in getattr(defining, "__all__", ()), f"{obj.__module__}.__all__ lacks {attr}"
        assert getattr(defining, attr) is obj
