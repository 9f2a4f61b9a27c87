"""Which guides an initializer of this package has written, in this process."""

import weakref

from torch import nn

__all__ = ["mark_initialized", "marked_initialized"]

_INITIALIZED: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


def mark_initialized(guide: nn.Module) -> None:
    """Records that an initializer wrote ``guide``'s values."""
    _INITIALIZED.add(guide)


def marked_initialized(guide: nn.Module) -> bool:
    """Whether an initializer wrote ``guide``'s values (in this process)."""
    return guide in _INITIALIZED
