"""
Warnings that point at the user's line: the first frame outside ``pyro_vinit``
(and outside the wrapper of ``torch.compiler.disable``), however deep in the
library (``fit`` calling :class:`~pyro_vinit.CapturedSVI`, a step calling its
tracing, a handler's exit) they are raised.
"""

import os
import sys
import warnings
from typing import Type

import torch

__all__ = ["warn_at_caller"]

_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep
#: torch's wrapper of a function under torch.compiler.disable (a handler's __exit__)
_DYNAMO = os.path.join(os.path.dirname(os.path.abspath(torch.__file__)), "_dynamo") + os.sep


def warn_at_caller(message: str, category: Type[Warning]) -> None:
    """``warnings.warn(message, category)`` attributed to the innermost frame
    of the call stack whose file is neither in ``pyro_vinit`` nor torch's
    ``torch.compiler.disable`` wrapper."""
    frame = sys._getframe(1)
    level = 2  # the caller of this function
    while frame.f_back is not None and os.path.abspath(frame.f_code.co_filename).startswith(
            (_PACKAGE, _DYNAMO)):
        frame = frame.f_back
        level += 1
    warnings.warn(message, category, stacklevel=level)
