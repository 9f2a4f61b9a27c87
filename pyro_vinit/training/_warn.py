"""
Warnings that point at the user's line: the first frame outside ``pyro_vinit``,
however deep in the library (``fit`` calling :class:`~pyro_vinit.CapturedSVI`,
a step calling its tracing) they are raised.
"""

import os
import sys
import warnings
from typing import Type

__all__ = ["warn_at_caller"]

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def warn_at_caller(message: str, category: Type[Warning]) -> None:
    """``warnings.warn(message, category)`` attributed to the innermost frame
    of the call stack whose file is not in ``pyro_vinit``."""
    frame = sys._getframe(1)
    level = 2  # the caller of this function
    while frame.f_back is not None and os.path.abspath(frame.f_code.co_filename).startswith(
            _PACKAGE):
        frame = frame.f_back
        level += 1
    warnings.warn(message, category, stacklevel=level)
