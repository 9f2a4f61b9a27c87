"""
The dim arguments of torch functions that a model counts from the left
(``F.log_softmax(x, dim=1)``, ``x.mean((2, 3))``, ``torch.cat(xs, dim=1)``,
``x.transpose(1, 2)``): on a tensor that leads with the sample dims of
vectorized samples or particles, such a dim lands on another dim than the
model's. :func:`left_dims` reads them off a call, for
:class:`~pyro_vinit.poutine._batched_modules.BatchedModules` to refuse.
"""

import functools
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

__all__: List[str] = []


class DimArgument(NamedTuple):
    """Where a function takes a dim: position, keyword, the default used when
    it is not given (None: then no dim), whether it inserts a dim (its range
    then takes the result's extra dim), and whether a dim of None is torch's
    implicit one (a softmax's: 0 for 0, 1 and 3 dims, else 1)."""

    position: int
    name: str
    default: Optional[int] = None
    inserts: bool = False
    implicit: bool = False


_Spec = Tuple[DimArgument, ...]


def _both(*names: str) -> List[Callable[..., Any]]:
    # torch.<name> and Tensor.<name>, where they exist
    return [f for n in names for f in (getattr(torch, n, None), getattr(torch.Tensor, n, None))
            if callable(f)]


@functools.cache  # (built on first use)
def _table() -> Dict[Callable[..., Any], _Spec]:
    table: Dict[Callable[..., Any], _Spec] = {}
    dim1: _Spec = (DimArgument(1, "dim"),)
    for f in _both("sum", "nansum", "mean", "nanmean", "prod", "logsumexp", "amax", "amin",
                   "max", "min", "argmax", "argmin", "std", "var", "std_mean", "var_mean",
                   "median", "nanmedian", "mode", "any", "all", "count_nonzero", "cumsum",
                   "cumprod", "cummax", "cummin", "logcumsumexp", "softmax", "log_softmax",
                   "sort", "argsort", "narrow", "select", "index_select", "gather", "squeeze",
                   "unflatten"):
        table[f] = dim1
    implicit: _Spec = (DimArgument(1, "dim", implicit=True),)
    for f in _both("unbind"):
        table[f] = (DimArgument(1, "dim", 0),)
    for f in _both("unsqueeze"):
        table[f] = (DimArgument(1, "dim", inserts=True),)
    for f in _both("cat", "concat", "concatenate"):
        table[f] = (DimArgument(1, "dim", 0),)
    table[torch.stack] = (DimArgument(1, "dim", 0, inserts=True),)
    for f in _both("chunk", "split", "tensor_split", "split_with_sizes", "unsafe_chunk",
                   "unsafe_split"):
        table[f] = (DimArgument(2, "dim", 0),)
    for f in _both("topk", "kthvalue", "quantile", "nanquantile", "norm", "diff"):
        table[f] = (DimArgument(2, "dim"),)
    for f in _both("repeat_interleave"):
        table[f] = (DimArgument(2, "dim"),)
    for f in _both("transpose", "swapaxes", "swapdims"):
        table[f] = (DimArgument(1, "dim0"), DimArgument(2, "dim1"))
    for f in _both("movedim", "moveaxis"):
        table[f] = (DimArgument(1, "source"), DimArgument(2, "destination"))
    for f in _both("flip"):
        table[f] = (DimArgument(1, "dims"),)
    for f in _both("roll"):
        table[f] = (DimArgument(2, "dims"),)
    table.update({
        torch.linalg.vector_norm: (DimArgument(2, "dim"),),
        torch.special.softmax: dim1, torch.special.log_softmax: dim1,
        F.softmax: implicit, F.log_softmax: implicit, F.softmin: implicit, F.glu: dim1,
        F.gumbel_softmax: (DimArgument(4, "dim"),),
        F.normalize: (DimArgument(2, "dim", 1),),
        F.cosine_similarity: (DimArgument(2, "dim", 1),),
    })
    return table


def inputs_of(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> List[Any]:
    """The input of a call, as the table reads its dims: the first argument or the
    keyword torch names it by; each tensor of a list (torch.cat's tensors)."""
    x = args[0] if args else next(
        (kwargs[k] for k in ("input", "tensors", "tensor", "logits", "x1") if k in kwargs), None)
    return list(x) if isinstance(x, (tuple, list)) else [x]


def _input(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    # (of a list, the first: the tensors of a concatenation have as many dims)
    inputs = inputs_of(args, kwargs)
    return inputs[0] if inputs else None


def _dims(value: Any) -> Optional[Sequence[int]]:
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,)
    if isinstance(value, (tuple, list)) and value and all(
            isinstance(v, int) and not isinstance(v, bool) for v in value):
        return tuple(value)
    return None


def _read(arg: DimArgument, args: Tuple[Any, ...], kwargs: Dict[str, Any],
          rank: int) -> Tuple[Any, Optional[Sequence[int]]]:
    # the argument as given, and its dims (a softmax's implicit one for a tensor of
    # ``rank`` dims), None where it names none
    given = args[arg.position] if len(args) > arg.position else kwargs.get(arg.name,
                                                                           arg.default)
    if given is None and arg.implicit:
        return given, (0 if rank in (0, 1, 3) else 1,)
    return given, _dims(given)


def takes_dims(func: Callable[..., Any]) -> bool:
    """Whether ``func`` takes a dim argument of the table."""
    return func in _table()


class LeftDims(NamedTuple):
    """A call's dims counted from the left within the model's own dims."""

    input: torch.Tensor
    name: str  #: the argument's name
    given: Any  #: its value
    own: Optional[Any]  #: the same dims counted from the right, where known


def left_dims(func: Callable[..., Any], args: Tuple[Any, ...], kwargs: Dict[str, Any],
              lead_of: Callable[[torch.Tensor], Optional[int]]) -> Optional[LeftDims]:
    """The first dim argument of ``func(*args, **kwargs)`` that counts from
    the left within the dims its input has past its ``lead_of(input)``
    leading dims, or None (also where ``func`` takes no dim, or ``lead_of``
    gives None)."""
    spec = _table().get(func)
    x = _input(args, kwargs) if spec is not None else None
    if spec is None or not isinstance(x, torch.Tensor):
        return None
    lead = lead_of(x)
    if lead is None:
        return None
    for arg in spec:
        rank = x.dim() - lead + arg.inserts  # (the model's own dims of the result)
        given, dims = _read(arg, args, kwargs, rank)
        if dims is None:
            continue
        if any(0 <= d < rank for d in dims):
            own = tuple(d - rank if 0 <= d < rank else d for d in dims)
            return LeftDims(x, arg.name, given, own if isinstance(given, (tuple, list))
                            else own[0])
    return None


def first_dim(func: Callable[..., Any], args: Tuple[Any, ...],
              kwargs: Dict[str, Any]) -> Optional[LeftDims]:
    """The dim argument of ``func(*args, **kwargs)`` that takes its input's first dim
    (a reduction, concatenation or split over it; not a dim inserted there, nor an
    unflatten, which splits it), or None."""
    spec = _table().get(func) if func not in (torch.unflatten, torch.Tensor.unflatten) else None
    x = _input(args, kwargs) if spec is not None else None
    if spec is None or not isinstance(x, torch.Tensor) or x.dim() == 0:
        return None
    for arg in spec:
        given, dims = _read(arg, args, kwargs, x.dim())
        if dims is not None and not arg.inserts and any(d % x.dim() == 0 for d in dims):
            return LeftDims(x, arg.name, given, None)
    return None
