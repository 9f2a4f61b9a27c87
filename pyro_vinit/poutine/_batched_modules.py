"""
Calls that take a fixed number of dims, on the output of a batched layer
call, whose sample dims (those of :class:`~pyro.infer.Predictive` with
``parallel=True``, or of an ELBO's vectorized particles) they would refuse or
misread: pooling (``F.*pool*d``, modules or functions), channel dropout
(``F.dropout1d/2d/3d``), convolutions with a plain weight, ``F.interpolate``
(``nn.Upsample``), and the normalizations ``F.batch_norm`` (in eval mode, the
running statistics), ``F.instance_norm``, ``F.group_norm`` and
``F.local_response_norm``. Each runs on its input with the leading dims folded
into one (a normalization's into its rows), every sample computed exactly as
one at a time would be, and gives its output back with them.
"""

from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode, _pop_mode, _push_mode
from torch.utils.hooks import RemovableHandle

from pyro_vinit._pyro_compat import active_sample_plate

__all__ = ["BatchedModules"]

_ADVICE = {
    "samples": "predict with the samples one at a time (Predictive(..., parallel=False))",
    "particles": "take the particles one at a time (vectorize_particles=False; fit's "
                 "num_particles=1)",
}

#: a rule: (input, number of sample dims, args, kwargs) -> the trailing dims the call
#: keeps (its channels and spatial dims), or None to leave the call alone
_Rule = Callable[[torch.Tensor, int, Tuple[Any, ...], Dict[str, Any]], Optional[int]]


def _fixed(dims: int) -> _Rule:
    # pooling and channel dropout over ``dims`` spatial dims: (rows, channels, spatial)
    return lambda x, lead, args, kwargs: dims + 1


def _conv(dims: int) -> _Rule:
    # a convolution with a plain weight (one with a sample site's value is a layer call)
    def rule(x: torch.Tensor, lead: int, args: Tuple[Any, ...],
             kwargs: Dict[str, Any]) -> Optional[int]:
        weight = args[1] if len(args) > 1 else kwargs.get("weight")
        return dims + 1 if type(weight) in (torch.Tensor, nn.Parameter) else None
    return rule


def _channels_of(*tensors: Any) -> Optional[int]:
    for t in tensors:
        if isinstance(t, torch.Tensor):
            return t.numel()
    return None


def _argument(args: Tuple[Any, ...], kwargs: Dict[str, Any], index: int, name: str) -> Any:
    return args[index] if len(args) > index else kwargs.get(name)


def _norm_keep(x: torch.Tensor, lead: int, channels: Optional[int]) -> Optional[int]:
    # (rows, channels, ...) normalized over the channels' statistics or each row on its
    # own: the model's tensor is the input past its sample dims
    if x.dim() < lead + 2 or channels not in (None, x.shape[lead + 1]):
        return None
    return x.dim() - lead - 1


def _norm(*names: Tuple[int, str]) -> _Rule:
    # (the arguments, by position and name, whose size is the number of channels)
    return lambda x, lead, args, kwargs: _norm_keep(
        x, lead, _channels_of(*(_argument(args, kwargs, i, n) for i, n in names)))


def _interpolate(x: torch.Tensor, lead: int, args: Tuple[Any, ...],
                 kwargs: Dict[str, Any]) -> Optional[int]:
    for index, name in ((1, "size"), (2, "scale_factor")):
        given = _argument(args, kwargs, index, name)
        if isinstance(given, Sequence):
            return len(given) + 1
    return x.dim() - lead - 1 if x.dim() >= lead + 3 else None


def _rules() -> Dict[Callable[..., Any], _Rule]:
    rules: Dict[Callable[..., Any], _Rule] = {}
    for d in (1, 2, 3):
        for stem in ("max_pool", "avg_pool", "adaptive_max_pool", "adaptive_avg_pool",
                     "lp_pool", "fractional_max_pool", "dropout"):
            for name in (f"{stem}{d}d", f"_{stem}{d}d", f"{stem}{d}d_with_indices"):
                for space in (F, torch):
                    if callable(getattr(space, name, None)):
                        rules[getattr(space, name)] = _fixed(d)
        for stem in ("conv", "conv_transpose"):
            rules[getattr(torch, f"{stem}{d}d")] = _conv(d)
    rules[F.interpolate] = _interpolate
    rules[F.batch_norm] = _norm((1, "running_mean"), (3, "weight"))
    rules[F.instance_norm] = _norm((1, "running_mean"), (3, "weight"))
    rules[F.group_norm] = _norm((2, "weight"))
    rules[F.local_response_norm] = _norm()
    return rules


_RULES = _rules()


def _refuse_batch_statistics(name: str, training: bool, running: Optional[torch.Tensor],
                             samples: torch.Size, plate: str) -> None:
    # a BatchNorm that normalizes with its batch's statistics, which the samples share
    if not training and running is not None:
        return
    why = ("in train mode" if training
           else "without running statistics (track_running_stats=False)")
    raise ValueError(
        f"{name} {why} normalizes with the statistics of its batch, which the "
        f"{tuple(samples)} {plate} of the batched layers before it would share: "
        f"{_ADVICE[plate]}" + (", or predict in eval mode (model.eval())" if training else ""))


def _unfolded(out: Any, rows: torch.Size) -> Any:
    if isinstance(out, tuple):  # (a pooling layer's indices too)
        return tuple(o.reshape(rows + o.shape[1:]) for o in out)
    return out.reshape(rows + out.shape[1:])


class _Folding(TorchFunctionMode):
    def __init__(self, owner: "BatchedModules") -> None:
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func: Callable[..., Any], types: Any,
                           args: Tuple[Any, ...] = (),
                           kwargs: Optional[Dict[str, Any]] = None) -> Any:
        kwargs = kwargs or {}
        rule = _RULES.get(func)
        if rule is not None:
            return self.owner.call(func, rule, args, kwargs)
        return func(*args, **kwargs)


class BatchedModules:
    """
    After :meth:`watch` and until :meth:`close`, while the plate of
    Predictive's samples or of vectorized particles is active, each call of
    the module docstring (through a torch function mode) whose input leads
    with the sample dims of the batched layers, with more dims than the call
    takes, runs on that input with its leading dims folded into one, and gives
    its output back with them. ``nn.BatchNorm*d`` and ``nn.InstanceNorm*d``,
    which check their input's dims before calling their function, fold it
    through torch's global module hooks. A BatchNorm that normalizes with its
    batch's statistics (train mode, or no running statistics), which the
    samples would share, is refused with a :class:`ValueError`. The test is
    one of shapes: a BatchNorm1d of data ``(N, C, L)`` in the run, with ``N``
    the number of samples and ``L = C``, is taken for samples.
    """

    def __init__(self) -> None:
        self.samples: Optional[torch.Size] = None
        self._handles: Tuple[RemovableHandle, ...] = ()
        self._mode: Optional[_Folding] = None
        self._folded: Dict[int, torch.Size] = {}

    def watch(self, out: torch.Tensor, lead: int) -> None:
        """A batched layer gave ``out``, whose ``lead`` leading dims are sample dims
        (a run's first; the later ones take their input's, ``lead`` 0)."""
        if lead <= 0:
            return
        self.samples = out.shape[:lead]
        if self._mode is None:
            self._mode = _Folding(self)
            _push_mode(self._mode)  # type: ignore[no-untyped-call]
            self._handles = (
                # (torch types a pre-hook as returning None; it may return new arguments)
                nn.modules.module.register_module_forward_pre_hook(
                    self._fold),  # type: ignore[arg-type]
                # (always: a forward that fails leaves no folded shape behind)
                nn.modules.module.register_module_forward_hook(self._unfold,
                                                               always_call=True),
            )

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        if self._mode is not None:
            # (modes pushed since, still active, go back on top of the stack)
            above = []
            while True:
                mode = _pop_mode()  # type: ignore[no-untyped-call]
                if mode is self._mode:
                    break
                above.append(mode)
            for mode in reversed(above):
                _push_mode(mode)  # type: ignore[no-untyped-call]
        self._handles, self._mode, self.samples = (), None, None
        self._folded.clear()

    def _rows(self, x: Any, keep: Optional[int]) -> Optional[torch.Size]:
        # the leading dims of ``x`` to fold, or None where the call is left alone
        samples = self.samples
        if samples is None or keep is None or self._folded:  # (in a folded module)
            return None
        if not isinstance(x, torch.Tensor) or x.dim() <= keep + 1:
            return None
        if x.shape[:len(samples)] != samples or active_sample_plate() is None:
            return None
        return x.shape[:x.dim() - keep]

    def call(self, func: Callable[..., Any], rule: _Rule, args: Tuple[Any, ...],
             kwargs: Dict[str, Any]) -> Any:
        """Runs ``func`` (of the module docstring) with its input's leading dims folded
        where ``rule`` says so."""
        x, samples = args[0] if args else kwargs.get("input"), self.samples
        if not isinstance(x, torch.Tensor) or samples is None:
            return func(*args, **kwargs)
        rows = self._rows(x, rule(x, len(samples), args, kwargs))
        if rows is None:
            return func(*args, **kwargs)
        if func is F.batch_norm:
            _refuse_batch_statistics(
                "F.batch_norm", bool(_argument(args, kwargs, 5, "training")),
                _argument(args, kwargs, 1, "running_mean"), samples,
                str(active_sample_plate()))
        folded = x.reshape((-1,) + x.shape[len(rows):])
        if args:
            args = (folded,) + args[1:]
        else:
            kwargs = dict(kwargs, input=folded)
        return _unfolded(func(*args, **kwargs), rows)

    def _fold(self, module: nn.Module, args: Tuple[Any, ...]) -> Optional[Tuple[Any, ...]]:
        if not isinstance(module, (nn.modules.batchnorm._BatchNorm,
                                   nn.modules.instancenorm._InstanceNorm)):
            return None
        if not args or self.samples is None:
            return None
        x = args[0]
        if not isinstance(x, torch.Tensor):
            return None
        rows = self._rows(x, _norm_keep(x, len(self.samples), int(module.num_features)))
        if rows is None:
            return None
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            _refuse_batch_statistics(type(module).__name__, module.training,
                                     module.running_mean, self.samples,
                                     str(active_sample_plate()))
        self._folded[id(module)] = rows
        return (x.reshape((-1,) + x.shape[len(rows):]),) + args[1:]

    def _unfold(self, module: nn.Module, args: Tuple[Any, ...], out: Any) -> Any:
        if not self._folded:
            return None
        rows = self._folded.pop(id(module), None)
        if rows is None or out is None:
            return None
        return _unfolded(out, rows)
