"""
The only module that imports Pyro's private helpers or relies on Pyro's
private attributes, so that a Pyro upgrade that moves or removes one touches
this file alone (``tests/test_pyro_compat.py`` checks each of them).
"""

from operator import attrgetter

import torch
from pyro.infer.autoguide.utils import deep_setattr, helpful_support_errors

__all__ = [
    "deep_setattr",
    "helpful_support_errors",
    "pyro_sample_priors",
    "share_prototype",
    "unconstrained_param",
]


def unconstrained_param(module: torch.nn.Module, name: str) -> torch.nn.Parameter:
    """The unconstrained :class:`~torch.nn.Parameter` behind the
    :class:`~pyro.nn.PyroParam` at the dotted attribute ``name`` of a
    :class:`~pyro.nn.PyroModule` (PyroModule keeps it at ``<name>_unconstrained``)."""
    param = attrgetter(name + "_unconstrained")(module)
    if not isinstance(param, torch.nn.Parameter):
        raise RuntimeError(
            f"expected the PyroParam {name!r} to be stored as the torch Parameter "
            f"{name + '_unconstrained'!r}, found {type(param).__name__}; this Pyro version "
            "stores PyroParams differently: update pyro_vinit/_pyro_compat.py"
        )
    return param


def share_prototype(source, target) -> None:
    """Gives the autoguide ``target`` the prototype trace (and plate frames) of the
    set-up autoguide ``source`` of the same model, as if ``target`` had run the
    model itself (AutoGuide keeps the frames in ``_prototype_frames``)."""
    frames = getattr(source, "_prototype_frames", None)
    if source.prototype_trace is None or not isinstance(frames, dict):
        raise RuntimeError(
            f"expected the set-up {type(source).__name__} to hold prototype_trace and a "
            "_prototype_frames dict; this Pyro version sets guides up differently: update "
            "pyro_vinit/_pyro_compat.py"
        )
    target.prototype_trace = source.prototype_trace
    target._prototype_frames = dict(frames)


def pyro_sample_priors(module: torch.nn.Module) -> dict:
    """The priors of the :class:`~pyro.nn.PyroSample` attributes of ``module``
    (not of its submodules), by attribute name; ``{}`` for a plain module
    (PyroModule keeps them in ``_pyro_samples``)."""
    samples = getattr(module, "_pyro_samples", None)
    if samples is None:
        return {}
    if not isinstance(samples, dict):
        raise RuntimeError(
            "expected PyroModule._pyro_samples to be a dict; this Pyro version keeps "
            "PyroSamples differently: update pyro_vinit/_pyro_compat.py"
        )
    return dict(samples)
