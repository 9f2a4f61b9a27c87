"""
Modules that take a fixed number of dims, on the output of a batched layer
call, whose sample dims (those of :class:`~pyro.infer.Predictive` with
``parallel=True``, or of an ELBO's vectorized particles) they would refuse:
``nn.BatchNorm*d`` with those dims folded into its rows (in eval mode, the
running statistics, every sample normalized exactly as one at a time would
be), ``nn.InstanceNorm*d`` and ``nn.GroupNorm`` likewise (each row normalized
on its own), and the pooling layers ``nn.*Pool*d`` with its leading dims
folded into one (each map pooled on its own, as it is).
"""

from typing import Any, Dict, Optional, Tuple

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from pyro_vinit._pyro_compat import active_sample_plate

__all__ = ["BatchedModules"]

_ADVICE = {
    "samples": "predict with the samples one at a time (Predictive(..., parallel=False))",
    "particles": "take the particles one at a time (vectorize_particles=False; fit's "
                 "num_particles=1)",
}

#: the most dims a pooling layer takes: its spatial dims, channels and rows
_POOLING = tuple(
    (getattr(nn, f"{kind}{d}d"), d + 2)
    for kind in ("MaxPool", "AvgPool", "AdaptiveMaxPool", "AdaptiveAvgPool", "LPPool",
                 "FractionalMaxPool")
    for d in (1, 2, 3) if hasattr(nn, f"{kind}{d}d"))


def _pooling_dims(module: nn.Module) -> Optional[int]:
    for kind, dims in _POOLING:
        if isinstance(module, kind):
            return dims
    return None


def _channels(module: nn.Module) -> Optional[int]:
    # the channels of a normalization that takes (rows, channels, ...): BatchNorm
    # (its statistics over the rows), InstanceNorm and GroupNorm (each row's own)
    if isinstance(module, (nn.modules.batchnorm._BatchNorm,
                           nn.modules.instancenorm._InstanceNorm)):
        return int(module.num_features)
    if isinstance(module, nn.GroupNorm):
        return int(module.num_channels)
    return None


class BatchedModules:
    """
    After :meth:`watch` and until :meth:`close`, while the plate of
    Predictive's samples or of vectorized particles is active, every BatchNorm,
    InstanceNorm, GroupNorm or pooling module (through torch's global module
    hooks) whose input leads with the sample dims of the batched layers runs
    on that input with its leading dims folded into one (a normalization's
    into its rows), and gives its output back with them; a BatchNorm that
    normalizes with its batch's statistics (train mode, or no running
    statistics), which the samples would share, is refused with a
    :class:`ValueError`. The test is one of shapes: a BatchNorm1d of data
    ``(N, C, L)`` in the run, with ``N`` the number of samples and ``L = C``,
    is taken for samples.
    """

    def __init__(self) -> None:
        self.samples: Optional[torch.Size] = None
        self._handles: Tuple[RemovableHandle, ...] = ()
        self._folded: Dict[int, torch.Size] = {}
        # module class -> (a normalization over channels, a pooling layer's dims or None)
        self._kinds: Dict[type, Tuple[bool, Optional[int]]] = {}

    def watch(self, out: torch.Tensor, lead: int) -> None:
        """A batched layer gave ``out``, whose ``lead`` leading dims are sample dims
        (a run's first; the later ones take their input's, ``lead`` 0)."""
        if lead <= 0:
            return
        self.samples = out.shape[:lead]
        if not self._handles:
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
        self._handles, self.samples = (), None
        self._folded.clear()

    def _fold(self, module: nn.Module, args: Tuple[Any, ...]) -> Optional[Tuple[Any, ...]]:
        samples = self.samples
        if samples is None or not args:
            return None
        kind = self._kinds.get(type(module))
        if kind is None:  # (once a class: the hooks see every module call)
            norm = _channels(module) is not None
            kind = self._kinds[type(module)] = (norm, None if norm else _pooling_dims(module))
        if not kind[0] and kind[1] is None:
            return None
        x = args[0]
        if not isinstance(x, torch.Tensor):
            return None
        channels, pooling = _channels(module), kind[1]
        lead = len(samples)
        if x.shape[:lead] != samples or x.dim() < lead + 2 or (
                channels is not None and x.shape[lead + 1] != channels):
            return None
        plate = active_sample_plate()
        if plate is None:  # (a run of the model is over: an input of another's)
            return None
        if pooling is not None:
            keep = pooling - 1  # (channels and spatial dims)
        else:
            keep = x.dim() - lead - 1
            if isinstance(module, nn.modules.batchnorm._BatchNorm) and (
                    module.training or module.running_mean is None):
                why = ("in train mode" if module.training
                       else "without running statistics (track_running_stats=False)")
                raise ValueError(
                    f"{type(module).__name__} {why} normalizes with the statistics of its "
                    f"batch, which the {tuple(samples)} {plate} of the batched layers before "
                    f"it would share: {_ADVICE[plate]}"
                    + (", or predict in eval mode (model.eval())" if module.training else ""))
        self._folded[id(module)] = x.shape[:x.dim() - keep]
        return (x.reshape((-1,) + x.shape[x.dim() - keep:]),) + args[1:]

    def _unfold(self, module: nn.Module, args: Tuple[Any, ...], out: Any) -> Any:
        if not self._folded:
            return None
        rows = self._folded.pop(id(module), None)
        if rows is None or out is None:
            return None
        if isinstance(out, tuple):  # (a pooling layer's indices too)
            return tuple(o.reshape(rows + o.shape[1:]) for o in out)
        return out.reshape(rows + out.shape[1:])
