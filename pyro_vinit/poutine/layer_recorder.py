"""
Recording the Bayesian layers of a model run, and how their outputs flow
into the likelihood: the tracer behind the data-driven initializers.
"""

from dataclasses import dataclass, field
from types import TracebackType
from typing import (
    TYPE_CHECKING,
    Any,
    Callable,
    Collection,
    Dict,
    FrozenSet,
    Iterable,
    List,
    Mapping,
    Optional,
    Set,
    Tuple,
    Type,
    Union,
)

import torch
import torch.nn.functional as F
from pyro.poutine.messenger import Messenger
from pyro.poutine.util import site_is_subsample
from torch.overrides import TorchFunctionMode
from typing_extensions import Self

from pyro_vinit._pyro_compat import is_deterministic_site, subsampled_plate
from pyro_vinit._typing import SampleSite, sample_site
from pyro_vinit.poutine._layer_ops import LAYER_OPS, LayerCall, find_layer_call, op_name
from pyro_vinit.poutine._tensor_ops import (
    DATA_READS,
    DETACH,
    ELEMENT_OPS,
    SHAPE_QUERIES,
    TRANSPOSE,
    ViewOp,
    element_index,
    is_view_op,
    repeats,
)

if TYPE_CHECKING:
    from pyro.poutine.runtime import Message

__all__ = [
    "LayerRecorderMessenger",
    "PlateRowsMessenger",
    "RecordedLayer",
    "StopModel",
    "norm_statistics",
]

_T = torch.Tensor

# Functions that only read metadata or data: passed straight through.
_METADATA = SHAPE_QUERIES | DATA_READS
_ADDS: Set[Callable[..., Any]] = {_T.__add__, _T.__radd__, _T.add, torch.add}
_DROPOUTS: Set[Callable[..., Any]] = {
    F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout, F.feature_alpha_dropout
}


#: A data-flow token: ("layer", index), ("site", name) or ("param", name).
Token = Tuple[str, Union[int, str]]


class StopModel(Exception):
    """Raised by a hook of :class:`LayerRecorderMessenger` to stop the model
    run once it has what it needs; the messenger swallows it on exit."""


@dataclass
class _Derived:
    """A site value seen through ``view_ops`` (see
    :func:`~pyro_vinit.poutine._tensor_ops.is_view_op`), possibly detached;
    ``derived`` names the first op after which it is no longer such a view
    (it repeats elements or reinterprets their bits), if any."""

    name: str
    root_shape: torch.Size
    view_ops: Tuple[ViewOp, ...] = ()
    derived: Optional[str] = None

    @property
    def index(self) -> Optional[torch.Tensor]:
        """The flat index in the site value of each element, or None for the
        site value itself (possibly cast)."""
        return element_index(self.root_shape, self.view_ops)


@dataclass
class RecordedLayer:
    """
    A layer call whose weight is a latent sample site (in the op's layout,
    see :class:`~pyro_vinit.poutine._layer_ops.LayerCall`).

    :ivar LayerCall call: The call, with its input.
    :ivar str weight_name: The weight's sample site.
    :ivar weight_index: Flat index into the site value of each element of
        ``call.weight`` (flattened), or None when the layouts agree.
    :ivar bias_name: A latent bias site, or None.
    :ivar bias_index: As ``weight_index``, for the bias.
    :ivar fixed_bias: A bias that is not a latent site (a parameter), or None.
    """

    call: LayerCall
    weight_name: str
    weight_index: Optional[torch.Tensor] = None
    bias_name: Optional[str] = None
    bias_index: Optional[torch.Tensor] = None
    fixed_bias: Optional[torch.Tensor] = None
    output: Optional[torch.Tensor] = field(default=None, repr=False)

    @property
    def site_names(self) -> Tuple[str, ...]:
        return (self.weight_name,) + ((self.bias_name,) if self.bias_name else ())


def _is_unit_vector(derived: _Derived, value: torch.Tensor, units: int) -> bool:
    # Whether ``value`` is a vector site's value of ``units`` elements, itself or seen with
    # its elements in order along the last dim (b.unsqueeze(-2), b[None], b.reshape(1, -1)).
    if derived.derived is not None or derived.root_shape != torch.Size([units]):
        return False
    if value.numel() != units or value.dim() == 0 or value.shape[-1] != units:
        return False
    index = derived.index
    return index is None or torch.equal(index.reshape(-1), torch.arange(units))


def _is_permutation(derived: _Derived) -> bool:
    # Whether the site value, seen through its views, holds each of its elements exactly
    # once (also when the layer reads it transposed: a transpose permutes).
    if derived.derived is not None:
        return False
    shape = derived.root_shape
    index = element_index(shape, derived.view_ops)
    if index is None:
        return True
    flat = index.reshape(-1)
    return flat.numel() == shape.numel() and torch.equal(flat.sort().values,
                                                         torch.arange(flat.numel()))


class _Mode(TorchFunctionMode):
    def __init__(self, recorder: "LayerRecorderMessenger") -> None:
        super().__init__()
        self.recorder = recorder

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: Tuple[Any, ...] = (),
        kwargs: Optional[Dict[str, Any]] = None,
    ) -> Any:
        if func in _METADATA:
            return func(*args, **(kwargs or {}))
        return self.recorder._torch_function(func, args, kwargs or {})


class PlateRowsMessenger(Messenger):
    """
    Effect handler that chooses the indices of a model's subsampled
    :class:`~pyro.plate` s instead of a random draw, and records those plates
    in :attr:`subsampled_plates` (name -> ``(size, subsample_size)``): a plate
    whose subsample size is ``len(rows)`` (and whose size exceeds every row)
    takes ``rows``, so that a caller can walk through the data in blocks;
    else a plate over more rows than the ``num_rows`` that the model's
    arguments have (one declared with the size of the whole data set, run
    on a chunk of it), or one whose subsample is larger than its size (one
    declared with the rows at hand, run on a chunk smaller than its
    subsample), takes the first ``subsample_size`` of those rows, wrapped
    around; without rows or ``num_rows``, a subsampled plate takes its first
    ``subsample_size`` indices (the rows at hand of a plate scaled to the data
    set, ``pyro.plate("data", N, subsample_size=len(x))``, not a random draw).
    Other plates, and subsamples already set, are left alone.
    To reach a plate that a ``poutine.block`` around the model hides, it must
    be applied inside the block.

    Usage::

        plates = PlateRowsMessenger(num_rows=len(x))
        plates(model)(x, y)
        plates.subsampled_plates  # {} for a model without a subsampled plate

    :param torch.Tensor rows: Row indices for the plates, or None.
    :param int num_rows: The number of data rows in the model's arguments, or None.
    """

    def __init__(self, rows: Optional[torch.Tensor] = None,
                 num_rows: Optional[int] = None) -> None:
        super().__init__()
        self.rows = rows
        self.num_rows = num_rows
        self.subsampled_plates: Dict[str, Tuple[int, int]] = {}

    def _pyro_sample(self, msg: "Message[..., Any]") -> None:
        plate = subsampled_plate(msg)
        if msg["value"] is not None or plate is None:
            return
        self.subsampled_plates[sample_site(msg)["name"]] = (plate.size, plate.subsample_size)
        rows = self.rows
        if rows is not None and len(rows) == plate.subsample_size and len(rows) and (
            int(rows.max()) < plate.size
        ):
            msg["value"] = rows.to(plate.device)
        elif rows is None and self.num_rows is None and plate.subsample_size < plate.size:
            # (the rows at hand, scaled to the plate's size, pyro.plate("data", N,
            # subsample_size=len(x)): the first rows, not a draw of the generator)
            msg["value"] = torch.arange(plate.subsample_size, device=plate.device)
        else:
            # a plate over more rows than the arguments have (declared with the data set's
            # size), or one asking for more rows than it has (declared with the rows at
            # hand, run on a chunk smaller than its subsample): rows among those at hand
            num_rows = min(plate.size, self.num_rows or plate.size)
            if 0 < num_rows < max(plate.size, plate.subsample_size):
                msg["value"] = torch.arange(plate.subsample_size, device=plate.device) % num_rows


class LayerRecorderMessenger(Messenger):
    r"""
    Effect handler that records the model's Bayesian layers: every
    ``F.linear`` / ``F.conv1d/2d/3d`` call, and every linear layer written
    as a matrix product (``x @ w``, ``torch.matmul``, ``torch.mm``,
    ``torch.addmm``, a two-operand ``torch.einsum`` with one contracted
    index), whose weight is the value of one of the ``latent`` sample sites
    (also reshaped, transposed or cast before the call), with its bias: a
    latent site, a plain tensor, or, after a matrix product, a latent vector,
    a plain tensor of one value per unit or a number added to its output.

    Usage::

        latent = ["net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias"]
        with LayerRecorderMessenger(latent) as rec:
            pyro.poutine.condition(model, data=guide.median())(x, y)
        [layer.weight_name for layer in rec.layers]  # ["net.0.weight", "net.2.weight"]

    It is meant for one-off passes over a model whose latent sites are set
    (e.g. by :func:`pyro.poutine.condition`), such as an initializer's: it
    intercepts calls with a :class:`torch.overrides.TorchFunctionMode`, so
    every torch function in its context pays a Python call. While active,

    * dropout is off (``F.dropout*`` return their input), so that a pass is
      deterministic;
    * ``F.batch_norm`` normalizes with the statistics of the batch at hand
      and leaves the running statistics alone (see
      :func:`norm_statistics` to collect them), but for a layer called with
      ``training=False`` under ``keep_frozen_norms`` (frozen), which
      normalizes with its running statistics, not collected;
    * with ``track_flow=True`` it follows, through every torch operation,
      which layers' outputs (not through another layer), latent sites and
      params each tensor depends on, and :attr:`likelihood_flow` tells, for
      each parameter of the observed site's distribution, where it comes
      from.

    Subclasses (or callers, through :attr:`on_layer`) can return a layer's
    output or raise :class:`StopModel` to stop the run.

    :param latent: Names of the latent sample sites whose values are weights.
    :param bool track_flow: Follow the data flow (costs a set union per op).
    :param dict norm_statistics: If given, the input statistics of every
        ``F.batch_norm`` call are accumulated in it, across runs (see
        :func:`norm_statistics`).
    :param callable norm_sync: If given, ``F.batch_norm`` normalizes with the
        ``(mean, biased variance)`` that ``norm_sync(input, dims)`` returns
        (e.g. statistics over the shards of several processes) instead of
        the batch's own.
    :param tuple norm_rows: ``(rows, new)``: of an ``F.batch_norm`` input with
        ``rows`` rows along its first dim, only the first ``new`` count in
        ``norm_statistics`` (the others repeat rows counted before, as the
        wrapped-around last block of a subsampled plate does).
    :param bool keep_frozen_norms: Whether an ``F.batch_norm`` called with
        ``training=False`` (a BatchNorm layer in eval mode in a model in
        train mode) keeps its running statistics.
    :param dict sources: With ``track_flow``, tensors followed as the values
        of the latent sites of these names, for sites whose values this
        handler does not see (hidden by a ``poutine.block`` inside it).
    """

    def __init__(
        self,
        latent: Collection[str],
        *,
        track_flow: bool = False,
        norm_statistics: Optional[Dict[int, List[Any]]] = None,
        on_layer: Optional[Callable[[RecordedLayer], Optional[torch.Tensor]]] = None,
        norm_sync: Optional[Callable[[torch.Tensor, List[int]], Tuple[torch.Tensor, ...]]] = None,
        norm_rows: Optional[Tuple[int, int]] = None,
        sources: Optional[Mapping[str, torch.Tensor]] = None,
        keep_frozen_norms: bool = False,
    ) -> None:
        super().__init__()
        self.norm_rows = norm_rows
        self.keep_frozen_norms = keep_frozen_norms
        self.latent = set(latent)
        self.track_flow = track_flow
        self.num_batch_norms = 0
        self.on_layer = on_layer
        self.layers: List[RecordedLayer] = []
        #: distribution parameter name -> tokens ("layer", i) / ("site", name) / ("param", name)
        self.likelihood_flow: Dict[str, FrozenSet[Token]] = {}
        self.observed: List[SampleSite] = []
        self._sites: Dict[int, Tuple[torch.Tensor, _Derived]] = {}
        self._flow: Dict[int, Tuple[torch.Tensor, FrozenSet[Token]]] = {}
        self._open_matmuls: Dict[int, Tuple[torch.Tensor, RecordedLayer]] = {}
        self._norm_stats = norm_statistics
        self.norm_sync = norm_sync
        self._mode: Optional[_Mode] = None
        if track_flow:
            for name, value in (sources or {}).items():
                self._set_flow(value, frozenset({("site", name)}))

    # ------------------------------------------------------------ context

    def __enter__(self) -> Self:
        result = super().__enter__()
        self._mode = _Mode(self)
        self._mode.__enter__()  # type: ignore[no-untyped-call]  # torch's is unannotated
        return result

    def __exit__(  # type: ignore[override]  # True swallows StopModel, as documented
        self,
        exc_type: Optional[Type[BaseException]],
        exc_value: Optional[BaseException],
        traceback: Optional[TracebackType],
    ) -> bool:
        try:
            if self._mode is not None:
                # torch's TorchFunctionMode.__exit__ is unannotated.
                self._mode.__exit__(exc_type, exc_value, traceback)  # type: ignore[no-untyped-call]
        finally:
            self._mode = None
            super().__exit__(exc_type, exc_value, traceback)
        return exc_type is not None and issubclass(exc_type, StopModel)

    # ------------------------------------------------------------ pyro messages

    def _pyro_post_sample(self, msg: "Message[..., Any]") -> None:
        site = sample_site(msg)
        value = site["value"]
        if not isinstance(value, torch.Tensor) or site_is_subsample(msg):
            return
        if is_deterministic_site(site):
            return
        name = site["name"]
        if site["is_observed"] and name not in self.latent:
            self.observed.append(site)
            if self.track_flow:
                self._record_likelihood_flow(site)
            return
        if name in self.latent:
            self._sites[id(value)] = (value, _Derived(name, value.shape))
            if self.track_flow:
                self._set_flow(value, frozenset({("site", name)}))

    def _pyro_post_param(self, msg: "Message[..., Any]") -> None:
        name = msg["name"]
        if self.track_flow and isinstance(msg["value"], torch.Tensor) and name is not None:
            self._set_flow(msg["value"], frozenset({("param", name)}))

    def _record_likelihood_flow(self, msg: SampleSite) -> None:
        fn: object = msg["fn"]
        while hasattr(fn, "base_dist"):
            fn = fn.base_dist
        fn = getattr(fn, "_categorical", fn)  # OneHotCategorical
        try:
            names = list(getattr(fn, "arg_constraints", {}))
        except NotImplementedError:  # a torch Distribution that declares none
            return
        for name in names:
            value = fn.__dict__.get(name)  # only parameters given (lazy ones are derived)
            if isinstance(value, torch.Tensor):
                self.likelihood_flow[name] = self._get_flow(value)

    # ------------------------------------------------------------ flow

    def _set_flow(self, tensor: torch.Tensor, tokens: FrozenSet[Token]) -> None:
        self._flow[id(tensor)] = (tensor, tokens)

    def _get_flow(self, tensor: object) -> FrozenSet[Token]:
        entry = self._flow.get(id(tensor))
        return entry[1] if entry is not None and entry[0] is tensor else frozenset()

    def _union_flow(self, items: Iterable[Any]) -> FrozenSet[Token]:
        tokens: FrozenSet[Token] = frozenset()
        for item in items:
            if isinstance(item, torch.Tensor):
                tokens = tokens | self._get_flow(item)
            elif isinstance(item, (tuple, list)):
                tokens = tokens | self._union_flow(item)
        return tokens

    def _tag_outputs(self, out: object, tokens: FrozenSet[Token]) -> None:
        if not tokens:
            return
        if isinstance(out, torch.Tensor):  # (an in-place op's output is among its arguments)
            self._set_flow(out, tokens)
        elif isinstance(out, (tuple, list)):
            for item in out:
                self._tag_outputs(item, tokens)

    # ------------------------------------------------------------ torch functions

    def _site_of(self, tensor: object) -> Optional[_Derived]:
        entry = self._sites.get(id(tensor))
        return entry[1] if entry is not None and entry[0] is tensor else None

    def _torch_function(
        self, func: Callable[..., Any], args: Tuple[Any, ...], kwargs: Dict[str, Any]
    ) -> Any:
        if func in _DROPOUTS:  # (they hand their input over by position, as F.batch_norm)
            return args[0]
        out: Any  # whatever the torch function returns
        if func is F.batch_norm:
            out = self._batch_norm(args, kwargs)
        else:
            out = self._layer(func, args, kwargs)
            if out is None:
                out = func(*args, **kwargs)
                self._after(func, args, kwargs, out)
                return out
        if self.track_flow and func is F.batch_norm:
            self._tag_outputs(out, self._union_flow(args) | self._union_flow(kwargs.values()))
        return out

    def _after(
        self, func: Callable[..., Any], args: Tuple[Any, ...], kwargs: Dict[str, Any], out: Any
    ) -> None:
        source = args[0] if args else None
        derived = self._site_of(source)
        if (derived is not None and isinstance(source, torch.Tensor)
                and isinstance(out, torch.Tensor) and func in ELEMENT_OPS):
            # The views of the handlers' site values, and detached ones (which elements of
            # the site a layer uses is all the recorder needs); other element ops are marked,
            # for the layer call to refuse.
            if func is not DETACH:
                name, shape, view_ops = derived.name, derived.root_shape, derived.view_ops
                if (derived.derived is None and is_view_op(func, source, args[1:], kwargs)
                        and not repeats(func, source, out)):
                    derived = _Derived(name, shape, view_ops + ((func, args[1:], kwargs),))
                else:
                    derived = _Derived(name, shape, view_ops, derived.derived or op_name(func))
            self._sites[id(out)] = (out, derived)
        if (func in _ADDS and len(args) == 2 and kwargs.get("alpha", 1) == 1
                and self._open_matmuls and self._matmul_bias(args, out)):
            return  # the sum is the layer's output: its flow is the layer's
        if not self.track_flow:
            return
        if func is torch.broadcast_tensors:
            # element-wise: Normal(loc, scale) broadcasts its parameters together
            for item, result in zip(args, out):
                self._tag_outputs(result, self._union_flow([item]))
        else:
            self._tag_outputs(out, self._union_flow(args) | self._union_flow(kwargs.values()))

    def _layer(
        self, func: Callable[..., Any], args: Tuple[Any, ...], kwargs: Dict[str, Any]
    ) -> Optional[torch.Tensor]:
        if func in LAYER_OPS:
            weight = args[1] if len(args) > 1 else kwargs.get("weight")
            if self._site_of(weight) is None:
                return None  # the common case, answered before parsing
        found: List[_Derived] = []  # the weight's, as find_layer_call picks it

        def is_site(tensor: torch.Tensor) -> bool:
            derived = self._site_of(tensor)
            if derived is not None:
                found.append(derived)
            return derived is not None

        call = find_layer_call(func, args, kwargs, is_site)
        if call is None:
            return None
        derived = found[-1]
        bias = call.bias
        index = self._layer_index(derived, call.transposed)
        layer = RecordedLayer(call, derived.name, index)
        if bias is not None:
            bias_derived = self._site_of(bias)
            if bias_derived is not None and bias.dim() == 1 and _is_permutation(bias_derived):
                layer.bias_name = bias_derived.name
                layer.bias_index = bias_derived.index
            else:
                layer.fixed_bias = bias.detach()
        self.layers.append(layer)
        out = self.on_layer(layer) if self.on_layer is not None else None
        if out is None:
            out = call()
        layer.output = out
        if func not in LAYER_OPS and bias is None:
            self._open_matmuls[id(out)] = (out, layer)
        if self.track_flow:
            self._set_flow(out, frozenset({("layer", len(self.layers) - 1)}))
        return out

    def _layer_index(self, derived: _Derived, transposed: bool) -> Optional[torch.Tensor]:
        if not _is_permutation(derived):
            ops = [op_name(op[0]) for op in derived.view_ops]
            ops += [derived.derived] if derived.derived is not None else []
            raise ValueError(
                f"the weight of sample site {derived.name!r} reaches a layer call through "
                f"an operation that repeats or drops elements ({', '.join(ops)}); pass it to "
                "the layer whole (reshaped or transposed at most)"
            )
        index = element_index(derived.root_shape,
                              derived.view_ops + ((TRANSPOSE,) if transposed else ()))
        if index is not None and torch.equal(index.reshape(-1), torch.arange(index.numel())):
            index = None
        return index

    def _matmul_bias(self, args: Tuple[Any, ...], out: Any) -> bool:
        # x @ w + b: a latent vector b (or b.unsqueeze(-2), as a program vectorized over
        # sample dims writes it) added to an open matrix product is its bias; so is a
        # constant one (a number, or a tensor of one value per unit that is no site's).
        for a, b in (args, args[::-1]):
            entry = self._open_matmuls.get(id(a))
            if entry is None or entry[0] is not a:
                continue
            layer = entry[1]
            units = layer.call.weight.shape[0]
            if isinstance(b, (int, float)) and not isinstance(b, bool):
                b = torch.tensor(b, dtype=out.dtype, device=out.device)
            if not isinstance(b, torch.Tensor):
                continue
            derived = self._site_of(b)
            if derived is None:  # a constant: one value, or one per unit (not a row's)
                if b.dim() > 2 or not (b.numel() == 1 or b.shape[-1] == b.numel() == units):
                    continue
                layer.fixed_bias = b.detach()
            elif _is_unit_vector(derived, b, units) and out.shape == a.shape:
                layer.bias_name = derived.name
                b = b.reshape(units)
            else:
                continue
            layer.call.bias = b
            del self._open_matmuls[id(a)]
            layer.output = out
            if self.track_flow:  # (a constant's flow, e.g. a param's, stays in it)
                constant = self._get_flow(b) if derived is None else frozenset()
                self._set_flow(out, self._get_flow(a) | constant)
            return True
        return False

    def _batch_norm(self, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> torch.Tensor:
        # (F.batch_norm hands its tensors over by position, its options by keyword)
        x, running_mean, running_var = args
        weight, bias, eps = kwargs["weight"], kwargs["bias"], kwargs["eps"]
        self.num_batch_norms += 1
        if self.keep_frozen_norms and not kwargs["training"] and running_mean is not None:
            return F.batch_norm(x, running_mean, running_var, weight, bias, False, 0.0, eps)
        if self._norm_stats is not None and running_mean is not None:
            dims = [0] + list(range(2, x.dim()))
            stats = self._norm_stats.setdefault(
                id(running_mean), [running_mean, running_var, 0, 0.0, 0.0]
            )
            counted = x
            if self.norm_rows is not None and x.shape[0] == self.norm_rows[0]:
                counted = x[: self.norm_rows[1]]
            stats[2] += counted.numel() // x.shape[1]
            stats[3] = stats[3] + counted.sum(dims)
            stats[4] = stats[4] + (counted * counted).sum(dims)
        if self.norm_sync is not None:
            mean, var = self.norm_sync(x, [0] + list(range(2, x.dim())))
            return F.batch_norm(x, mean, var, weight, bias, False, 0.0, eps)
        return F.batch_norm(x, None, None, weight, bias, True, 0.0, eps)


def norm_statistics(accumulated: Dict[int, List[Any]]) -> List[Tuple[torch.Tensor, ...]]:
    """``(running_mean, running_var, mean, var)`` for each ``F.batch_norm`` call
    whose statistics a :class:`LayerRecorderMessenger` accumulated: the
    module's buffers and the mean and unbiased variance of their inputs."""
    found: List[Tuple[torch.Tensor, ...]] = []
    for running_mean, running_var, n, total, squares in accumulated.values():
        mean = total / n
        var = (squares / n - mean * mean).clamp_min(0) * (n / max(n - 1, 1))
        found.append((running_mean, running_var, mean, var))
    return found
