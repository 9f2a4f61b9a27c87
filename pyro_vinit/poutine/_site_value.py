"""
The stand-in tensor that a layer-call handler puts in place of a sample
site's value, so that the layers using the value can be found without
slowing down any other tensor operation.
"""

import functools
from typing import Any, Callable, List, Optional

import torch
from torch.distributions import Distribution

__all__: list = []

# The active layer-call handler, if any (at most one: nesting is refused).
ACTIVE: list = []

_T = torch.Tensor

# Functions that only read shape, dtype or device: answered from the stand-in itself,
# so that a deferred value is not drawn just to learn its shape.
_METADATA = {
    _T.shape.__get__,
    _T.dtype.__get__,
    _T.device.__get__,
    _T.ndim.__get__,
    _T.layout.__get__,
    _T.is_cuda.__get__,
    _T.dim,
    _T.size,
    _T.numel,
    _T.nelement,
    _T.ndimension,
    _T.__len__,
    _T.is_floating_point,
    _T.is_complex,
    _T.element_size,
    _T.get_device,
}


@functools.lru_cache(maxsize=256)
def _placeholder(shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    # Storage-free stand-in data for deferred values: one zero, expanded.
    return torch.zeros((), dtype=dtype, device=device).expand(shape)


def unwrap(obj: Any) -> Any:
    """Replaces every :class:`SiteValue` in ``obj`` (nested in tuples, lists and
    dicts) by its real tensor, drawing deferred values."""
    if isinstance(obj, SiteValue):
        return obj.real
    if isinstance(obj, (tuple, list)):
        return type(obj)(unwrap(x) for x in obj)
    if isinstance(obj, dict):
        return {k: unwrap(v) for k, v in obj.items()}
    return obj


def contains_site_value(obj: Any) -> bool:
    if isinstance(obj, SiteValue):
        return True
    if isinstance(obj, (tuple, list)):
        return any(contains_site_value(x) for x in obj)
    return False


class SiteValue(torch.Tensor):
    """
    A sample site's value as seen by the model while a layer-call handler
    using ``interception = "site_values"`` is active.

    It has the shape, dtype and device of the real value and behaves like
    it in every torch operation: each operation runs on :attr:`real`. The
    real value is either given (:meth:`wrap`) or *deferred* (:meth:`defer`):
    drawn the first time an operation other than a shape query needs it,
    which under local reparameterization and a closed-form KL may be never.

    The handler sees, through :meth:`__torch_function__`, every ``F.linear``
    / ``F.conv*d`` call with a stand-in among its arguments.

    :ivar dist: The distribution that drew the value, or None if unknown.
    :ivar list msgs: The sample-site messages holding this value, the one
        that drew it first.
    :ivar str derived: For a reshaped or cast site value, the name of the
        operation (the value is then not the site's own).
    :ivar list uses: A one-element list counting the layer calls and other
        matrix products that used the value so far; shared by every stand-in
        for the same draw (reshaped or cast ones, the model's value behind a
        ``Delta``), so that a second use of one weight sample is seen.
    """

    dist: Optional[Distribution]
    msgs: List[dict]
    derived: Optional[str]
    uses: List[int]
    _real: Optional[torch.Tensor]
    _thunk: Optional[Callable[[], torch.Tensor]]
    _grad_enabled: bool

    @classmethod
    def _new(cls, placeholder: torch.Tensor, dist, msgs, derived=None, uses=None) -> "SiteValue":
        self = torch.Tensor._make_subclass(cls, placeholder, False)
        self.dist, self.msgs, self.derived = dist, msgs, derived
        self.uses = [0] if uses is None else uses
        self._real, self._thunk = None, None
        return self

    @classmethod
    def wrap(
        cls,
        value: torch.Tensor,
        dist: Optional[Distribution],
        msgs: List[dict],
        derived: Optional[str] = None,
        uses: Optional[List[int]] = None,
    ) -> "SiteValue":
        """A stand-in for the existing tensor ``value`` (sharing its storage);
        ``uses`` is the use counter of the stand-in it derives from, if any."""
        self = cls._new(value.detach(), dist, msgs, derived, uses)
        self._real = value
        return self

    @classmethod
    def defer(
        cls,
        thunk: Callable[[], torch.Tensor],
        shape: torch.Size,
        like: torch.Tensor,
        dist: Optional[Distribution] = None,
        msgs: Optional[List[dict]] = None,
    ) -> "SiteValue":
        """A stand-in of ``shape`` (with the dtype and device of ``like``)
        whose real value ``thunk()`` is computed on first use, in the grad
        mode of now."""
        self = cls._new(_placeholder(shape, like.dtype, like.device), dist, msgs or [])
        self._thunk = thunk
        self._grad_enabled = torch.is_grad_enabled()
        return self

    @property
    def is_deferred(self) -> bool:
        """Whether the real value has not been computed yet."""
        return self._real is None

    @property
    def real(self) -> torch.Tensor:
        """The real value, computed now if it was deferred."""
        if self._real is None:
            with torch.set_grad_enabled(self._grad_enabled):
                self._real = unwrap(self._thunk())
            self._thunk = None
        return self._real

    @property
    def site(self) -> Optional[str]:
        """The name of the site whose value this is (the model's, when seen)."""
        return self.msgs[-1]["name"] if self.msgs else None

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        handler = ACTIVE[-1] if ACTIVE else None
        if handler is not None:
            out = handler._site_value_op(func, args, kwargs)
            if out is not NotImplemented:
                return out
        return func(*unwrap(args), **unwrap(kwargs))
