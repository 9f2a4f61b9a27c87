"""
The only module that imports Pyro's private helpers, so that a Pyro upgrade
that moves or removes one touches this file alone.
"""

from pyro.infer.autoguide.utils import deep_setattr, helpful_support_errors

__all__ = ["deep_setattr", "helpful_support_errors", "unwrap_init_messenger"]


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
