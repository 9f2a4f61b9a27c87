"""
Calls that take a fixed number of dims, on the output of a batched layer
call, whose sample dims (those of :class:`~pyro.infer.Predictive` with
``parallel=True``, or of an ELBO's vectorized particles) they would refuse or
misread: pooling and unpooling (``F.*pool*d``, modules or functions), channel
dropout (``F.dropout1d/2d/3d``, ``F.feature_alpha_dropout``), convolutions
with a plain weight and bias, ``F.pad`` other than constant,
``F.interpolate`` (``nn.Upsample``), ``F.grid_sample``, ``F.unfold``,
``F.fold``, ``F.channel_shuffle``, ``nn.Softmax2d`` and the normalizations
``F.batch_norm`` (in eval mode, the running statistics), ``F.instance_norm``,
``F.group_norm`` and ``F.local_response_norm``. Each runs on its input with
the leading dims folded into one (a normalization's into its rows), every
sample computed exactly as one at a time would be, and gives its output back
with them. Only tensors computed from a batched layer's output are folded.
"""

import functools
import weakref
from functools import partial
from typing import Any, Callable, Dict, Iterable, Optional, Set, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode, _pop_mode, _push_mode
from torch.utils.hooks import RemovableHandle

from pyro_vinit._pyro_compat import active_sample_plate
from pyro_vinit.poutine._layer_ops import op_name
from pyro_vinit.poutine._left_dims import first_dim, left_dims, takes_dims
from pyro_vinit.poutine._site_value import eager, from_the_model

__all__ = ["BatchedModules"]

_ADVICE = {
    "samples": "predict with the samples one at a time (Predictive(..., parallel=False))",
    "particles": "take the particles one at a time (vectorize_particles=False; fit's "
                 "num_particles=1)",
}

#: a rule: (input, number of sample dims, args, kwargs) -> the trailing dims the call
#: keeps (its channels and spatial dims), or None to leave the call alone
_Rule = Callable[[torch.Tensor, int, Tuple[Any, ...], Dict[str, Any]], Optional[int]]


def _argument(args: Tuple[Any, ...], kwargs: Dict[str, Any], index: int, name: str) -> Any:
    return args[index] if len(args) > index else kwargs.get(name)


def _fixed(dims: int, x: torch.Tensor, lead: int, args: Tuple[Any, ...],
           kwargs: Dict[str, Any]) -> Optional[int]:
    # (rows, channels, ``dims`` spatial dims): pooling, channel dropout, unfold
    return dims + 1


def _conv(dims: int, x: torch.Tensor, lead: int, args: Tuple[Any, ...],
          kwargs: Dict[str, Any]) -> Optional[int]:
    # a convolution with a plain weight and bias (a sample site's value is a layer call)
    plain = all(t is None or type(t) in (torch.Tensor, nn.Parameter) for t in (
        _argument(args, kwargs, 1, "weight"), _argument(args, kwargs, 2, "bias")))
    return dims + 1 if plain else None


def _model(x: torch.Tensor, lead: int, args: Tuple[Any, ...],
           kwargs: Dict[str, Any]) -> Optional[int]:
    # the model's own (rows, channels, ...) past the sample dims
    return x.dim() - lead - 1 if x.dim() >= lead + 2 else None


def _pad(x: torch.Tensor, lead: int, args: Tuple[Any, ...],
         kwargs: Dict[str, Any]) -> Optional[int]:
    # (a constant pad takes any dims; the others (rows, channels, padded dims))
    if _argument(args, kwargs, 2, "mode") in (None, "constant"):
        return None
    return len(_argument(args, kwargs, 1, "pad")) // 2 + 1


@functools.cache  # (built on first use; the rules' code runs at each call)
def _rules() -> Dict[Callable[..., Any], _Rule]:
    rules: Dict[Callable[..., Any], _Rule] = {}
    for d in (1, 2, 3):
        for stem in ("max_pool", "avg_pool", "adaptive_max_pool", "adaptive_avg_pool",
                     "lp_pool", "fractional_max_pool", "dropout", "max_unpool"):
            for name in (f"{stem}{d}d", f"_{stem}{d}d", f"{stem}{d}d_with_indices"):
                for space in (F, torch):
                    if callable(getattr(space, name, None)):
                        rules[getattr(space, name)] = partial(_fixed, d)
        for stem in ("conv", "conv_transpose"):
            rules[getattr(torch, f"{stem}{d}d")] = partial(_conv, d)
    rules.update({
        F.unfold: partial(_fixed, 2), F.fold: partial(_fixed, 1), F.pad: _pad,
    })
    for f in (F.interpolate, F.batch_norm, F.instance_norm, F.group_norm,
              F.local_response_norm, F.channel_shuffle, F.feature_alpha_dropout,
              F.grid_sample):
        rules[f] = _model
    return rules


#: the reshapes, after which a tensor leads with the sample dims only where it kept them
#: in front (BatchedModules.leads_after)
_RESHAPES = {torch.Tensor.reshape, torch.reshape, torch.Tensor.view, torch.Tensor.flatten,
             torch.flatten, torch.Tensor.unflatten, torch.unflatten, torch.Tensor.view_as,
             torch.Tensor.reshape_as}
#: the flattens and unflattens, by the name of the first dim they take
_FLATTENS: Dict[Callable[..., Any], str] = {
    torch.Tensor.flatten: "start_dim", torch.flatten: "start_dim",
    torch.Tensor.unflatten: "dim", torch.unflatten: "dim"}


def _flattened(func: Callable[..., Any], args: Tuple[Any, ...], kwargs: Dict[str, Any],
               dims: int) -> Optional[int]:
    # the first dim that a flatten or unflatten of a tensor of ``dims`` dims takes
    name = _FLATTENS.get(func)
    return None if name is None else int(_argument(args, kwargs, 1, name) or 0) % dims


def _minus_one_first(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> bool:
    # whether a reshape's shape starts with -1 (all the leading dims into one)
    shape = args[1:] if len(args) > 1 else (kwargs.get("shape") or kwargs.get("size"),)
    if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
        shape = tuple(shape[0])
    return bool(shape) and isinstance(shape[0], int) and shape[0] == -1


def _folds(func: Callable[..., Any], args: Tuple[Any, ...], kwargs: Dict[str, Any],
           dims: int, lead: int) -> bool:
    # whether a reshape of a tensor that leads with ``lead`` sample dims takes them into
    # another dim (a shape of -1 first: also where its sizes are kept by chance, one row)
    first = _flattened(func, args, kwargs, dims)
    return first < lead if first is not None else _minus_one_first(args, kwargs)


def _unfolds(func: Callable[..., Any], args: Tuple[Any, ...], kwargs: Dict[str, Any],
             dims: int) -> bool:
    # whether a reshape of a tensor whose first dim holds the sample dims may split it
    # again: a shape of sizes, another tensor's, or an unflatten of that dim
    first = _flattened(func, args, kwargs, dims)
    if first is not None:
        return first == 0 and func in (torch.Tensor.unflatten, torch.unflatten)
    return not _minus_one_first(args, kwargs)


#: the wording of the refusals of a fold: what it is, and what to write instead
FOLD = "a fold, as x.reshape(-1, T, H) around an LSTM, or x.view(-1, features)"
UNFOLD = "Unfold first (x.reshape(*lead, T, H), lead the dims before the fold)"
#: modules that apply a function over their ``dim``
_DIM_MODULES: Dict[type, Callable[..., Any]] = {
    nn.Softmax: F.softmax, nn.LogSoftmax: F.log_softmax, nn.Softmin: F.softmin,
    nn.GLU: F.glu, nn.Unflatten: torch.unflatten}


def _module_keep(module: nn.Module, x: torch.Tensor, lead: int) -> Optional[int]:
    # modules that check their input's dims before calling their function
    if isinstance(module, (nn.modules.batchnorm._BatchNorm,
                           nn.modules.instancenorm._InstanceNorm)):
        return _model(x, lead, (), {})
    return 3 if isinstance(module, nn.Softmax2d) else None


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
        f"{_ADVICE[plate]}"
        + (", or predict in eval mode (model.eval()); the runs Predictive made before this "
           "one, one sample at a time in train mode, have updated its running statistics: "
           "restore them (e.g. load the model's state_dict again) before predicting"
           if training and plate == "samples" else ""))


def _tensors(items: Iterable[Any]) -> Iterable[torch.Tensor]:
    for item in items:
        if isinstance(item, torch.Tensor):
            yield item
        elif isinstance(item, (tuple, list)):
            yield from (t for t in item if isinstance(t, torch.Tensor))


def _unfolded(out: Any, rows: torch.Size) -> Any:
    if isinstance(out, tuple):  # (a pooling layer's indices too)
        return tuple(o.reshape(rows + o.shape[1:]) for o in out)
    return out.reshape(rows + out.shape[1:])


class _Folding(TorchFunctionMode):
    def __init__(self, owner: "BatchedModules") -> None:
        super().__init__()
        self.owner = owner

    @eager  # (torch.compile runs it as Python: the folds depend on Pyro's stack)
    def __torch_function__(self, func: Callable[..., Any], types: Any,
                           args: Tuple[Any, ...] = (),
                           kwargs: Optional[Dict[str, Any]] = None) -> Any:
        kwargs = kwargs or {}
        owner = self.owner
        rule = _rules().get(func)
        if owner.samples is not None and takes_dims(func):
            owner.check_dims(func, args, kwargs)
        out = (owner.call(func, rule, args, kwargs) if rule is not None
               else func(*args, **kwargs))
        if owner.carries(args) or (kwargs and owner.carries(kwargs.values())):
            owner.mark(out, owner.leads_after(func, args, kwargs, out))
        return out


class BatchedModules:
    """
    After :meth:`watch` and until :meth:`close`, while the plate of
    Predictive's samples or of vectorized particles is active, each call of
    the module docstring (seen by a torch function mode) whose input was
    computed from a batched layer's output (the mode follows every torch call)
    and leads with its sample dims, with more dims than the call takes, runs
    on that input with its leading dims folded into one, and gives its output
    back with them; so does every other argument computed from one, with the
    same leading dims (else the call is left alone). ``nn.BatchNorm*d``,
    ``nn.InstanceNorm*d`` and ``nn.Softmax2d``, which check their input's
    dims before calling their function, fold it through torch's global module
    hooks. A BatchNorm that normalizes with its batch's statistics (train
    mode, or no running statistics), which the samples would share, is
    refused with a :class:`ValueError`.
    """

    def __init__(self) -> None:
        self.samples: Optional[torch.Size] = None
        self._handles: Tuple[RemovableHandle, ...] = ()
        self._mode: Optional[_Folding] = None
        self._folded: Dict[int, torch.Size] = {}
        # id -> each tensor computed from a batched layer's output, while it lives
        self._marked: weakref.WeakValueDictionary[int, torch.Tensor] = (
            weakref.WeakValueDictionary())
        # ids of the marked tensors that do not lead with the sample dims (merged into
        # another dim by a reshape)
        self._merged: Set[int] = set()

    def watch(self, out: torch.Tensor, lead: int) -> None:
        """A batched layer gave ``out``, whose ``lead`` leading dims are sample dims
        (a run's first; the later ones take their input's, ``lead`` 0)."""
        self.mark(out)
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
        self._marked.clear()
        self._merged.clear()

    def mark(self, out: Any, leads: bool = True) -> None:
        """Marks the tensors of ``out`` as computed from a batched layer's output, and
        whether they may lead with the sample dims."""
        for t in _tensors((out,)):
            self._marked[id(t)] = t
            if leads:
                self._merged.discard(id(t))
            else:
                self._merged.add(id(t))

    def leads_after(self, func: Callable[..., Any], args: Tuple[Any, ...],
                    kwargs: Dict[str, Any], out: Any) -> bool:
        """Whether ``out = func(*args, **kwargs)``, computed from a batched layer's output,
        may lead with the sample dims: where none of its marked inputs was merged, and after
        a reshape only where the sample dims stay in front: not after a fold into (samples *
        batch, time, features) as around an LSTM (also where the batch is one), until an
        unfold puts them back."""
        marked, merged = self._marked, self._merged
        ins = [t for t in _tensors((*args, *kwargs.values())) if marked.get(id(t)) is t]
        if func not in _RESHAPES or not ins or not isinstance(out, torch.Tensor):
            return not any(id(t) in merged for t in ins)
        x, samples = ins[0], self.samples or torch.Size()
        if out.shape[:len(samples)] != samples:
            return False
        if id(x) not in merged:
            return not _folds(func, args, kwargs, x.dim(), len(samples))
        return _unfolds(func, args, kwargs, x.dim()) and (
            out.dim() > x.dim() or out.shape[0] != x.shape[0])

    def merged(self, x: Any) -> bool:
        """Whether ``x`` was computed from a batched layer's output whose sample dims a
        reshape merged into its rows (a fold, as around an LSTM)."""
        return (isinstance(x, torch.Tensor) and id(x) in self._merged
                and self.carries((x,)))

    def carries(self, items: Iterable[Any]) -> bool:
        """Whether a tensor of ``items`` was computed from a batched layer's output."""
        marked = self._marked
        return any(marked.get(id(t)) is t for t in _tensors(items))

    def _rows(self, x: torch.Tensor, keep: Optional[int]) -> Optional[torch.Size]:
        # the leading dims of ``x`` to fold, or None where the call is left alone
        if keep is None or x.dim() <= keep + 1 or self._samples_of(x) is None:
            return None
        return x.shape[:x.dim() - keep]

    def _lead(self, x: Any) -> Optional[int]:
        # the sample dims that ``x``, computed from a batched layer's output, leads with
        # (in a run of the model, not in a folded module's): all of them, or the first
        # where the model broadcast the plates' singletons after it; else None
        samples = self.samples
        if (samples is None or self._folded or not isinstance(x, torch.Tensor)
                or id(x) in self._merged or not self.carries((x,))):
            return None
        if x.shape[:len(samples)] == samples:
            return len(samples)
        if x.shape[:1] == samples[:1] and all(size == 1 for size in samples[1:]):
            return 1
        return None

    def _samples_of(self, x: Any) -> Optional[str]:
        # the plate of the samples or particles where ``x`` leads with their dims, else None
        return active_sample_plate() if self._lead(x) is not None else None

    def check_dims(self, func: Callable[..., Any], args: Tuple[Any, ...],
                   kwargs: Dict[str, Any], name: Optional[str] = None) -> None:
        """Refuses the model's dims counted from the left, within its own dims, of a
        tensor that leads with the sample dims (``F.log_softmax(x, dim=1)``,
        ``x.mean((2, 3))``, ``torch.cat(xs, dim=1)``), and the first dim of a tensor
        into whose rows a reshape merged them.

        :param str name: The module whose dim it is, if any: its call is the model's
            wherever it comes from.
        """
        op = name or op_name(func)
        first = first_dim(func, args, kwargs)
        plate = active_sample_plate()
        if first is not None and self.merged(first.input) and plate and (
                name is not None or from_the_model(__name__)):
            raise ValueError(
                f"{op}({first.name}={first.given}) of a tensor of shape "
                f"{tuple(first.input.shape)} into whose first dim a reshape merged the "
                f"{tuple(self.samples or ())} {plate} dims of a batched layer's output "
                f"({FOLD}): over that dim it mixes them. {UNFOLD} and count the dim from "
                "the right")
        found = left_dims(func, args, kwargs, self._lead)
        lead = self._lead(found.input) if found is not None else None
        if found is None or lead is None or not plate or (
                name is None and not from_the_model(__name__)):
            return
        raise ValueError(
            f"{op}({found.name}={found.given}) of a tensor of shape "
            f"{tuple(found.input.shape)} computed from a batched layer's output, which leads "
            f"with the {tuple(found.input.shape[:lead])} {plate} dims: a dim counted from "
            f"the left lands on them. Count dims from the right, as models run with "
            f"vectorized samples must: {found.name}={found.own}")

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
        others = [t for t in _tensors((*args[1:], *kwargs.values()))
                  if t is not x and self.carries((t,))]
        if any(t.shape[:len(rows)] != rows for t in others):
            return func(*args, **kwargs)
        if func is F.batch_norm:
            _refuse_batch_statistics(
                "F.batch_norm", bool(_argument(args, kwargs, 5, "training")),
                _argument(args, kwargs, 1, "running_mean"), samples,
                str(active_sample_plate()))

        def fold(a: Any) -> Any:
            if a is x or any(a is t for t in others):
                return a.reshape((-1,) + a.shape[len(rows):])
            return a

        self._folded[id(self)] = rows  # (while it runs folded: its reshapes are the fold's)
        try:
            args = tuple(fold(a) for a in args)
            kwargs = {k: fold(v) for k, v in kwargs.items()}
            return _unfolded(func(*args, **kwargs), rows)
        finally:
            del self._folded[id(self)]

    def _fold(self, module: nn.Module, args: Tuple[Any, ...]) -> Optional[Tuple[Any, ...]]:
        if not args or self.samples is None or not isinstance(args[0], torch.Tensor):
            return None
        x = args[0]
        for kind in type(module).__mro__:  # (its dim is its maker's, wherever it runs)
            if kind in _DIM_MODULES:
                self.check_dims(_DIM_MODULES[kind], (x, getattr(module, "dim", None)), {},
                                f"nn.{kind.__name__}")
                break
        rows = self._rows(x, _module_keep(module, x, len(self.samples)))
        if rows is None:
            return None
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            _refuse_batch_statistics(type(module).__name__, module.training,
                                     module.running_mean, self.samples,
                                     str(active_sample_plate()))
        self._folded[id(module)] = rows  # (its reshapes are the fold's: not checked)
        return (x.reshape((-1,) + x.shape[len(rows):]),) + args[1:]

    def _unfold(self, module: nn.Module, args: Tuple[Any, ...], out: Any) -> Any:
        if not self._folded:
            return None
        rows = self._folded.get(id(module))
        if rows is None or out is None:
            self._folded.pop(id(module), None)
            return None
        out = _unfolded(out, rows)
        del self._folded[id(module)]
        self.mark(out)
        return out
