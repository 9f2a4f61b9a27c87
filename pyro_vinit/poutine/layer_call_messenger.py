"""
Seeing the ``F.linear`` / ``F.conv*d`` calls of a model together with the
sample sites their weights came from.

:class:`LayerCallMessenger` is the base of the library's layer-aware effect
handlers (local reparameterization, Flipout, the I-BLM tracer). While it is
active it records, for every sample site, the messages that hold its value,
so that a weight tensor can be traced back to the distribution that drew it
(the guide's) and to the model's prior, and it hands each layer call to
:meth:`LayerCallMessenger._process_layer_call` as a :class:`LayerCall`.

How calls are intercepted is chosen per class by
:attr:`LayerCallMessenger.interception`; neither way touches a module
attribute, so ``torch.nn.functional`` is exactly as it was, also after an
exception, and nothing outside the context can observe the handler:

``"mode"`` (the default)
    A :class:`torch.overrides.TorchFunctionMode`, scoped to the context by
    construction (popped on exit, also after an exception). It sees every
    layer call, including those whose weight is a plain parameter and
    ``torch.conv2d`` called directly. Its cost is a Python call for *every*
    torch function run inside the context: guide, model, ELBO and optimizer
    alike. On the SVI step of a 64→400→400→10 network with AutoKTiedNormal it
    adds 20–25% (1.3 ms to 6.8 ms, 2 ms to 8.3 ms with Pyro's validation on;
    ``benchmarks/bench_lrt.py``), more than local reparameterization saves.
    Right for one-off passes such as an initializer.

``"site_values"``
    Each floating-point sample-site value is handed to the program as a
    :class:`~pyro_vinit.poutine._site_value.SiteValue`, a tensor subclass
    whose ``__torch_function__`` reports the layer calls it takes part in.
    Only operations on site values pay for the interception, which makes it
    the choice of the per-step handlers (local reparameterization, Flipout).
    It sees exactly the calls whose weight or bias is a site value, also a
    reshaped or cast one (:attr:`SiteValue.derived`), and the other uses of
    site values by matrix products (:meth:`_on_custom_op`). It also lets a
    handler *defer* a draw until something needs the value
    (:meth:`_draw`). Site values stay ordinary tensors in every other
    respect, also after the context exits.

Only one layer-call handler may be active at a time.
"""

from typing import Any, Callable, Dict, List, Optional, Tuple

import pyro.distributions as dist
import torch
import torch.nn.functional as F
from pyro.poutine.messenger import Messenger
from torch.distributions import Distribution, Independent
from torch.overrides import TorchFunctionMode

from pyro_vinit.poutine._layer_ops import (
    LAYER_OPS,
    MATMUL_OPS,
    LayerCall,
    parse_layer_call,
    parse_matmul,
)
from pyro_vinit.poutine._site_value import (
    ACTIVE,
    DERIVING_OPS,
    SiteValue,
    Uses,
    contains_site_value,
    unwrap,
)

__all__ = ["LayerCall", "LayerCallMessenger"]

_T = torch.Tensor
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


def _is_latent(value: Any) -> bool:
    return isinstance(value, SiteValue) and bool(value.msgs)


def _msgs_of(value: Any) -> List[dict]:
    return value.msgs if _is_latent(value) and value.is_view else []


def _matmul_call(func, args, kwargs) -> Optional[LayerCall]:
    # A matrix product read as an F.linear call whose weight is the view of the site value.
    found = parse_matmul(func, args, kwargs, _is_latent)
    if found is None:
        return None
    x, w, transposed, bias = found
    weight = w.derive(_T.mT.__get__) if transposed else w
    return LayerCall(
        "linear", unwrap(x), weight, bias, transposed=transposed,
        source=getattr(func, "__name__", str(func)).strip("_").replace("rmatmul", "matmul"),
        weight_msgs=_msgs_of(w), bias_msgs=_msgs_of(bias),
    )


class _LayerCallMode(TorchFunctionMode):
    def __init__(self, messenger: "LayerCallMessenger"):
        super().__init__()
        self.messenger = messenger

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        call = self.messenger._make_call(func, args, kwargs)
        if call is None:
            return func(*args, **kwargs)
        return self.messenger._handle_layer_call(call)


class LayerCallMessenger(Messenger):
    """
    Base effect handler that pairs the model's ``F.linear`` / ``F.conv*d``
    calls with the sample sites their weights came from.

    Subclasses override :meth:`_process_layer_call`, and may choose the
    interception mechanism (:attr:`interception`) and, with
    ``"site_values"``, override :meth:`_draw` and :meth:`_on_custom_op`. See
    the module docstring. Only one such handler may be active at a time.
    """

    #: ``"mode"`` or ``"site_values"``: see the module docstring.
    interception = "mode"

    def __init__(self) -> None:
        super().__init__()
        if self.interception not in ("mode", "site_values"):
            raise ValueError(
                f"{type(self).__name__}.interception must be 'mode' or 'site_values', "
                f"not {self.interception!r}"
            )
        self._mode: Optional[_LayerCallMode] = None
        self._start_run()

    def _start_run(self) -> None:
        # "mode": id(value) -> (value, msgs holding it); name -> its latest value.
        self._by_value: Dict[int, Tuple[torch.Tensor, List[dict]]] = {}
        self._value_of: Dict[str, torch.Tensor] = {}
        # "site_values": name -> the latest message that drew the site's value in this
        # context; id(msg) -> the value this handler drew for it, until post-processing.
        self._draws: Dict[str, dict] = {}
        self._pending: Dict[int, SiteValue] = {}
        # name -> the latest message holding a site value drawn by a distribution (not an
        # auxiliary site of a guide): the latent sites of the run, for reports.
        self._latent: Dict[str, dict] = {}
        self._busy = False

    @torch.compiler.disable
    def __enter__(self):
        if ACTIVE:
            raise RuntimeError(
                f"{type(self).__name__} cannot be entered while "
                f"{type(ACTIVE[-1]).__name__} is active: nesting two layer-call handlers "
                "(e.g. local_reparam inside flipout) is ambiguous. Use one handler; "
                "FlipoutMessenger covers the sites LocalReparamMessenger cannot."
            )
        result = super().__enter__()
        self._start_run()
        if self.interception == "mode":
            self._mode = _LayerCallMode(self)
            self._mode.__enter__()
        ACTIVE.append(self)
        return result

    @torch.compiler.disable
    def __exit__(self, exc_type, exc_value, traceback):
        try:
            if self._mode is not None:
                self._mode.__exit__(exc_type, exc_value, traceback)
        finally:
            self._mode = None
            self._start_run()
            if ACTIVE and ACTIVE[-1] is self:
                ACTIVE.pop()
            super().__exit__(exc_type, exc_value, traceback)

    # ----------------------------------------------------------------- messages

    @torch.compiler.disable
    def _pyro_sample(self, msg: dict) -> None:
        if (
            self.interception != "site_values"
            or msg["value"] is not None
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

    def _draw(self, msg: dict) -> Optional[SiteValue]:
        """
        With ``interception = "site_values"``: draws the value of a sample
        site that nothing has set, as the default would (``msg["fn"]()``),
        and returns it as a :class:`SiteValue` whose ``dist`` is
        ``msg["fn"]``, or None to leave the site to the default. Subclasses
        may return a deferred value (:meth:`SiteValue.defer`).
        """
        value = msg["fn"]()
        if isinstance(value, SiteValue):  # e.g. a Delta at another site's value
            return value
        if not (isinstance(value, torch.Tensor) and value.is_floating_point()):
            return None
        return SiteValue.wrap(value, msg["fn"], [])

    @torch.compiler.disable
    def _pyro_post_sample(self, msg: dict) -> None:
        value = msg["value"]
        if not isinstance(value, torch.Tensor):
            return
        if self.interception == "mode":
            self._record(msg, value)
            return
        drawn = self._pending.pop(id(msg), None)
        if isinstance(value, SiteValue):
            if value is drawn:
                self._draws[msg["name"]] = msg
            if value.view_ops or value.derived is not None:
                followed = self._follow_delta(msg, value)
                if followed is not None:
                    msg["value"] = value = followed
            value.msgs.append(msg)
            if value.dist is not None and not msg["infer"].get("is_auxiliary"):
                self._latent[msg["name"]] = msg
            self._post_site_value(msg, value)
        elif value.is_floating_point():
            if msg["is_observed"]:
                draw = self._draws.get(msg["name"])
                if draw is not None and draw["value"].shape == value.shape:
                    # Conditioned on a draw of the guide (Predictive): the value is new, its
                    # distribution that of the draw (seen as the draw was: view_ops).
                    d = draw["value"]
                    msg["value"] = SiteValue.wrap(
                        value, d.dist, [draw, msg], d.view_ops, d.derived, Uses(d.uses.shape)
                    )
                    self._latent[msg["name"]] = msg
            elif drawn is not None:
                # A handler outside this one replaced the value it drew (e.g. poutine.replay
                # of a guide trace drawn outside it): where it came from is unknown.
                msg["value"] = SiteValue.wrap(value, None, [msg])

    def _post_site_value(self, msg: dict, value: SiteValue) -> None:
        """Hook called after ``msg`` took the site value ``value`` (its last message)."""

    def _follow_delta(self, msg: dict, value: SiteValue) -> Optional[SiteValue]:
        # Pyro's AutoNormal puts Delta(v) at the site, v the auxiliary Normal's value mapped
        # to the support (itself for real support): the site value is then v's value.
        fn = base_distribution(msg["fn"])
        source = getattr(fn, "v", None) if isinstance(fn, dist.Delta) else None
        if not (isinstance(source, SiteValue) and source.is_view and source.shape == value.shape):
            return None
        return SiteValue.wrap(
            value.concrete, source.dist, list(source.msgs), source.view_ops, None, source.uses
        )

    def _record(self, msg: dict, value: torch.Tensor) -> None:
        entry = self._by_value.get(id(value))
        if entry is None or entry[0] is not value:
            old = self._value_of.get(msg["name"])
            if old is not None and self._by_value.get(id(old), (None,))[0] is old:
                del self._by_value[id(old)]
            fn = base_distribution(msg["fn"])
            source = getattr(fn, "v", None) if isinstance(fn, dist.Delta) else None
            start = list(self._msgs_for(source)) if source is not None else []
            if start and source.shape != value.shape:
                start = []
            entry = self._by_value[id(value)] = (value, start)
        entry[1].append(msg)
        self._value_of[msg["name"]] = value

    def _msgs_for(self, tensor: Optional[torch.Tensor]) -> List[dict]:
        if tensor is None:
            return []
        if isinstance(tensor, SiteValue):
            return _msgs_of(tensor)
        entry = self._by_value.get(id(tensor))
        return entry[1] if entry is not None and entry[0] is tensor else []

    # -------------------------------------------------------------- layer calls

    def _make_call(self, func, args, kwargs) -> Optional[LayerCall]:
        parsed = parse_layer_call(func, args, kwargs)
        if parsed is None:
            return None
        op, input, weight, bias, extra = parsed
        return LayerCall(
            op, input, weight, bias, extra, source=op,
            weight_msgs=self._msgs_for(weight), bias_msgs=self._msgs_for(bias),
        )

    def _handle_layer_call(
        self, call: LayerCall, original: Optional[Callable[[], torch.Tensor]] = None
    ) -> torch.Tensor:
        self._busy = True
        try:
            out = self._process_layer_call(call)
            if out is None:
                return original() if original is not None else call()
            return out
        finally:
            self._busy = False

    def _site_value_op(self, func, args, kwargs) -> Any:
        # Called by SiteValue.__torch_function__ for every operation on a site value
        # while this handler is active; NotImplemented means "run it as usual".
        if self._busy:
            return NotImplemented
        if func in LAYER_OPS:
            return self._handle_layer_call(self._make_call(func, args, kwargs))
        if func in DERIVING_OPS:
            source = args[0] if args else None
            if _is_latent(source):
                return source.derive(func, args[1:], kwargs)
            return NotImplemented
        if func in _CUSTOM_LAYER_OPS:
            call = _matmul_call(func, args, kwargs)
            if call is not None:
                return self._handle_layer_call(
                    call, lambda: func(*unwrap(args), **unwrap(kwargs))
                )
            name = getattr(func, "__name__", str(func)).strip("_")
            for value in _site_values(args) + _site_values(list(kwargs.values())):
                if value.msgs:
                    self._on_custom_op(value, name)
        return NotImplemented

    def _on_custom_op(self, value: SiteValue, op_name: str) -> None:
        """Hook called when the site value ``value`` (possibly reshaped) is used
        by a matrix product or layer op that is not intercepted."""

    def _process_layer_call(self, call: LayerCall) -> Optional[torch.Tensor]:
        """
        Handles one layer call. Returns the layer's output, or None to run the
        op unchanged. The base implementation returns None.

        :param LayerCall call: The intercepted call.
        """
        return None


def _site_values(items) -> List[SiteValue]:
    found = []
    for item in items:
        if isinstance(item, SiteValue):
            found.append(item)
        elif isinstance(item, (tuple, list)) and contains_site_value(item):
            found.extend(_site_values(item))
    return found
