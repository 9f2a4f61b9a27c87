"""
The stand-in tensor that a layer-call handler puts in place of a sample
site's value, so that the layers using the value can be found without
slowing down any other tensor operation.
"""

import functools
import sys
from typing import (
    Any,
    Callable,
    Dict,
    List,
    Optional,
    Protocol,
    Tuple,
    TypeVar,
    cast,
)

import torch
from torch.distributions import Distribution
from torch.fx.experimental import proxy_tensor

from pyro_vinit._typing import SampleSite
from pyro_vinit.poutine._tensor_ops import (
    NEW_LIKE,
    SHAPE_QUERIES,
    ViewOp,
    element_index,
    getter,
    is_view_op,
    repeats,
    split_views,
)

__all__: List[str] = []


class SiteValueHandler(Protocol):
    """What :meth:`SiteValue.__torch_function__` calls on the active handler."""

    def _site_value_op(
        self, func: Callable[..., Any], args: Tuple[Any, ...], kwargs: Dict[str, Any]
    ) -> Any:
        """The result of ``func(*args, **kwargs)``, or NotImplemented to run it as usual."""


# The active layer-call handler, if any (at most one: nesting is refused).
ACTIVE: List[SiteValueHandler] = []

_T = torch.Tensor
_F = TypeVar("_F", bound=Callable[..., Any])



def eager(fn: _F) -> _F:
    """:func:`torch.compiler.disable`, keeping ``fn``'s type."""
    # torch's decorator is unannotated; it returns a function of the same signature.
    return cast(_F, torch.compiler.disable(fn))  # type: ignore[no-untyped-call]


_GRAD = getter("grad")

# The frames passed over as torch's: torch's own, and those of the trampolines through
# which mutation testing (mutmut, tools/mutate.py) calls every function of the package.
_PASSED_OVER = ("torch.", "mutmut.")


def from_the_model(*dispatch: str) -> bool:
    """Whether the operation being handled came from a model's own code: the first
    caller outside torch and the ``dispatch`` modules (those that handle it) is neither
    Pyro nor this library (whose distributions' draws and handlers' layers view and
    reshape their tensors on purpose)."""
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if name not in dispatch and not name.startswith(_PASSED_OVER):
            return (not name.startswith(("pyro.", "pyro_vinit."))
                    or name.startswith("pyro_vinit.testing"))
        frame = frame.f_back  # type: ignore[assignment]
    return False


@functools.lru_cache(maxsize=256)
def _placeholder(shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    # Storage-free stand-in data for deferred values: one zero, expanded.
    return torch.zeros((), dtype=dtype, device=device).expand(shape)


def unwrap(obj: Any) -> Any:
    """Replaces every :class:`SiteValue` in ``obj`` (nested in tuples, lists and
    dicts) by its concrete tensor, drawing deferred values."""
    if isinstance(obj, SiteValue):
        return obj.concrete
    if isinstance(obj, (tuple, list)):
        return type(obj)(unwrap(x) for x in obj)
    if isinstance(obj, dict):
        return {k: unwrap(v) for k, v in obj.items()}
    return obj



class Uses:
    """
    Which elements of one draw the layer calls and matrix products of a run
    have used, shared by every stand-in of the draw (its views, the model's
    value behind a ``Delta``), so that a second use of the same elements
    (a tied weight) is seen, while disjoint slices of one draw (as
    :class:`~pyro.infer.autoguide.AutoDiagonalNormal` hands each site) are
    not mistaken for one.
    """

    __slots__ = ("shape", "whole", "mask", "noised")

    def __init__(self, shape: torch.Size) -> None:
        self.shape = shape
        self.whole = False
        self.mask: Optional[torch.Tensor] = None
        #: Whether a use got per-example noise (then no other use may follow).
        self.noised = False

    def used(self) -> bool:
        """Whether a layer call or matrix product has used any element."""
        return self.whole or (self.mask is not None and bool(self.mask.any()))

    def add(self, view_ops: Optional[Tuple[ViewOp, ...]]) -> bool:
        """Records a use of the elements that ``view_ops`` selects (all of
        them if None); returns whether any of them had been used before."""
        # bookkeeping of shapes, not of values: outside a trace of the step (CapturedSVI),
        # which could not branch on its mask
        if proxy_tensor.get_proxy_mode() is None:  # (the eager step: nothing to leave)
            return self._add(view_ops)
        with proxy_tensor.disable_proxy_modes_tracing():
            return self._add(view_ops)

    def _add(self, view_ops: Optional[Tuple[ViewOp, ...]]) -> bool:
        index = None if view_ops is None else _indices(self.shape, view_ops)
        if index is None:
            seen = self.whole or (self.mask is not None and bool(self.mask.any()))
            self.whole = True
            return seen
        if self.whole:
            return True
        if self.mask is None:
            self.mask = torch.zeros(self.shape.numel(), dtype=torch.bool)
        seen = bool(self.mask[index].any())
        self.mask[index] = True
        return seen


def _indices(shape: torch.Size, view_ops: Tuple[ViewOp, ...]) -> Optional[torch.Tensor]:
    # The flat indices of the drawn elements a view holds, or None for all of them.
    index = element_index(shape, view_ops)
    return None if index is None or index.numel() == shape.numel() else index.reshape(-1)


class SiteValue(torch.Tensor):
    """
    A sample site's value as seen by the model while a layer-call handler is
    active.

    It has the shape, dtype and device of the value and behaves like it in
    every torch operation: each operation runs on :attr:`concrete`. The
    value is either given (:meth:`wrap`) or *deferred* (:meth:`defer`):
    drawn the first time an operation other than a shape query needs it,
    which under local reparameterization and a closed-form KL may be never.

    The handler sees, through :meth:`__torch_function__`, every operation
    with a stand-in among its arguments.

    :ivar site_dist: The distribution that drew the value (of the drawn shape), or
        None if unknown.
    :ivar list msgs: The sample-site messages holding this value, the one
        that drew it first.
    :ivar tuple view_ops: For a view of the drawn value (transposed,
        reshaped, sliced or cast, each element a distinct drawn element), the
        ops that made it from the drawn value, to apply to the distribution's
        parameters too; empty for the drawn value itself.
    :ivar str derived: The name of the first op, if any, after which the
        value is no longer such a view (it repeats or detaches elements, e.g.
        ``expand``); then the handlers use the value as it is.
    :ivar Uses uses: The elements of the draw used so far by layer calls and
        matrix products, shared by every stand-in of the draw.
    """

    site_dist: Optional[Distribution]
    msgs: List[SampleSite]
    view_ops: Tuple[ViewOp, ...]
    derived: Optional[str]
    uses: Uses
    _real: Optional[torch.Tensor]
    _thunk: Optional[Callable[[], torch.Tensor]]
    _grad_enabled: bool

    @classmethod
    def _new(
        cls,
        placeholder: torch.Tensor,
        dist: Optional[Distribution],
        msgs: List[SampleSite],
        view_ops: Tuple[ViewOp, ...] = (),
        derived: Optional[str] = None,
        uses: Optional[Uses] = None,
    ) -> "SiteValue":
        self = torch.Tensor._make_subclass(cls, placeholder, False)
        self.site_dist, self.msgs, self.view_ops, self.derived = dist, msgs, view_ops, derived
        self.uses = Uses(placeholder.shape) if uses is None else uses
        self._real, self._thunk = None, None
        return self

    @classmethod
    def wrap(
        cls,
        value: torch.Tensor,
        dist: Optional[Distribution],
        msgs: List[SampleSite],
        view_ops: Tuple[ViewOp, ...] = (),
        derived: Optional[str] = None,
        uses: Optional[Uses] = None,
    ) -> "SiteValue":
        """A stand-in for the existing tensor ``value`` (sharing its storage);
        ``view_ops``, ``derived`` and ``uses`` as those of the stand-in it
        derives from, if any."""
        self = cls._new(value.detach(), dist, msgs, view_ops, derived, uses)
        self._real = value
        return self

    @classmethod
    def defer(
        cls,
        thunk: Callable[[], torch.Tensor],
        shape: torch.Size,
        like: torch.Tensor,
        dist: Optional[Distribution] = None,
        msgs: Optional[List[SampleSite]] = None,
        dtype: Optional[torch.dtype] = None,
    ) -> "SiteValue":
        """A stand-in of ``shape`` (with the dtype and device of ``like``, or
        ``dtype``) whose value ``thunk()`` is computed on first use, in
        the grad mode of now."""
        placeholder = _placeholder(shape, dtype or like.dtype, like.device)
        self = cls._new(placeholder, dist, msgs or [])
        self._thunk = thunk
        self._grad_enabled = torch.is_grad_enabled()
        return self

    @property
    def is_deferred(self) -> bool:
        """Whether the value has not been computed yet."""
        return self._real is None

    @property
    @eager
    def concrete(self) -> torch.Tensor:
        """The value as a plain tensor, computed now if it was deferred (not
        ``real``: that is :attr:`torch.Tensor.real`, which torch itself reads)."""
        if self._real is None:
            assert self._thunk is not None  # defer() set it
            with torch.set_grad_enabled(self._grad_enabled):
                self._real = unwrap(self._thunk())
            self._thunk = None
        return self._real

    @property
    def site(self) -> Optional[str]:
        """The name of the site whose value this is (the model's, when seen)."""
        return self.msgs[-1]["name"] if self.msgs else None

    @property
    def is_view(self) -> bool:
        """Whether the distribution of this value is known: the drawn value or
        a view of it (:attr:`view_ops`)."""
        return self.derived is None

    def derive(
        self,
        func: Callable[..., Any],
        args: Tuple[Any, ...] = (),
        kwargs: Optional[Dict[str, Any]] = None,
    ) -> Any:
        """
        ``func(self, *args, **kwargs)`` as a stand-in for the same draw: a
        view (:attr:`view_ops`) if ``func`` keeps each element a distinct
        drawn element, else marked :attr:`derived`. A view of a deferred
        value stays deferred.
        """
        args, kwargs = unwrap(args), unwrap(kwargs or {})
        view_op = (func, args, kwargs)
        is_view = self.derived is None and is_view_op(func, self, args, kwargs)
        if is_view and self.is_deferred:
            meta = _meta_result(func, self, args, kwargs)
            if meta is not None and not repeats(func, self, meta):
                source = self
                return self._deferred_view(lambda: func(source.concrete, *args, **kwargs),
                                           meta, view_op)
        out = func(self.concrete, *args, **kwargs)
        if not isinstance(out, torch.Tensor):
            return out
        if repeats(func, self, out):
            is_view = False
        if is_view:
            return SiteValue.wrap(
                out, self.site_dist, list(self.msgs), self.view_ops + (view_op,), None, self.uses
            )
        name = getattr(func, "__name__", None) or str(func)
        return SiteValue.wrap(
            out, self.site_dist, list(self.msgs), self.view_ops, self.derived or name, self.uses
        )

    def pieces(
        self, func: Callable[..., Any], args: Tuple[Any, ...], kwargs: Dict[str, Any]
    ) -> Tuple["SiteValue", ...]:
        """
        The pieces of the split ``func(self, *args, **kwargs)`` (a key of
        :data:`~pyro_vinit.poutine._tensor_ops.PIECES`: ``w.chunk(3)``) as
        stand-ins for the same draw: views, or derived where ``self`` is. Split
        once; the pieces of a deferred value stay deferred.
        """
        args, kwargs = unwrap(args), unwrap(kwargs)
        meta = None
        if self.is_deferred and self.derived is None:
            meta = _meta_result(func, self, args, kwargs)
        if meta is None:
            pieces = func(self.concrete, *args, **kwargs)
            views = split_views(func, len(pieces), args, kwargs)
            return tuple(
                SiteValue.wrap(piece, self.site_dist, list(self.msgs),
                               self.view_ops + ((view,) if self.derived is None else ()),
                               self.derived, self.uses)
                for piece, view in zip(pieces, views))
        source, drawn = self, []  # type: SiteValue, List[Tuple[torch.Tensor, ...]]
        # (drawn: the split of the draw, made for the first piece drawn)

        def piece(i: int) -> torch.Tensor:
            if not drawn:
                drawn.append(func(source.concrete, *args, **kwargs))
            out: torch.Tensor = drawn[0][i]
            return out

        return tuple(self._deferred_view(functools.partial(piece, i), meta[i], view)
                     for i, view in enumerate(split_views(func, len(meta), args, kwargs)))

    def _deferred_view(self, thunk: Callable[[], torch.Tensor], meta: torch.Tensor,
                       view_op: ViewOp) -> "SiteValue":
        # the view view_op of this deferred draw, of meta's shape and dtype: a stand-in
        # whose value thunk() computes on first use
        out = SiteValue.defer(thunk, meta.shape, like=self, dtype=meta.dtype)
        out.site_dist, out.msgs, out.uses = self.site_dist, list(self.msgs), self.uses
        out.view_ops = self.view_ops + (view_op,)
        return out

    @classmethod
    @eager
    def __torch_function__(
        cls,
        func: Callable[..., Any],
        types: Any,
        args: Tuple[Any, ...] = (),
        kwargs: Optional[Dict[str, Any]] = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func in SHAPE_QUERIES:
            with torch._C.DisableTorchFunctionSubclass():
                if func in NEW_LIKE and args and isinstance(args[0], SiteValue):
                    # from a plain stand-in: a traced step (make_fx) cannot dispatch the
                    # subclass itself (e.g. AutoNormal's zero log-Jacobian of a weight)
                    like = args[0]
                    stand_in = torch.empty(like.shape, dtype=like.dtype, device=like.device)
                    args = (stand_in,) + tuple(args[1:])
                return func(*args, **kwargs)
        if func == _GRAD and args[0].is_deferred:
            return None  # e.g. torch.compile's hasattr(t, "grad")
        handler = ACTIVE[-1] if ACTIVE else None
        if handler is not None:
            out = handler._site_value_op(func, args, kwargs)
            if out is not NotImplemented:
                return out
        return func(*unwrap(args), **unwrap(kwargs))


def _meta_result(
    func: Callable[..., Any], value: SiteValue, args: Tuple[Any, ...], kwargs: Dict[str, Any]
) -> Any:
    # The shapes and dtypes of func's result (a tensor, or a split's tuple), without
    # drawing the value.
    try:
        out = func(torch.empty(value.shape, dtype=value.dtype, device="meta"), *args, **kwargs)
    except (RuntimeError, TypeError, ValueError, NotImplementedError):
        return None  # e.g. a move to another device: computed from the real value
    return out if isinstance(out, (torch.Tensor, tuple)) else None
