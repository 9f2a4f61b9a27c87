"""
Seeing the ``F.linear`` / ``F.conv*d`` calls of a model together with the
sample sites their weights came from.

:class:`LayerCallMessenger` is the base of the library's layer-aware effect
handlers (local reparameterization, Flipout, the I-BLM tracer). While it is
active it

* records, for every sample site, the message that produced its value
  (``_pyro_post_sample``), so a weight tensor can be traced back to the
  guide's distribution that drew it and to the model's prior; and
* intercepts ``torch.nn.functional.linear`` and ``conv1d/2d/3d`` with a
  :class:`torch.overrides.TorchFunctionMode`, handing each call to
  :meth:`LayerCallMessenger._process_layer_call` as a :class:`LayerCall`.

A ``TorchFunctionMode`` is used instead of patching ``torch.nn.functional``:
it is scoped to the context by construction (it is popped on exit, also after
an exception), it also sees ``torch.conv2d`` called directly and ``nn.Linear``
/ ``nn.Conv*d`` modules, and nothing outside the context can observe it.
"""

import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from pyro.poutine.messenger import Messenger
from torch.overrides import TorchFunctionMode

__all__ = ["LayerCall", "LayerCallMessenger"]

# op -> (name, positional parameter names after (input, weight, bias))
_LAYER_OPS: Dict[Callable, Tuple[str, Tuple[str, ...]]] = {
    F.linear: ("linear", ()),
    F.conv1d: ("conv1d", ("stride", "padding", "dilation", "groups")),
    F.conv2d: ("conv2d", ("stride", "padding", "dilation", "groups")),
    F.conv3d: ("conv3d", ("stride", "padding", "dilation", "groups")),
}
_CONV_DEFAULTS = {"stride": 1, "padding": 0, "dilation": 1, "groups": 1}

# At most one layer-call handler may be active: two would each rewrite the
# other's output and the result would depend on their order.
_ACTIVE: List["LayerCallMessenger"] = []


@dataclass
class LayerCall:
    """
    One ``F.linear`` or ``F.conv*d`` call seen by a :class:`LayerCallMessenger`.

    :ivar str op: ``"linear"``, ``"conv1d"``, ``"conv2d"`` or ``"conv3d"``.
    :ivar torch.Tensor input: The layer's input.
    :ivar torch.Tensor weight: The weight tensor as passed to the op.
    :ivar bias: The bias tensor, or None.
    :ivar dict kwargs: The op's remaining arguments (``stride``, ``padding``,
        ``dilation``, ``groups`` for convolutions, with defaults filled in).
    :ivar list weight_msgs: The sample-site messages whose value *is* ``weight``,
        in the order they were seen: under SVI or Predictive the guide's
        message (the distribution that drew the value; for Pyro's AutoNormal
        the auxiliary ``<name>_unconstrained`` Normal first), then the
        model's. Empty if the weight is not a sample site's value (a plain
        parameter, or a reshaped or cast sample).
    :ivar list bias_msgs: The same for ``bias``.
    """

    op: str
    input: torch.Tensor
    weight: torch.Tensor
    bias: Optional[torch.Tensor]
    kwargs: Dict[str, Any] = field(default_factory=dict)
    weight_msgs: List[dict] = field(default_factory=list)
    bias_msgs: List[dict] = field(default_factory=list)

    def __call__(
        self,
        input: Optional[torch.Tensor] = None,
        weight: Optional[torch.Tensor] = None,
        bias: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Runs the op with the call's arguments, optionally replacing
        ``input``, ``weight`` and ``bias`` (pass ``bias=False`` for none)."""
        input = self.input if input is None else input
        weight = self.weight if weight is None else weight
        bias = self.bias if bias is None else (None if bias is False else bias)
        fn = getattr(F, self.op)
        return fn(input, weight, bias, **self.kwargs)

    @property
    def weight_name(self) -> Optional[str]:
        """The model's sample-site name of the weight, or None."""
        return self.weight_msgs[-1]["name"] if self.weight_msgs else None

    @property
    def bias_name(self) -> Optional[str]:
        """The model's sample-site name of the bias, or None."""
        return self.bias_msgs[-1]["name"] if self.bias_msgs else None


class _LayerCallMode(TorchFunctionMode):
    def __init__(self, messenger: "LayerCallMessenger"):
        super().__init__()
        self.messenger = messenger

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        spec = _LAYER_OPS.get(func)
        if spec is None:
            return func(*args, **kwargs)
        op, names = spec
        call = self.messenger._make_call(op, names, args, kwargs)
        if call is None:
            return func(*args, **kwargs)
        out = self.messenger._process_layer_call(call)
        return call() if out is None else out


class LayerCallMessenger(Messenger):
    """
    Base effect handler that pairs the model's ``F.linear`` / ``F.conv*d``
    calls with the sample sites their weights came from.

    Subclasses override :meth:`_process_layer_call`. See the module docstring
    for the mechanism. Only one such handler may be active at a time.
    """

    def __init__(self) -> None:
        super().__init__()
        self._mode: Optional[_LayerCallMode] = None
        self._site_msgs: Dict[str, List[Tuple[int, dict]]] = {}
        self._counter = itertools.count()

    def __enter__(self):
        if _ACTIVE:
            raise RuntimeError(
                f"{type(self).__name__} cannot be entered while "
                f"{type(_ACTIVE[-1]).__name__} is active: nesting two layer-call handlers "
                "(e.g. local_reparam inside flipout) is ambiguous. Use one handler; "
                "FlipoutMessenger covers the sites LocalReparamMessenger cannot."
            )
        result = super().__enter__()
        self._site_msgs = {}
        self._mode = _LayerCallMode(self)
        self._mode.__enter__()
        _ACTIVE.append(self)
        return result

    def __exit__(self, exc_type, exc_value, traceback):
        try:
            if self._mode is not None:
                self._mode.__exit__(exc_type, exc_value, traceback)
        finally:
            self._mode = None
            self._site_msgs = {}
            if _ACTIVE and _ACTIVE[-1] is self:
                _ACTIVE.pop()
            super().__exit__(exc_type, exc_value, traceback)

    def _pyro_post_sample(self, msg: dict) -> None:
        value = msg["value"]
        if not isinstance(value, torch.Tensor):
            return
        # Keep per name only the messages that share the current value, so memory
        # stays bounded by the number of sites over any number of steps.
        history = self._site_msgs.get(msg["name"])
        if history is None or history[-1][1]["value"] is not value:
            history = self._site_msgs[msg["name"]] = []
        history.append((next(self._counter), msg))

    def _msgs_for(self, tensor: Optional[torch.Tensor]) -> List[dict]:
        if tensor is None:
            return []
        found = [
            entry
            for history in self._site_msgs.values()
            for entry in history
            if entry[1]["value"] is tensor
        ]
        return [msg for _, msg in sorted(found, key=lambda entry: entry[0])]

    def _make_call(self, op: str, names: Tuple[str, ...], args, kwargs) -> Optional[LayerCall]:
        args = list(args)
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

    def _process_layer_call(self, call: LayerCall) -> Optional[torch.Tensor]:
        """
        Handles one layer call. Returns the layer's output, or None to run the
        op unchanged. The base implementation returns None.

        :param LayerCall call: The intercepted call.
        """
        return None
