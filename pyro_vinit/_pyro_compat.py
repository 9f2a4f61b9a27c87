"""
The only module that imports Pyro's private helpers or relies on Pyro's
private attributes, so that a Pyro upgrade that moves or removes one touches
this file alone (``tests/test_pyro_compat.py`` checks each of them).
"""

from operator import attrgetter

import torch
from pyro.infer.autoguide.utils import deep_setattr, helpful_support_errors

__all__ = ["deep_setattr", "helpful_support_errors", "unconstrained_param"]


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
