"""
The only module that imports Pyro's private helpers or relies on Pyro's
private attributes, so that a Pyro upgrade that moves or removes one touches
this file alone (``tests/test_pyro_compat.py`` checks each of them).
"""

from operator import attrgetter

import torch
from pyro.infer.autoguide.utils import deep_setattr, helpful_support_errors

__all__ = ["deep_setattr", "helpful_support_errors", "unconstrained_param", "unwrap_init_messenger"]


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



def unwrap_init_messenger(model):
    """The model an autoguide was built from, without the
    :class:`~pyro.infer.autoguide.initialization.InitMessenger` the guide
    wraps around it (Pyro keeps only the wrapped callable, ``guide.model``,
    a partial of its private ``_context_wrap``)."""
    from functools import partial

    from pyro.infer.autoguide.initialization import InitMessenger
    from pyro.poutine.messenger import _context_wrap

    while True:
        fn = model
        while isinstance(fn, partial) and isinstance(fn.func, partial):
            fn = fn.func
        if not (
            isinstance(fn, partial)
            and fn.func is _context_wrap
            and len(fn.args) == 2
            and isinstance(fn.args[0], InitMessenger)
        ):
            return model
        model = fn.args[1]
