"""
What torch operations do to the elements of a tensor, as the layer-call
interception needs to know it: which ops only read metadata, which ones
make a *view* (each element of the result one distinct element of the
argument, possibly cast), and which elements of a drawn value a chain of
views holds.

The one table of this knowledge, shared by both front ends of the
interception: the per-step handlers' tensor subclass
(:mod:`~pyro_vinit.poutine._site_value`) and the initializers' tracer
(:mod:`~pyro_vinit.poutine.layer_recorder`). A leaf module: it imports
nothing from :mod:`pyro_vinit.poutine`.
"""

import functools
from typing import Any, Callable, Dict, FrozenSet, Iterator, List, Optional, Tuple

import torch

__all__: List[str] = []

_T = torch.Tensor

#: A view op: ``(func, args, kwargs)``, applied as ``func(tensor, *args, **kwargs)``.
ViewOp = Tuple[Callable[..., Any], Tuple[Any, ...], Dict[str, Any]]


def getter(name: str) -> Callable[..., Any]:
    """The function that torch passes to ``__torch_function__`` when the
    attribute ``name`` of a tensor is read (its descriptor's ``__get__``)."""
    # getattr: the class attribute is the descriptor, which mypy types as the value.
    getter: Callable[..., Any] = getattr(_T, name).__get__
    return getter


#: The functions that return a new tensor like their first argument (e.g. the zero
#: log-Jacobian of an identity transform).
NEW_LIKE: FrozenSet[Callable[..., Any]] = frozenset({
    torch.zeros_like, torch.ones_like, torch.empty_like, torch.full_like,
})

#: Functions answered from a tensor's shape, dtype and device alone (a stand-in
#: answers them without computing its value).
SHAPE_QUERIES: FrozenSet[Callable[..., Any]] = NEW_LIKE | frozenset({
    getter("shape"), getter("dtype"), getter("device"), getter("ndim"), getter("layout"),
    getter("is_cuda"),
    getter("is_nested"),  # read by torch.compile on every tensor it meets
    getter("is_sparse"), getter("is_quantized"), getter("is_meta"),
    _T.dim, _T.size, _T.numel, _T.nelement, _T.ndimension, _T.__len__, _T.is_floating_point,
    _T.is_complex, _T.element_size, _T.get_device,
})

#: Reads of a tensor's elements that compute nothing (a Python number or list of them).
VALUE_READS: FrozenSet[Callable[..., Any]] = frozenset({_T.__bool__, _T.item, _T.tolist})
#: Functions that read a tensor's data or autograd state and return no tensor (so no
#: data flows through them): its metadata, or its elements (VALUE_READS).
DATA_READS: FrozenSet[Callable[..., Any]] = VALUE_READS | frozenset({
    getter("requires_grad"), getter("is_leaf"), getter("grad_fn"), getter("_version"),
    _T.data_ptr, _T.__hash__, _T.stride, _T.storage_offset, _T.is_contiguous,
})
_ARITHMETIC = ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and",
               "or", "xor", "lshift", "rshift")
#: The dunder methods that compute with a tensor's elements (operators, conversions).
_VALUE_DUNDERS = frozenset(
    [f"__{p}{name}__" for name in _ARITHMETIC for p in ("", "r", "i")]
    + [f"__{name}__" for name in ("eq", "ne", "lt", "le", "gt", "ge", "neg", "pos", "abs",
                                  "invert", "bool", "float", "int", "index", "complex")]
)


def uses_values(func: Callable[..., Any], out: Any) -> bool:
    """Whether ``func`` (as ``__torch_function__`` receives it), which returned
    ``out``, computed with its tensors' elements: a tensor computed, or an element
    read (``.item()``, ``bool(t)``); not a read of an attribute (``.shape``,
    ``._base``: a descriptor's ``__get__``), a private method of torch's own
    machinery (``_is_view``), another dunder method (``__hash__``, ``__repr__``) or
    a query of metadata (``is_conj()``, ``untyped_storage()``, which torch.compile
    asks of every tensor)."""
    name: str = getattr(func, "__name__", "")
    if name.startswith("__"):
        return name in _VALUE_DUNDERS
    if name.startswith("_") or func in DATA_READS - VALUE_READS:
        return False
    return func in VALUE_READS or isinstance(out, torch.Tensor) or (
        isinstance(out, (tuple, list)) and any(isinstance(o, torch.Tensor) for o in out))


def piece(split: Callable[..., Any], tensor: torch.Tensor, index: int, *args: Any,
          **kwargs: Any) -> Any:
    """The ``index``-th tensor of the split ``split(tensor, *args, **kwargs)``."""
    return split(tensor, *args, **kwargs)[index]


#: The ops that split a tensor into a tuple of views (``w.chunk(3)`` of a fused
#: weight), each mapped to its piece's view op: ``PIECES[split](tensor, i, *args,
#: **kwargs)`` is the ``i``-th tensor of the split.
PIECES: Dict[Callable[..., Any], Callable[..., Any]] = {
    split: functools.partial(piece, split) for split in (
        _T.chunk, _T.split, _T.tensor_split, _T.unbind, _T.split_with_sizes, _T.unsafe_chunk,
        _T.unsafe_split, torch.chunk, torch.split, torch.tensor_split, torch.unbind,
        torch.split_with_sizes, torch.unsafe_chunk, torch.unsafe_split)
}


def split_views(func: Callable[..., Any], count: int, args: Tuple[Any, ...],
                kwargs: Dict[str, Any]) -> List[ViewOp]:
    """The view op of each of the ``count`` pieces of the split
    ``func(tensor, *args, **kwargs)`` (a key of :data:`PIECES`)."""
    return [(PIECES[func], (i,) + tuple(args), kwargs) for i in range(count)]


# Ops after which each element of the result is one distinct element of the argument:
# a Normal's parameters go through them as the value does.
_RELAYOUTS = frozenset(PIECES.values()) | frozenset({
    _T.reshape, _T.view, _T.view_as, _T.reshape_as, _T.t, _T.transpose, _T.permute,
    _T.flatten, _T.unflatten, _T.squeeze, _T.unsqueeze, _T.contiguous, _T.clone,
    _T.narrow, _T.movedim, _T.swapaxes, getter("T"), getter("mT"), torch.reshape,
    torch.transpose, torch.t, torch.permute, torch.flatten, torch.squeeze, torch.unsqueeze,
    torch.clone, torch.narrow, torch.movedim, torch.swapaxes,
})
#: Casts: the same elements in another dtype (or on another device).
CASTS = frozenset({_T.to, _T.float, _T.double, _T.half, _T.bfloat16, _T.type})
#: Views only when they repeat no element (e.g. ``Delta.rsample``'s expand to the same
#: shape): see :func:`repeats`.
EXPANDS = frozenset({_T.expand, _T.expand_as})
#: The same elements, detached: a view of the values, not of their distribution (a
#: pathwise gradient would appear).
DETACH = _T.detach
#: Every op after which a tensor may still hold elements of its argument, as a view or not.
ELEMENT_OPS = _RELAYOUTS | CASTS | EXPANDS | {_T.__getitem__, DETACH}

_TRANSPOSES = frozenset({_T.t, torch.t, getter("T"), getter("mT")})
#: The view op that transposes a matrix (a weight ``(in, out)`` of ``x @ w`` into
#: ``F.linear``'s ``(out, in)``).
TRANSPOSE: ViewOp = (getter("mT"), (), {})


def _is_int_or_none(bound: object) -> bool:
    return bound is None or (isinstance(bound, int) and not isinstance(bound, bool))


def _is_basic_index(index: object) -> bool:
    if isinstance(index, tuple):
        return all(_is_basic_index(i) for i in index)
    if isinstance(index, slice):
        # Tensor bounds may be computed from the draw itself: which elements are used then
        # depends on other elements, so the view's distribution is not its elements' own.
        return all(_is_int_or_none(b) for b in (index.start, index.stop, index.step))
    return index is Ellipsis or _is_int_or_none(index)


def _view_dtype(func: Callable[..., Any], args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    # The dtype of Tensor.view(dtype), or None for Tensor.view(shape) and other ops.
    if func is not _T.view:
        return None
    dtype = args[0] if args else kwargs.get("dtype")
    return dtype if isinstance(dtype, torch.dtype) else None


def is_view_op(
    func: Callable[..., Any], source: torch.Tensor, args: Tuple[Any, ...], kwargs: Dict[str, Any]
) -> bool:
    """Whether ``func(source, *args, **kwargs)`` is a view of ``source``: each
    of its elements one distinct element of ``source``, possibly cast (for an
    expand, only if :func:`repeats` is false of the result)."""
    if func in _RELAYOUTS:
        # Tensor.view(dtype) reinterprets the bits, unless the dtype is the tensor's own
        dtype = _view_dtype(func, args, kwargs)
        return dtype is None or dtype == source.dtype
    if func is _T.__getitem__:
        return bool(args) and _is_basic_index(args[0])
    return func in CASTS or func in EXPANDS


def repeats(func: Callable[..., Any], source: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether the view op ``func`` repeated elements of ``source`` in ``out``."""
    return func in EXPANDS and out.numel() != source.numel()


def replay(view_ops: Tuple[ViewOp, ...], tensor: torch.Tensor) -> torch.Tensor:
    """Applies ``view_ops`` to ``tensor`` (of the drawn value's shape)."""
    for func, args, kwargs in view_ops:
        tensor = func(tensor, *args, **kwargs)
    return tensor


def element_index(shape: torch.Size, view_ops: Tuple[ViewOp, ...]) -> Optional[torch.Tensor]:
    """For a view of a value of ``shape`` made by ``view_ops``: the flat
    index in the value of each of its elements (a CPU tensor of the view's
    shape), or None if ``view_ops`` only cast (the value itself)."""
    ops = tuple(op for op in view_ops if op[0] not in CASTS and _view_dtype(*op) is None)
    if not ops:
        return None
    # (on the device of an index tensor among the ops', w[..., idx] on CUDA; read on the CPU)
    device = next((t.device for t in _tensors_in([op[1:] for op in ops])), None)
    return replay(ops, torch.arange(shape.numel(), device=device).reshape(shape)).cpu()


def _tensors_in(items: Any) -> Iterator[torch.Tensor]:
    if isinstance(items, torch.Tensor):
        yield items
    elif isinstance(items, (tuple, list)):
        for item in items:
            yield from _tensors_in(item)
    elif isinstance(items, dict):
        yield from _tensors_in(list(items.values()))


def is_transpose(view_ops: Tuple[ViewOp, ...], shape: torch.Size) -> bool:
    """Whether ``view_ops`` transpose a matrix of ``shape`` (and do nothing else)."""
    if len(view_ops) != 1 or len(shape) != 2:
        return False
    func, args, kwargs = view_ops[0]
    if func in _TRANSPOSES:
        return True
    if func in (_T.transpose, torch.transpose, _T.swapaxes, torch.swapaxes) and not kwargs:
        return len(args) == 2 and {a % 2 for a in args} == {0, 1}
    if func in (_T.permute, torch.permute) and not kwargs:
        dims = args[0] if len(args) == 1 and isinstance(args[0], (tuple, list)) else args
        return [d % 2 for d in dims] == [1, 0]
    return False
