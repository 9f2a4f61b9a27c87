"""
Warnings that point at the user's line: the first frame outside ``pyro_vinit``,
torch and Pyro, however deep in the library (``fit`` calling
:class:`~pyro_vinit.CapturedSVI`, a step calling its tracing, a handler's exit,
a guide's set-up under ``nn.Module.__call__``) they are raised.
"""

import os
import sys
import warnings
from typing import Type

import pyro
import torch

__all__ = ["warn_at_caller"]

#: the library, and the frameworks that call into it: torch (``nn.Module.__call__``,
#: ``torch.compiler.disable``'s wrapper of a handler's ``__exit__``) and Pyro (a
#: ``PyroModule``'s call, an ELBO running the guide)
_LIBRARIES = tuple(os.path.dirname(os.path.abspath(path)) + os.sep
                   for path in (__file__, str(torch.__file__), str(pyro.__file__)))


def warn_at_caller(message: str, category: Type[Warning]) -> None:
    """``warnings.warn(message, category)`` attributed to the innermost frame
    of the call stack whose file is not in ``pyro_vinit``, torch or Pyro."""
    frame = sys._getframe(1)
    level = 2  # the caller of this function
    while frame.f_back is not None and os.path.abspath(frame.f_code.co_filename).startswith(
            _LIBRARIES):
        frame = frame.f_back
        level += 1
    warnings.warn(message, category, stacklevel=level)
