"""
Seeing the layer calls of a model together with the sample sites their
weights came from.

:class:`LayerCallMessenger` is the base of the weight-noise handlers (local
reparameterization, Flipout). While it is active, every floating-point
sample-site value is handed to the program as a
:class:`~pyro_vinit.poutine._site_value.SiteValue`, a tensor subclass whose
``__torch_function__`` reports the operations it takes part in: only
operations on site values pay for the interception, ``torch.nn.functional``
is never modified, and nothing outside the context can observe the handler.
The handler sees

* every ``F.linear`` / ``F.conv1d/2d/3d`` call whose weight or bias is a site
  value, and every matrix product that is a linear layer (``x @ w``,
  ``torch.matmul``, ``torch.mm``, ``torch.addmm``, a two-operand
  ``torch.einsum`` with one contracted index: see
  :func:`~pyro_vinit.poutine._layer_ops.parse_matmul`), handed to
  :meth:`~LayerCallMessenger._process_layer_call` as a
  :class:`~pyro_vinit.poutine._layer_ops.LayerCall`;
* views of site values (transposed, reshaped, sliced, split or cast), whose
  distribution is that of the draw seen through the same ops
  (:attr:`SiteValue.view_ops`);
* the other uses of site values by layer-like ops it does not treat
  (:meth:`~LayerCallMessenger._on_custom_op`).

A layer call whose weight or bias has leading batch dims (the sample dim of
:class:`~pyro.infer.Predictive` with ``parallel=True``, or of an ELBO's
vectorized particles; for a matrix product, a matrix site in no other
plate), which ``F.linear`` and ``F.conv*d`` do not take, runs as one batched
layer
(:func:`~pyro_vinit.poutine._layer_ops.batched_layer`) when the handler
leaves it unchanged.

It also lets a handler *defer* a draw until something needs the value
(:meth:`~LayerCallMessenger._draw`). Site values stay ordinary tensors in
every other respect, also after the context exits, and under
:func:`torch.compile` the handler runs eagerly.

The initializers' tracer, which must also see layers whose weights are plain
tensors, is the :class:`~torch.overrides.TorchFunctionMode`-based
:class:`~pyro_vinit.poutine.layer_recorder.LayerRecorderMessenger`: a mode
pays a Python call on every torch function of the step, too much for a
per-step handler. The two front ends share what they know: which ops are
views and which elements a view holds (:mod:`~pyro_vinit.poutine._tensor_ops`)
and how a call becomes a :class:`LayerCall`
(:func:`~pyro_vinit.poutine._layer_ops.find_layer_call`). Only one
layer-call handler may be active at a time.
"""

from types import TracebackType
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple, Type, cast

import pyro.distributions as dist
import torch
import torch.nn.functional as F
from pyro.poutine.messenger import Messenger
from torch.distributions import Distribution, Independent
from typing_extensions import Self, TypeGuard

from pyro_vinit._pyro_compat import is_predictive_samples, is_sample_frame
from pyro_vinit._typing import SampleSite
from pyro_vinit.poutine._batched_modules import FOLD, UNFOLD, BatchedModules
from pyro_vinit.poutine._layer_ops import (
    LAYER_OPS,
    MATMUL_OPS,
    LayerCall,
    batched_layer,
    check_batched_input,
    find_layer_call,
    is_batched,
    op_name,
)
from pyro_vinit.poutine._site_value import (
    ACTIVE,
    SiteValue,
    Uses,
    eager,
    from_the_model,
    unwrap,
)
from pyro_vinit.poutine._tensor_ops import ELEMENT_OPS, PIECES, uses_values
from pyro_vinit.poutine._weight_views import refuse_left_counting

__all__ = ["LayerCall", "LayerCallMessenger"]

_T = torch.Tensor
# The modules whose code hands a site value's operation on to the handler
_DISPATCH = (__name__, BatchedModules.__module__)
# Operations that use a site value as a layer's weight in a way the handlers cannot see
# (the matrix products too, in the forms parse_matmul does not read as a layer).
_CUSTOM_LAYER_OPS = MATMUL_OPS | {
    torch.bmm, _T.bmm, torch.mv, _T.mv, torch.tensordot, torch.addmv, torch.baddbmm,
    torch.inner, F.bilinear, F.embedding, F.conv_transpose1d, F.conv_transpose2d,
    F.conv_transpose3d,
}


def base_distribution(fn: Any) -> Any:
    """``fn`` without its ``Independent`` and mask wrappers (which change
    neither the values nor their element-wise distribution)."""
    while isinstance(fn, (Independent, dist.MaskedDistribution)):
        fn = fn.base_dist
    return fn


def _to_site_shape(msg: SampleSite, parallel: bool) -> None:
    # Predictive conditions the model on a weight's sample in another shape than its
    # site's, which F.linear and F.conv*d refuse: in parallel (a Predictive's samples'
    # plate), its samples reshaped to (num_samples,) + (1,) * (max_plate_nesting -
    # value dims) + value shape, which for a site with event dims leaves the sample dim
    # off its plate's dim; sequentially, a guide with plates draws each sample as
    # (1,) * plates + the weight's shape. The site's distribution has the shape in
    # place: take it (the same elements).
    fn, value = msg["fn"], msg["value"]
    if not (isinstance(fn, Distribution) and isinstance(value, torch.Tensor)):
        return
    shape = fn.batch_shape + fn.event_shape
    if (len(fn.event_shape) > 0 and value.shape != shape and value.numel() == shape.numel()
            and (parallel or value.shape[value.dim() - len(shape):] == shape)):
        msg["value"] = value.reshape(shape)


def _check_sample_dims(msg: SampleSite) -> None:
    # A batched layer's output meets a site: a non-1 dim left of the plate of the
    # samples (or particles) lies outside every plate, where a batched layer put the
    # samples' dim one too far left (its output's last dim a plate's)
    fn = msg["fn"]
    batch = getattr(fn, "batch_shape", None)
    if batch is None:
        return
    for frame in msg["cond_indep_stack"]:
        if frame.dim is not None and is_sample_frame(frame):
            outside = batch[:max(0, len(batch) + frame.dim)]
            if any(size != 1 for size in outside):
                raise ValueError(
                    f"the site {msg['name']!r} has batch shape {tuple(batch)}, with dims left "
                    f"of the plate of the vectorized samples or particles (dim {frame.dim}): "
                    "a batched layer's output (its weight has the samples' dim) puts that "
                    "dim left of the model's plate dims of the layer's input, and here the "
                    "output's last dim is a plate's too (e.g. outputs (N, 1) in a data plate "
                    "at dim=-2), so its samples' dim is one too far left. Give the outputs "
                    "an event dim (pyro.plate('data', N) with "
                    "dist.Normal(mu, sigma).to_event(1), or mu.squeeze(-1)), or take the "
                    "samples or particles one at a time (Predictive(..., parallel=False); "
                    "vectorize_particles=False, fit's num_particles=1)")
            return


def _has_sample_dim(msg: SampleSite, value: torch.Tensor) -> bool:
    # Whether an observed value has the dim of Predictive's samples (given samples of a
    # latent site, not the data, which lacks it)
    event_dim = getattr(msg["fn"], "event_dim", 0)
    for frame in msg["cond_indep_stack"]:
        if is_predictive_samples(frame) and frame.dim is not None:
            dim = frame.dim - event_dim
            return value.dim() >= -dim and value.shape[dim] == frame.size
    return False


def _is_latent(value: object) -> TypeGuard[SiteValue]:
    return isinstance(value, SiteValue) and bool(value.msgs)


def _any(value: object) -> bool:
    return True


def _sample_dims(value: torch.Tensor) -> int:
    # The leading dims of a matrix site's value (or its transpose) that vectorized
    # samples add: its batch dims, where the site is in no plate but theirs
    # (Predictive(parallel=True), an ELBO's vectorized particles). A matrix in a plate
    # of the model's own (e.g. one per head) is the program's batched product.
    if not _is_latent(value):
        return 0
    msg = value.msgs[0]
    fn = msg["fn"]
    frames = msg["cond_indep_stack"]
    if (not frames or len(getattr(fn, "event_shape", ())) != 2
            or not all(is_sample_frame(f) for f in frames)):
        return 0
    return max(value.dim() - 2, 0)  # (the sample dim, and the plates' singletons)


def _refuse_sample_dims(func: Callable[..., Any], values: List[SiteValue],
                        error: RuntimeError) -> None:
    # torch refused an op (no layer call) on a site value with the vectorized samples'
    # or particles' dims on its left (e.g. F.multi_head_attention_forward's w.t())
    for value in values:
        frames = value.msgs[0]["cond_indep_stack"]
        if any(is_sample_frame(f) for f in frames):
            raise ValueError(
                f"{op_name(func)} of the value of sample site {value.site!r}, "
                "which leads with the dims of Predictive's samples (parallel=True) or of "
                f"vectorized particles, failed ({str(error).splitlines()[0]}): the handlers "
                "run F.linear, F.conv*d and matrix products batched over them, and any other "
                "use of a site's value must take them. Predict with "
                "Predictive(..., parallel=False) (or vectorize_particles=False), or keep "
                "the layer deterministic (bayesianize(..., exclude=[...]))") from error


def _refuse_merged_input(call: LayerCall) -> None:
    # a batched layer on an input whose sample dims a reshape merged into its rows would
    # run every sample's weight on every sample's rows
    raise ValueError(
        f"F.{call.op} (sample site {call.weight_name or call.bias_name!r}) runs batched over "
        f"the samples or particles on an input of shape {tuple(call.input.shape)} into whose "
        f"first dim a reshape merged their dims ({FOLD}): every sample's weight would meet "
        f"every sample's rows. {UNFOLD}, flatten from the right (x.flatten(-3)), or keep the "
        "layer deterministic (bayesianize(..., exclude=[...]))")


def _msgs_of(value: Any) -> List[SampleSite]:
    return value.msgs if _is_latent(value) and value.is_view else []


def _site_values(items: Iterable[Any]) -> List[SiteValue]:
    # At the top level, and in a list of the model's own call (torch.cat([w, v])): Pyro and
    # this library stack and concatenate draws on purpose (Predictive's samples), no use of
    # them. (torch unpacks an operand list, einsum's, before dispatching.)
    items = list(items)
    found = [item for item in items if isinstance(item, SiteValue)]
    listed = [value for item in items if isinstance(item, (tuple, list))
              for value in item if isinstance(value, SiteValue)]
    if listed and from_the_model(*_DISPATCH, SiteValue.__module__):
        found += listed
    return found


class LayerCallMessenger(Messenger):
    """
    Base effect handler that pairs the model's layer calls with the sample
    sites their weights came from (see the module docstring).

    Subclasses override :meth:`_process_layer_call`, and may override
    :meth:`_draw`, :meth:`_post_site_value` and :meth:`_on_custom_op`.
    Only one such handler may be active at a time.
    """

    def __init__(self) -> None:
        super().__init__()
        self._batched = BatchedModules()
        self._start_run()

    def _start_run(self) -> None:
        # name -> the latest message that drew the site's value in this context;
        # id(msg) -> the value this handler drew for it, until post-processing.
        self._draws: Dict[str, SampleSite] = {}
        self._pending: Dict[int, SiteValue] = {}
        # name -> the latest message holding a site value drawn by a distribution (not an
        # auxiliary site of a guide): the latent sites of the run, for reports.
        self._latent: Dict[str, SampleSite] = {}
        self._busy = False

    # torch.compile runs the handler's own code eagerly: Dynamo would trace into the
    # deferred draws and run them out of order (issue 13).
    @eager
    def __enter__(self) -> Self:
        if ACTIVE:
            raise RuntimeError(
                f"{type(self).__name__} cannot be entered while "
                f"{type(ACTIVE[-1]).__name__} is active: nesting two layer-call handlers "
                "(e.g. local_reparam inside flipout) is ambiguous. Use one handler; "
                "FlipoutMessenger covers the sites LocalReparamMessenger cannot."
            )
        result = super().__enter__()
        self._start_run()
        ACTIVE.append(self)
        return result

    @eager
    def __exit__(
        self,
        exc_type: Optional[Type[BaseException]],
        exc_value: Optional[BaseException],
        traceback: Optional[TracebackType],
    ) -> None:
        self._start_run()
        self._batched.close()
        if ACTIVE and ACTIVE[-1] is self:
            ACTIVE.pop()
        super().__exit__(exc_type, exc_value, traceback)

    # ----------------------------------------------------------------- messages

    @eager
    def _pyro_sample(self, msg: SampleSite) -> None:
        if self._batched.samples is not None:
            _check_sample_dims(msg)
        if msg["is_observed"]:
            _to_site_shape(msg, any(is_predictive_samples(frame)
                                    for frame in msg["cond_indep_stack"]))
        if (
            msg["value"] is not None
            or msg["is_observed"]
            or msg["done"]
            or msg["args"]
            or msg["kwargs"]
            or msg["infer"].get("enumerate")
            or not isinstance(msg["fn"], Distribution)  # e.g. a plate's _Subsample
        ):
            return
        value = self._draw(msg)
        if value is not None:
            msg["value"] = value
            self._pending[id(msg)] = value

    def _draw(self, msg: SampleSite) -> Optional[SiteValue]:
        """
        Draws the value of a sample site that nothing has set, as the default
        would (``msg["fn"]()``), and returns it as a :class:`SiteValue` whose
        ``dist`` is ``msg["fn"]``, or None to leave the site to the default.
        Subclasses may return a deferred value (:meth:`SiteValue.defer`).
        """
        value = msg["fn"]()
        if isinstance(value, SiteValue):  # e.g. a Delta at another site's value
            return value
        if not (isinstance(value, torch.Tensor) and value.is_floating_point()):
            return None
        return SiteValue.wrap(value, msg["fn"], [])

    @eager
    def _pyro_post_sample(self, msg: SampleSite) -> None:
        value = msg["value"]
        if not isinstance(value, torch.Tensor):
            return
        drawn = self._pending.pop(id(msg), None)
        if (msg["is_observed"] and isinstance(value, SiteValue) and (
                value.uses.used()
                or not any(self._draws.get(m["name"]) is m for m in value.msgs))):
            # a site value of an earlier run or context (e.g. samples of one Predictive
            # given to another): here a given value, as a plain tensor would be
            msg["value"] = value = unwrap(value)
        if isinstance(value, SiteValue):
            if value is drawn:
                self._draws[msg["name"]] = msg
            if value.view_ops or value.derived is not None:
                followed = self._follow_delta(msg, value)
                if followed is not None:
                    msg["value"] = value = followed
            value.msgs.append(msg)
            if value.site_dist is not None and not msg["infer"].get("is_auxiliary"):
                self._latent[msg["name"]] = msg
            self._post_site_value(msg, value)
        elif value.is_floating_point():
            if msg["is_observed"]:
                draw = self._draws.get(msg["name"])
                if draw is not None and draw["value"].shape == value.shape:
                    # Conditioned on a draw of the guide (Predictive): a new value with
                    # the distribution of the draw, seen as the draw was (view_ops).
                    # _draws holds the messages whose value this handler drew.
                    d = cast(SiteValue, draw["value"])
                    msg["value"] = SiteValue.wrap(
                        value, d.site_dist, [draw, msg], d.view_ops, d.derived, Uses(d.uses.shape)
                    )
                    self._latent[msg["name"]] = msg
                elif _has_sample_dim(msg, value):
                    # Conditioned on given samples (Predictive's posterior_samples): a
                    # value of unknown law, which a layer still runs batched over
                    msg["value"] = SiteValue.wrap(value, None, [msg])
            elif drawn is not None:
                # A handler outside this one replaced the value it drew (e.g. poutine.replay
                # of a guide trace drawn outside it): where it came from is unknown.
                msg["value"] = SiteValue.wrap(value, None, [msg])

    def _post_site_value(self, msg: SampleSite, value: SiteValue) -> None:
        """Hook called after ``msg`` took the site value ``value`` (its last message)."""

    def _follow_delta(self, msg: SampleSite, value: SiteValue) -> Optional[SiteValue]:
        # Pyro's AutoNormal puts Delta(v) at the site, v the auxiliary Normal's value mapped
        # to the support (itself for real support): the site value is then v's value.
        fn = base_distribution(msg["fn"])
        source = fn.v if isinstance(fn, dist.Delta) else None
        if not (isinstance(source, SiteValue) and source.is_view and source.shape == value.shape):
            return None
        return SiteValue.wrap(
            value.concrete, source.site_dist, list(source.msgs), source.view_ops, None, source.uses
        )

    # -------------------------------------------------------------- layer calls

    def _site_value_op(
        self, func: Callable[..., Any], args: Tuple[Any, ...], kwargs: Dict[str, Any]
    ) -> Any:
        # Called by SiteValue.__torch_function__ for every operation on a site value
        # while this handler is active; NotImplemented means "run it as usual".
        if self._busy:
            return NotImplemented
        if func in PIECES and args and _is_latent(args[0]):
            # a split (w.chunk(3) of a fused weight): a tuple of views of the same draw
            # (its dims counted from the left refused first: a split counted from the right
            # fails only where the model's own call would, with torch's error)
            refuse_left_counting(func, args, kwargs, None, _DISPATCH)
            return args[0].pieces(func, args[1:], kwargs)
        if func in ELEMENT_OPS:
            source = args[0] if args else None
            if not _is_latent(source):
                return NotImplemented
            try:
                out = source.derive(func, args[1:], kwargs)
            except (RuntimeError, IndexError) as error:
                refuse_left_counting(func, args, kwargs, error, _DISPATCH)
                raise
            refuse_left_counting(func, args, kwargs, out, _DISPATCH)
            return out
        if func in LAYER_OPS or func in _CUSTOM_LAYER_OPS:
            # A layer function with a site value anywhere is seen; a product only with one
            # as its weight (else it is no layer: e.g. a product of two site values).
            is_weight = _any if func in LAYER_OPS else _is_latent
            call = find_layer_call(func, args, kwargs, is_weight, _msgs_of, _sample_dims)
            if call is not None:
                return self._handle_layer_call(call, func, args, kwargs)
            if func in _CUSTOM_LAYER_OPS:
                for value in _site_values(args) + _site_values(list(kwargs.values())):
                    if value.msgs:
                        self._on_custom_op(value, op_name(func))
                return NotImplemented
        values = [v for v in _site_values(args) + _site_values(list(kwargs.values())) if v.msgs]
        if not values:
            return NotImplemented
        refuse_left_counting(func, args, kwargs, None, _DISPATCH)
        try:
            out = func(*unwrap(args), **unwrap(kwargs))
        except RuntimeError as error:
            _refuse_sample_dims(func, values, error)
            raise
        if uses_values(func, out):
            for value in values:
                self._on_plain_op(value, op_name(func))
        return out

    def _handle_layer_call(
        self,
        call: LayerCall,
        func: Callable[..., Any],
        args: Tuple[Any, ...],
        kwargs: Dict[str, Any],
    ) -> torch.Tensor:
        self._busy = True
        try:
            batched = is_batched(call.op, call.weight, call.bias)
            if batched:
                # before any handler acts on the call: an input that does not fit is refused
                if self._batched.merged(unwrap(call.input)):
                    _refuse_merged_input(call)
                check_batched_input(
                    call.op, call.input, call.weight, call.kwargs,
                    call.weight_name or call.bias_name,
                )
            out = self._process_layer_call(call)
            if out is None and batched:
                # a weight with a sample dim (Predictive(parallel=True)): F.<op> takes none
                out = batched_layer(
                    call.op, unwrap(call.input), unwrap(call.weight), unwrap(call.bias),
                    call.kwargs,
                )
            if out is not None:
                if batched:  # (a pooling or normalization call after it folds the sample dims)
                    self._batched.watch(out, out.dim() - call.input.dim())
                return out
            # unchanged: the program's own op, bit for bit
            original: torch.Tensor = func(*unwrap(args), **unwrap(kwargs))
            return original
        finally:
            self._busy = False

    def _on_custom_op(self, value: SiteValue, op_name: str) -> None:
        """Hook called when the site value ``value`` (possibly reshaped) is used
        by a matrix product or layer op that is not intercepted."""

    def _on_plain_op(self, value: SiteValue, op_name: str) -> None:
        """Hook called when the site value ``value`` (possibly reshaped) is used
        as drawn by an operation that is no layer call (e.g. ``w.norm()``,
        ``torch.tanh(w[tokens])``)."""

    def _process_layer_call(self, call: LayerCall) -> Optional[torch.Tensor]:
        """
        Handles one layer call. Returns the layer's output, or None to run the
        op unchanged. The base implementation returns None.

        :param LayerCall call: The intercepted call; its ``weight`` is a
            :class:`SiteValue` if it is a sample site's value or a view of one.
        """
        return None
