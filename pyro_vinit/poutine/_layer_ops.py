"""
Which torch calls are a Bayesian layer: ``F.linear`` and ``F.conv1d/2d/3d``,
and the matrix-product spellings of a linear layer (``x @ w``,
``torch.matmul``, ``torch.mm``, ``torch.addmm``, a two-operand
``torch.einsum`` with one contracted index), each read as the equivalent
``F.linear`` call.

:func:`find_layer_call` builds the :class:`LayerCall` of such a call for
both front ends of the interception: the layer recorder of the
initializers (:mod:`~pyro_vinit.poutine.layer_recorder`) and the
weight-noise handlers (:mod:`~pyro_vinit.poutine.layer_call_messenger`).
"""

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch
import torch.nn.functional as F

from pyro_vinit._typing import SampleSite

__all__ = [
    "LAYER_OPS",
    "MATMUL_OPS",
    "LayerCall",
    "batched_layer",
    "check_batched_input",
    "find_layer_call",
    "is_batched",
    "parse_layer_call",
    "parse_matmul",
    "run_layer",
]

_T = torch.Tensor

# op -> (name, positional parameter names after (input, weight, bias))
LAYER_OPS: Dict[Callable[..., Any], Tuple[str, Tuple[str, ...]]] = {
    F.linear: ("linear", ()),
    F.conv1d: ("conv1d", ("stride", "padding", "dilation", "groups")),
    F.conv2d: ("conv2d", ("stride", "padding", "dilation", "groups")),
    F.conv3d: ("conv3d", ("stride", "padding", "dilation", "groups")),
}
_CONV_DEFAULTS = {"stride": 1, "padding": 0, "dilation": 1, "groups": 1}

#: Matrix products that :func:`parse_matmul` can read as a linear layer.
MATMUL_OPS: Set[Callable[..., Any]] = {
    torch.matmul, _T.matmul, _T.__matmul__, _T.__rmatmul__, torch.mm, _T.mm,
    torch.addmm, _T.addmm, torch.einsum,
}

_MATRIX_ONLY = {torch.mm, _T.mm, torch.addmm, _T.addmm}


@dataclass
class LayerCall:
    """
    One layer call: an ``F.linear`` / ``F.conv*d`` call, or a matrix product
    read as the equivalent ``F.linear`` call.

    :ivar str op: ``"linear"``, ``"conv1d"``, ``"conv2d"`` or ``"conv3d"``.
    :ivar torch.Tensor input: The layer's input, as ``F.<op>`` takes it.
    :ivar torch.Tensor weight: The weight, as ``F.<op>`` takes it
        (``(out, in)`` for linear): for a matrix product ``x @ w`` this is
        ``w.t()``, see :attr:`transposed`.
    :ivar bias: The bias tensor, or None.
    :ivar dict kwargs: The op's remaining arguments (``stride``, ``padding``,
        ``dilation``, ``groups`` for convolutions, with defaults filled in).
    :ivar bool transposed: Whether :attr:`weight` is the transpose of the
        tensor the program passed (a matrix product ``x @ w`` with ``w`` of
        shape ``(in, out)``).
    :ivar str source: The name of the torch function that was called.
    :ivar list weight_msgs: The sample-site messages whose value *is* the
        weight the program passed, in the order they were seen (the message
        whose distribution drew the value first). Empty for a plain tensor.
    :ivar list bias_msgs: The same for ``bias``.
    """

    op: str
    input: torch.Tensor
    weight: torch.Tensor
    bias: Optional[torch.Tensor]
    kwargs: Dict[str, Any] = field(default_factory=dict)
    transposed: bool = False
    source: str = ""
    weight_msgs: List[SampleSite] = field(default_factory=list)
    bias_msgs: List[SampleSite] = field(default_factory=list)

    def __call__(
        self,
        input: Optional[torch.Tensor] = None,
        weight: Optional[torch.Tensor] = None,
        bias: Any = None,
    ) -> torch.Tensor:
        """Runs the op with the call's arguments, optionally replacing
        ``input``, ``weight`` (in the op's layout) and ``bias`` (pass
        ``bias=False`` for none)."""
        input = self.input if input is None else input
        weight = self.weight if weight is None else weight
        bias = self.bias if bias is None else (None if bias is False else bias)
        out: torch.Tensor = getattr(F, self.op)(input, weight, bias, **self.kwargs)
        return out

    @property
    def weight_name(self) -> Optional[str]:
        """The model's sample-site name of the weight, or None."""
        return self.weight_msgs[-1]["name"] if self.weight_msgs else None

    @property
    def bias_name(self) -> Optional[str]:
        """The model's sample-site name of the bias, or None."""
        return self.bias_msgs[-1]["name"] if self.bias_msgs else None


#: ``(op, input, weight, bias, op_kwargs)`` of a layer call.
ParsedLayer = Tuple[str, torch.Tensor, torch.Tensor, Optional[torch.Tensor], Dict[str, Any]]
#: ``(input, weight, transposed, bias)`` of a matrix product read as a linear layer.
ParsedMatmul = Tuple[torch.Tensor, torch.Tensor, bool, Optional[torch.Tensor]]
IsWeight = Callable[[torch.Tensor], bool]


def parse_layer_call(
    func: Callable[..., Any], args: Sequence[Any], kwargs: Dict[str, Any]
) -> Optional[ParsedLayer]:
    """
    ``(op, input, weight, bias, op_kwargs)`` of an ``F.linear`` /
    ``F.conv*d`` call, with the conv defaults filled in, or None for any
    other function.
    """
    spec = LAYER_OPS.get(func)
    if spec is None:
        return None
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
    return op, input, weight, bias, extra


def _einsum_as_linear(
    equation: str, a: torch.Tensor, b: torch.Tensor, is_weight: IsWeight
) -> Optional[Tuple[torch.Tensor, torch.Tensor, bool]]:
    # "...i,io->...o" style: one operand is a 2-d weight, exactly one index is contracted,
    # and the output is the input's free indices followed by the weight's free index.
    equation = equation.replace(" ", "")
    if "->" not in equation or equation.count(",") != 1:
        return None
    lhs, out = equation.split("->")
    left, right = lhs.split(",")
    if is_weight(b) and not is_weight(a):
        inp, w, spec_in, spec_w = a, b, left, right
    elif is_weight(a) and not is_weight(b):
        inp, w, spec_in, spec_w = b, a, right, left
    else:
        return None
    if spec_w.startswith("...") and w.dim() == 2:
        # "ni,...io->...no", written to vectorize over sample dims: none here
        spec_w = spec_w[3:]
        if "." not in spec_in:
            out = out.replace("...", "", 1) if out.startswith("...") else out
    if len(spec_w) != 2 or "." in spec_w:
        return None
    shared = [c for c in spec_w if c in spec_in]
    letters = spec_in.replace(".", "")
    if len(shared) != 1 or shared[0] in out or len(set(letters)) != len(letters):
        return None
    k = shared[0]
    o = spec_w.replace(k, "")
    free_in = spec_in.replace(k, "")
    if out != free_in + o or o in spec_in:
        return None
    # move the contracted index of the input last
    if "." in free_in:
        if not spec_in.endswith(k):
            return None
        x = inp
    else:
        x = inp.permute([spec_in.index(c) for c in free_in] + [spec_in.index(k)])
    transposed = spec_w.index(k) == 0  # weight given as (in, out)
    return x, w, transposed


def parse_matmul(
    func: Callable[..., Any], args: Sequence[Any], kwargs: Dict[str, Any], is_weight: IsWeight,
    sample_dims: Callable[[torch.Tensor], int] = lambda t: 0,
) -> Optional[ParsedMatmul]:
    """
    Reads a matrix product of an input and a 2-d weight (``is_weight(t)``
    true for the weight, not for the input; after ``sample_dims(weight)``
    leading dims of vectorized samples, which make it a batched layer's) as
    a linear layer: returns
    ``(input, weight, transposed, bias)``, where ``weight`` is the program's
    tensor, ``weight.t()`` if ``transposed`` else ``weight`` is the
    ``(out, in)`` matrix ``F.linear`` takes, ``input`` has the contracted
    dim last, and ``bias`` is the added vector of ``torch.addmm`` (any other
    ``addmm`` is not read as a layer); or None if the call is not a linear
    layer.
    """
    if func is torch.einsum:
        if len(args) == 3 and isinstance(args[0], str) and not kwargs:
            equation, a, b = args
        elif (len(args) == 2 and isinstance(args[0], str) and isinstance(args[1], (list, tuple))
              and len(args[1]) == 2):
            equation, (a, b) = args[0], args[1]
        else:
            return None
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return None
        found = _einsum_as_linear(equation, a, b, is_weight)
        if found is None:
            return None
        return found + (None,)
    if func not in MATMUL_OPS:
        return None
    bias = None
    if func in (torch.addmm, _T.addmm):
        if kwargs.get("beta", 1) != 1 or kwargs.get("alpha", 1) != 1 or len(args) != 3:
            return None
        bias, x, w = args
        if not (isinstance(bias, torch.Tensor) and bias.dim() == 1):
            return None
    elif func is _T.__rmatmul__:
        if len(args) != 2:
            return None
        w, x = args
    else:
        if len(args) != 2 or kwargs:
            return None
        x, w = args
    if not (isinstance(x, torch.Tensor) and isinstance(w, torch.Tensor)):
        return None
    if not is_weight(w) or is_weight(x) or x.dim() < 1:
        return None
    batch = sample_dims(w)
    if w.dim() - batch != 2:
        return None
    if func in _MATRIX_ONLY and (x.dim() != 2 or batch):
        return None  # mm and addmm take matrices only: the program's own error, not a layer
    return x, w, True, bias


def op_name(func: Callable[..., Any]) -> str:
    """``func``'s name as users spell it: ``"mm"``, ``Tensor.__matmul__`` and
    ``__rmatmul__`` (``x @ w``) -> ``"matmul"``."""
    name: str = getattr(func, "__name__", None) or str(func)
    if name == "__get__":  # (an attribute read: w.T)
        name = getattr(getattr(func, "__self__", None), "__name__", name)
    return name.removeprefix("__").removesuffix("__").replace("rmatmul", "matmul")


def find_layer_call(
    func: Callable[..., Any],
    args: Sequence[Any],
    kwargs: Dict[str, Any],
    is_weight: IsWeight,
    weight_msgs: Callable[[Any], List[SampleSite]] = lambda t: [],
    sample_dims: Callable[[torch.Tensor], int] = lambda t: 0,
) -> Optional[LayerCall]:
    """
    The :class:`LayerCall` of ``func(*args, **kwargs)`` if it is a layer call
    (:data:`LAYER_OPS`) or a matrix product read as one
    (:func:`parse_matmul`) whose weight ``is_weight``, else None. A matrix
    product's weight is transposed into ``F.linear``'s layout by
    :attr:`torch.Tensor.mT` (which a tensor subclass sees);
    ``weight_msgs(t)`` gives the :attr:`LayerCall.weight_msgs` of the weight
    and bias ``t``, ``sample_dims(t)`` the number of leading dims of a
    matrix product's weight that are vectorized samples (see
    :func:`parse_matmul`).
    """
    parsed = parse_layer_call(func, args, kwargs)
    if parsed is not None:
        op, x, w, bias, extra = parsed
        if not is_weight(w):
            return None
        transposed = False
    else:
        found = parse_matmul(func, args, kwargs, is_weight, sample_dims)
        if found is None:
            return None
        x, program_weight, transposed, bias = found
        w = program_weight.mT if transposed else program_weight
        op, extra = "linear", {}
    return LayerCall(
        op, x, w, bias, extra, transposed=transposed, source=op_name(func),
        weight_msgs=weight_msgs(w), bias_msgs=weight_msgs(bias),
    )


def spatial_dims(op: str) -> int:
    """The number of spatial dims of ``F.<op>`` (0 for linear)."""
    return 0 if op == "linear" else int(op[-2])


def batch_shapes(
    op: str, input: torch.Tensor, weight: torch.Tensor
) -> Tuple[torch.Size, torch.Size]:
    """The batch dims of an ``F.<op>`` call's ``input`` (left of its features
    or channels and spatial dims) and of its ``weight`` (left of its
    ``(out, in, *kernel)``), which broadcast together in a batched layer."""
    nsp = spatial_dims(op)
    return input.shape[: input.dim() - nsp - 1], weight.shape[: max(0, weight.dim() - nsp - 2)]


def is_batched(op: str, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> bool:
    """Whether ``weight`` or ``bias`` of an ``F.<op>`` call has leading batch
    dims (e.g. a sample dim of :class:`~pyro.infer.Predictive` with
    ``parallel=True``), which ``F.<op>`` does not take."""
    return weight.dim() > spatial_dims(op) + 2 or (bias is not None and bias.dim() > 1)


def in_features(op: str, weight: torch.Tensor, kwargs: Dict[str, Any]) -> int:
    """The size of the input's feature dim (``linear``) or channel dim
    (``conv*d``) that ``F.<op>`` takes with ``weight``."""
    # (a linear layer's: the last dim, and no groups)
    return int(weight.shape[weight.dim() - spatial_dims(op) - 1]) * int(kwargs.get("groups", 1))


def check_batched_input(
    op: str,
    input: torch.Tensor,
    weight: torch.Tensor,
    kwargs: Dict[str, Any],
    name: Optional[str] = None,
) -> None:
    """
    Raises a :class:`ValueError` if ``input`` cannot be the input of
    ``F.<op>`` with ``weight`` that has leading batch dims (a batched layer
    call, :func:`is_batched`) because its feature (``linear``) or channel
    (``conv*d``) dim does not have the size the weight takes.

    Where the layers before such a call ran batched, their outputs carry
    the weight's batch dims on the left of the model's own dims; a reshape
    of such an output that counts dims from the left (``nn.Flatten()``,
    ``x.flatten(1)``, ``x.view(x.size(0), -1)``, ``x.reshape(len(x), -1)``)
    merges them into the features. No rule can tell which dims were merged,
    so the call is refused, before the layer runs, with the spellings that
    count from the right (as Pyro's vectorized models must).

    :param str op: ``"linear"``, ``"conv1d"``, ``"conv2d"`` or ``"conv3d"``.
    :param torch.Tensor input: The layer's input.
    :param torch.Tensor weight: The weight, in ``F.<op>``'s layout, with
        batch dims.
    :param dict kwargs: The op's remaining arguments (``groups``).
    :param str name: The sample site of the weight, for the message.
    :raises ValueError: If the input's feature or channel dim does not fit, or
        its batch dims do not broadcast with the weight's.
    """
    nsp = spatial_dims(op)
    expected = in_features(op, weight, kwargs)
    if input.dim() < nsp + 1:
        return  # F.<op>'s own error
    got = input.shape[input.dim() - nsp - 1]
    site = f" (sample site {name!r})" if name else ""
    if got == expected:
        x_batch, w_batch = batch_shapes(op, input, weight)
        try:
            torch.broadcast_shapes(w_batch, x_batch)  # type: ignore[no-untyped-call]
        except RuntimeError:
            raise ValueError(
                f"F.{op}{site} runs batched with a weight of batch dims {tuple(w_batch)} "
                "(a dim of vectorized samples or particles, left of the model's "
                f"max_plate_nesting plate dims), which do not line up with its input's "
                f"{tuple(x_batch)}: the input has more dims left of its "
                f"{'features' if op == 'linear' else 'channels'} than the plates, e.g. "
                "(batch, tokens, features) under one plate. Give the ELBO "
                "max_plate_nesting= that many dims (TraceMeanField_ELBO(..., "
                "max_plate_nesting=2))") from None
        return
    dim = "feature" if op == "linear" else "channel"
    raise ValueError(
        f"F.{op}{site} runs batched (its weight or bias has the batch dims of "
        f"vectorized samples or particles) with a weight that takes {expected} input "
        f"{dim}s, but its input of shape {tuple(input.shape)} has {got}. Where the "
        "layers before it ran batched, their outputs carry these batch dims on the left "
        "of the model's own dims, so a reshape that counts dims from the left "
        "(nn.Flatten(), x.flatten(1), x.view(x.size(0), -1), x.reshape(len(x), -1)) "
        f"merges them with the {dim}s. Count dims from the right instead, as models "
        "run with vectorized samples must: e.g. nn.Flatten(-3), x.flatten(-3) or "
        "x.reshape(x.shape[:-3] + (-1,)) for (C, H, W) features."
    )


def batched_layer(
    op: str,
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    kwargs: Dict[str, Any],
) -> torch.Tensor:
    """
    ``F.<op>(input, weight, bias, **kwargs)`` where ``weight`` (and ``bias``)
    may have leading batch dims: the batch dims of the weight, of the bias
    and of the input (those left of its feature or channel dim) broadcast, as
    a plate's dims do, and each element of the batch is the layer with its
    own weight. A linear layer is one ``einsum``; a convolution is one grouped
    convolution over the weight's batch.
    """
    nsp = spatial_dims(op)
    w_event = nsp + 2
    if weight.dim() < w_event:
        # e.g. F.linear's 1-d weight: only the bias is batched
        out: torch.Tensor = getattr(F, op)(input, weight, None, **kwargs)
        return out if bias is None else out + bias.reshape(bias.shape + (1,) * nsp)
    x_batch, w_batch = batch_shapes(op, input, weight)
    batch = torch.broadcast_shapes(w_batch, x_batch)  # type: ignore[no-untyped-call]
    # An expanded batch dim (stride 0: e.g. a guide's loc under Predictive) holds one
    # weight: the layer runs once there and its output is expanded.
    weight = weight[tuple(
        slice(0, 1) if stride == 0 and size > 1 else slice(None)
        for size, stride in zip(w_batch, weight.stride())
    )]
    if op == "linear":
        out = torch.einsum("...i,...oi->...o", input, weight)
    else:
        out = _batched_conv(op, nsp, input, weight, kwargs)
    if bias is not None:
        out = out + bias.reshape(bias.shape + (1,) * nsp)
    event = out.shape[out.dim() - nsp - 1:]
    return out.expand(torch.broadcast_shapes(out.shape, batch + event))  # type: ignore[no-untyped-call]


def run_layer(
    op: str,
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    kwargs: Dict[str, Any],
) -> torch.Tensor:
    """``F.<op>(input, weight, bias, **kwargs)``, batched
    (:func:`batched_layer`) where the weight or the bias has batch dims."""
    if is_batched(op, weight, bias):
        return batched_layer(op, input, weight, bias, kwargs)
    out: torch.Tensor = getattr(F, op)(input, weight, bias, **kwargs)
    return out


def _batched_conv(
    op: str, nsp: int, x: torch.Tensor, w: torch.Tensor, kwargs: Dict[str, Any]
) -> torch.Tensor:
    # The weight's batch dims of size > 1 become groups of one grouped convolution; the
    # other batch dims of the broadcast shape fold into the convolution's batch.
    w_batch, w_event = w.shape[: w.dim() - nsp - 2], w.shape[w.dim() - nsp - 2:]
    x_batch, x_event = x.shape[: x.dim() - nsp - 1], x.shape[x.dim() - nsp - 1:]
    batch = torch.broadcast_shapes(w_batch, x_batch)  # type: ignore[no-untyped-call]
    padded = (1,) * (len(batch) - len(w_batch)) + tuple(w_batch)
    g_dims = [i for i, size in enumerate(padded) if size != 1]
    r_dims = [i for i, size in enumerate(padded) if size == 1]
    g = math.prod(batch[i] for i in g_dims)
    r = math.prod(batch[i] for i in r_dims)
    xe = x.expand(batch + x_event).permute(
        r_dims + g_dims + list(range(len(batch), len(batch) + nsp + 1))
    )
    xe = xe.reshape((r, g * x_event[0]) + tuple(x_event[1:]))
    groups = kwargs.get("groups", 1)
    ww = w.reshape((g * w_event[0],) + tuple(w_event[1:]))
    conv_kwargs = dict(kwargs, groups=groups * g)
    out: torch.Tensor = getattr(F, op)(xe, ww, None, **conv_kwargs)
    out_event = (w_event[0],) + tuple(out.shape[2:])
    out = out.reshape([batch[i] for i in r_dims] + [batch[i] for i in g_dims] + list(out_event))
    order = r_dims + g_dims
    inverse = [order.index(i) for i in range(len(batch))]
    # Contiguous, as F.conv*d's own output is: a model's x.view(...) of it must work.
    return out.permute(inverse + list(range(len(batch), len(batch) + nsp + 1))).contiguous()
