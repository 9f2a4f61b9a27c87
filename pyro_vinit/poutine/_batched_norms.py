"""
``nn.BatchNorm*d`` on the output of a batched layer call: its sample dims
(those of :class:`~pyro.infer.Predictive` with ``parallel=True``, or of an
ELBO's vectorized particles) folded into the rows, which in eval mode (the
running statistics) normalizes every sample exactly as one at a time would.
"""

from typing import Any, Dict, Optional, Tuple

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from pyro_vinit._pyro_compat import active_sample_plate

__all__ = ["BatchedNorms"]

_ADVICE = {
    "samples": "predict with the samples one at a time (Predictive(..., parallel=False))",
    "particles": "take the particles one at a time (vectorize_particles=False; fit's "
                 "num_particles=1)",
}


class BatchedNorms:
    """
    After :meth:`watch` and until :meth:`close`, while the plate of
    Predictive's samples or of vectorized particles is active, every BatchNorm
    module (through torch's global module hooks) whose input leads with the
    sample dims of the batched layers runs on that input with those dims
    folded into its rows, and gives its output back with them; where it
    normalizes with its batch's statistics (train mode, or no running
    statistics), which the samples would share, it is refused with a
    :class:`ValueError`.
    """

    def __init__(self) -> None:
        self.samples: Optional[torch.Size] = None
        self._handles: Tuple[RemovableHandle, ...] = ()
        self._folded: Dict[int, torch.Size] = {}

    def watch(self, out: torch.Tensor, lead: int) -> None:
        """A batched layer gave ``out``, whose ``lead`` leading dims are sample dims."""
        if lead <= 0 or (self.samples is not None and len(self.samples) >= lead):
            return
        self.samples = out.shape[:lead]
        if not self._handles:
            self._handles = (
                # (torch types a pre-hook as returning None; it may return new arguments)
                nn.modules.module.register_module_forward_pre_hook(
                    self._fold),  # type: ignore[arg-type]
                nn.modules.module.register_module_forward_hook(self._unfold),
            )

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles, self.samples = (), None
        self._folded.clear()

    def _fold(self, module: nn.Module, args: Tuple[Any, ...]) -> Optional[Tuple[Any, ...]]:
        if not isinstance(module, nn.modules.batchnorm._BatchNorm) or not args:
            return None
        x, samples = args[0], self.samples
        if samples is None or not isinstance(x, torch.Tensor):
            return None
        lead = len(samples)
        if x.shape[:lead] != samples or x.dim() < lead + 2 or (
                x.shape[lead + 1] != module.num_features):
            return None
        plate = active_sample_plate()
        if plate is None:  # (a run of the model is over: an input of another's)
            return None
        if module.training or module.running_mean is None:
            why = ("in train mode" if module.training
                   else "without running statistics (track_running_stats=False)")
            raise ValueError(
                f"{type(module).__name__} {why} normalizes with the statistics of its "
                f"batch, which the {tuple(samples)} {plate} of the batched layers before it "
                f"would share: {_ADVICE[plate]}"
                + (", or predict in eval mode (model.eval())" if module.training else ""))
        self._folded[id(module)] = x.shape[:lead + 1]
        return (x.reshape((-1,) + x.shape[lead + 1:]),) + args[1:]

    def _unfold(self, module: nn.Module, args: Tuple[Any, ...], out: Any) -> Any:
        rows = self._folded.pop(id(module), None)
        if rows is None:
            return None
        return out.reshape(rows + out.shape[1:])
