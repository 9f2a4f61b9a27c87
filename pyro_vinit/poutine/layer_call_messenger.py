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

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import pyro.distributions as dist
import torch
import torch.nn.functional as F
from pyro.poutine.messenger import Messenger
from torch.distributions import Distribution, Independent
from torch.overrides import TorchFunctionMode

from pyro_vinit.poutine._site_value import (
    ACTIVE,
    DERIVING_OPS,
    SiteValue,
    Uses,
    contains_site_value,
    unwrap,
)

__all__ = ["LayerCall", "LayerCallMessenger"]

# op -> (name, positional parameter names after (input, weight, bias))
_LAYER_OPS: Dict[Callable, Tuple[str, Tuple[str, ...]]] = {
    F.linear: ("linear", ()),
    F.conv1d: ("conv1d", ("stride", "padding", "dilation", "groups")),
    F.conv2d: ("conv2d", ("stride", "padding", "dilation", "groups")),
    F.conv3d: ("conv3d", ("stride", "padding", "dilation", "groups")),
}
_CONV_DEFAULTS = {"stride": 1, "padding": 0, "dilation": 1, "groups": 1}

_T = torch.Tensor
# Matrix products that are a linear layer when one operand is a weight (see as_linear_call).
_MATMULS = {
    torch.matmul, _T.matmul, _T.__matmul__, _T.__rmatmul__, torch.mm, _T.mm, torch.bmm, _T.bmm,
    torch.mv, _T.mv,
}
_ADDMMS = {torch.addmm, _T.addmm}
_OP_DIMS = {torch.mm: (2, 2), _T.mm: (2, 2), torch.bmm: (3, 3), _T.bmm: (3, 3)}
# Operations that use a site value as a layer's weight in a way the handlers cannot see
# (the products above too, in the forms as_linear_call does not recognize).
_CUSTOM_LAYER_OPS = _MATMULS | _ADDMMS | {
    torch.einsum, torch.tensordot, torch.addmv, torch.baddbmm, torch.inner, F.bilinear,
    F.embedding, F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d,
}


def base_distribution(fn: Any) -> Any:
    """``fn`` without its ``Independent`` and mask wrappers (which change
    neither the values nor their element-wise distribution)."""
    while isinstance(fn, (Independent, dist.MaskedDistribution)):
        fn = fn.base_dist
    return fn


def linear(
    input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """:func:`torch.nn.functional.linear`, also for a weight with batch dims
    (``(..., out, in)``, e.g. vectorized particles), which broadcast as in
    :func:`torch.matmul`."""
    if weight.dim() <= 2:
        return F.linear(input, weight, bias)
    out = torch.matmul(input, weight.mT)
    return out if bias is None else out + bias


@dataclass
class LayerCall:
    """
    One layer call seen by a :class:`LayerCallMessenger`: an ``F.linear`` or
    ``F.conv*d`` call, or a matrix product that is a linear layer (see
    :func:`as_linear_call`), in the form of the equivalent ``F.linear`` call.

    :ivar str op: ``"linear"``, ``"conv1d"``, ``"conv2d"`` or ``"conv3d"``.
    :ivar torch.Tensor input: The layer's input.
    :ivar torch.Tensor weight: The weight tensor as passed to the op (for a
        matrix product, the weight as ``F.linear`` takes it, ``(out, in)``:
        e.g. the transpose of ``w`` in ``x @ w``). With ``op = "linear"`` it may
        have batch dims, which broadcast as in :func:`torch.matmul`.
    :ivar bias: The bias tensor, or None.
    :ivar dict kwargs: The op's remaining arguments (``stride``, ``padding``,
        ``dilation``, ``groups`` for convolutions, with defaults filled in).
    :ivar list weight_msgs: The sample-site messages whose value ``weight`` is
        (or a view of: transposed, reshaped, sliced), in the order they were
        seen: the message whose distribution drew the value first (under SVI
        the guide's; for Pyro's AutoNormal the auxiliary
        ``<name>_unconstrained`` Normal, followed through the ``Delta`` at the
        site; under :class:`~pyro.infer.Predictive`, which conditions the
        model on guide samples, the guide's last draw of the site), then the
        model's. Empty if the weight is not a sample site's value.
    :ivar list bias_msgs: The same for ``bias``.
    :ivar str source: The name of the function the program called
        (``"linear"``, ``"conv2d"``, ``"matmul"``, ``"addmm"``, ``"einsum"``, ...).
    :ivar output_fn: For a matrix product, the map from the layer's output to
        the product's (a transpose, a squeeze, a permutation of dims, ...);
        None if they are the same.
    """

    op: str
    input: torch.Tensor
    weight: torch.Tensor
    bias: Optional[torch.Tensor]
    kwargs: Dict[str, Any] = field(default_factory=dict)
    weight_msgs: List[dict] = field(default_factory=list)
    bias_msgs: List[dict] = field(default_factory=list)
    source: str = ""
    output_fn: Optional[Callable[[torch.Tensor], torch.Tensor]] = None

    def __post_init__(self) -> None:
        self.source = self.source or self.op

    @property
    def fn(self) -> Callable:
        """The layer function: :func:`linear` or ``F.conv*d``."""
        return linear if self.op == "linear" else getattr(F, self.op)

    def __call__(
        self,
        input: Optional[torch.Tensor] = None,
        weight: Optional[torch.Tensor] = None,
        bias: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Runs the layer (without :attr:`output_fn`) with the call's arguments,
        optionally replacing ``input``, ``weight`` and ``bias`` (pass
        ``bias=False`` for none)."""
        input = self.input if input is None else input
        weight = self.weight if weight is None else weight
        bias = self.bias if bias is None else (None if bias is False else bias)
        return self.fn(*unwrap((input, weight, bias)), **self.kwargs)

    @property
    def weight_name(self) -> Optional[str]:
        """The model's sample-site name of the weight, or None."""
        return self.weight_msgs[-1]["name"] if self.weight_msgs else None

    @property
    def bias_name(self) -> Optional[str]:
        """The model's sample-site name of the bias, or None."""
        return self.bias_msgs[-1]["name"] if self.bias_msgs else None


# ------------------------------------------------------ matrix products as layers


def _is_latent(value: Any) -> bool:
    return isinstance(value, SiteValue) and bool(value.msgs)


def _msgs_of(value: Any) -> List[dict]:
    return value.msgs if _is_latent(value) and value.is_view else []


def _weight_position(operands) -> Optional[int]:
    # The position of the one operand that is a site value, if exactly one is.
    latent = [i for i, v in enumerate(operands) if _is_latent(v)]
    return latent[0] if len(latent) == 1 else None


def _transposed(w: torch.Tensor) -> torch.Tensor:
    return w.derive(_T.mT.__get__) if isinstance(w, SiteValue) else unwrap(w).mT


def _row(w: torch.Tensor) -> torch.Tensor:
    return w.derive(_T.unsqueeze, (0,)) if isinstance(w, SiteValue) else unwrap(w).unsqueeze(0)


def _squeeze_last(t: torch.Tensor) -> torch.Tensor:
    return t.squeeze(-1)


def _mT(t: torch.Tensor) -> torch.Tensor:
    return t.mT


def _linear_call(source, input, weight, bias=None, output_fn=None) -> LayerCall:
    input = unwrap(input)
    return LayerCall(
        "linear", input, weight, bias, {}, _msgs_of(weight), _msgs_of(bias), source, output_fn
    )


def _matmul_call(func, args, kwargs) -> Optional[LayerCall]:
    if kwargs or len(args) != 2:
        return None
    a, b = args if func is not _T.__rmatmul__ else args[::-1]
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or 0 in (a.dim(), b.dim()):
        return None
    dims = _OP_DIMS.get(func)
    if dims is not None and (a.dim(), b.dim()) != dims:
        return None
    if func in (torch.mv, _T.mv) and (a.dim(), b.dim()) != (2, 1):
        return None
    position = _weight_position((a, b))
    if position is None:
        return None
    name = func.__name__.strip("_").replace("rmatmul", "matmul")
    if position == 1:  # x @ w: w is (..., in, out), or (in,)
        x, w = unwrap(a), b
        if x.shape[-1] != w.shape[-2 if w.dim() > 1 else -1]:
            return None
        if w.dim() == 1:
            return _linear_call(name, x, _row(w), output_fn=_squeeze_last)
        return _linear_call(name, x, _transposed(w))
    w, x = a, unwrap(b)  # w @ x: w is (..., out, in), or (in,)
    if w.shape[-1] != x.shape[-2 if x.dim() > 1 else -1]:
        return None
    if w.dim() == 1:
        return _linear_call(name, x if x.dim() == 1 else x.mT, _row(w), output_fn=_squeeze_last)
    if x.dim() == 1:
        return _linear_call(name, x, w)
    return _linear_call(name, x.mT, w, output_fn=_mT)


def _addmm_call(args, kwargs) -> Optional[LayerCall]:
    if len(args) != 3 or set(kwargs) - {"beta", "alpha"}:
        return None
    b, x, w = args
    beta, alpha = kwargs.get("beta", 1), kwargs.get("alpha", 1)
    if _is_latent(x) or x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[0]:
        return None
    if alpha == 1 and beta == 1 and b.dim() == 1 and b.shape[0] == w.shape[1]:
        return _linear_call("addmm", x, _transposed(w), b)

    def output_fn(t: torch.Tensor) -> torch.Tensor:
        return alpha * t + beta * unwrap(b) if beta != 0 else alpha * t

    return _linear_call("addmm", x, _transposed(w), output_fn=output_fn)


def _einsum_call(args, kwargs) -> Optional[LayerCall]:
    if kwargs or not args or not isinstance(args[0], str):
        return None
    operands = args[1:]
    if len(operands) == 1 and isinstance(operands[0], (tuple, list)):
        operands = tuple(operands[0])
    position = _weight_position(operands) if len(operands) == 2 else None
    if position is None:
        return None
    lhs, arrow, out = args[0].replace(" ", "").partition("->")
    subscripts = lhs.split(",")
    if len(subscripts) != 2:
        return None
    ws, xs = subscripts[position], subscripts[1 - position]
    w, x = operands[position], unwrap(operands[1 - position])
    letters = xs.replace("...", "", 1)
    ellipsis = len(letters) < len(xs)
    if not (
        ws.isalpha() and len(set(ws)) == len(ws) == w.dim() <= 2
        and (letters.isalpha() or not letters) and len(set(letters)) == len(letters)
        and (len(letters) == x.dim() or (ellipsis and len(letters) <= x.dim()))
    ):
        return None
    if not arrow:  # implicit output: the letters seen once, in alphabetical order
        both = ws + letters
        out = "..." * ellipsis + "".join(sorted(c for c in set(both) if both.count(c) == 1))
    out_letters = out.replace("...", "", 1)
    contracted = [c for c in ws if c in letters and c not in out_letters]
    if len(contracted) != 1 or ("..." in out) != ellipsis:
        return None
    c = contracted[0]
    w_out = ws.replace(c, "")
    kept = letters.replace(c, "")
    if any(o in letters for o in w_out) or sorted(out_letters) != sorted(kept + w_out):
        return None
    before, _, after = xs.partition("...")
    dim = before.index(c) if c in before else after.index(c) - len(after)
    layer_subscripts = xs.replace(c, "") + w_out

    def output_fn(t: torch.Tensor) -> torch.Tensor:
        if not w_out:
            t = t.squeeze(-1)
        return t if layer_subscripts == out else torch.einsum(f"{layer_subscripts}->{out}", t)

    weight = _row(w) if not w_out else (w if ws[1] == c else _transposed(w))
    return _linear_call("einsum", x.movedim(dim, -1), weight, output_fn=output_fn)


def as_linear_call(func: Callable, args: tuple, kwargs: dict) -> Optional[LayerCall]:
    """
    The matrix product ``func(*args, **kwargs)`` as a linear layer, if one
    operand is a sample site's value (the weight) and the product is one:
    ``torch.matmul`` / ``@`` / ``mm`` / ``bmm`` / ``mv`` with the weight on
    either side (``x @ w`` with ``w`` of shape ``(..., in, out)`` or
    ``(in,)``, ``w @ x`` with ``w`` of shape ``(..., out, in)``; batch dims
    of the weight broadcast), ``torch.addmm(b, x, w)`` and ``torch.einsum``
    of two operands with one contracted index and at most one other index of
    the weight (e.g. ``"bi,io->bo"``, ``"...i,oi->...o"``). Otherwise None.

    The returned call's :attr:`~LayerCall.output_fn` maps the layer's output
    to the product's.
    """
    if func in _MATMULS:
        return _matmul_call(func, args, kwargs)
    if func in _ADDMMS:
        return _addmm_call(args, kwargs)
    if func is torch.einsum:
        return _einsum_call(args, kwargs)
    return None


class _LayerCallMode(TorchFunctionMode):
    def __init__(self, messenger: "LayerCallMessenger"):
        super().__init__()
        self.messenger = messenger

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        spec = _LAYER_OPS.get(func)
        if spec is None:
            return func(*args, **kwargs)
        return self.messenger._handle_layer_call(self.messenger._make_call(spec, args, kwargs))


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
            value.real, source.dist, list(source.msgs), source.view_ops, None, source.uses
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

    def _make_call(self, spec: Tuple[str, Tuple[str, ...]], args, kwargs) -> LayerCall:
        op, names = spec
        args, kwargs = list(args), dict(kwargs)
        input = args[0] if args else kwargs.pop("input")
        weight = args[1] if len(args) > 1 else kwargs.pop("weight")
        bias = args[2] if len(args) > 2 else kwargs.pop("bias", None)
        extra = dict(zip(names, args[3:]))
        extra.update(kwargs)
        if op != "linear":
            for key, default in _CONV_DEFAULTS.items():
                extra.setdefault(key, default)
        return LayerCall(
            op, input, weight, bias, extra, self._msgs_for(weight), self._msgs_for(bias)
        )

    def _handle_layer_call(
        self, call: LayerCall, original: Optional[Callable[[], torch.Tensor]] = None
    ) -> torch.Tensor:
        self._busy = True
        try:
            out = self._process_layer_call(call)
            if out is None:
                return original() if original is not None else call()
            return out if call.output_fn is None else call.output_fn(out)
        finally:
            self._busy = False

    def _site_value_op(self, func, args, kwargs) -> Any:
        # Called by SiteValue.__torch_function__ for every operation on a site value
        # while this handler is active; NotImplemented means "run it as usual".
        if self._busy:
            return NotImplemented
        spec = _LAYER_OPS.get(func)
        if spec is not None:
            return self._handle_layer_call(self._make_call(spec, args, kwargs))
        if func in DERIVING_OPS:
            source = args[0] if args else None
            if _is_latent(source):
                return source.derive(func, args[1:], kwargs)
            return NotImplemented
        if func in _CUSTOM_LAYER_OPS:
            call = as_linear_call(func, args, kwargs)
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
        Handles one layer call. Returns the layer's output (that of
        ``call.fn``: the base applies :attr:`LayerCall.output_fn` to it), or
        None to run the op unchanged. The base implementation returns None.

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
