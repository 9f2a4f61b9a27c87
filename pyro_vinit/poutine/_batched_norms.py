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

__all__ = ["BatchedNorms"]

#: the dims of a BatchNorm's input without sample dims, by the module's last two letters
_INPUT_DIMS = {"1d": (2, 3), "2d": (4,), "3d": (5,)}


class BatchedNorms:
    """
    While :meth:`watch` has been called and until :meth:`close`, every
    BatchNorm module (all of them, through torch's global module hooks) whose
    input has ``lead`` more leading dims than the module takes runs on that
    input with those dims folded into its rows, and gives its output back
    with them; in train mode, whose batch statistics the samples would share,
    it is refused with a :class:`ValueError`.
    """

    def __init__(self) -> None:
        self.lead = 0
        self._handles: Tuple[RemovableHandle, ...] = ()
        self._folded: Dict[int, torch.Size] = {}

    def watch(self, lead: int) -> None:
        """A batched layer gave an output with ``lead`` leading sample dims."""
        self.lead = max(self.lead, lead)
        if not self._handles and self.lead:
            self._handles = (
                # (torch types a pre-hook as returning None; it may return new arguments)
                nn.modules.module.register_module_forward_pre_hook(self._fold),  # type: ignore[arg-type]
                nn.modules.module.register_module_forward_hook(self._unfold),
            )

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles, self.lead = (), 0
        self._folded.clear()

    def _fold(self, module: nn.Module, args: Tuple[Any, ...]) -> Optional[Tuple[Any, ...]]:
        if not isinstance(module, nn.modules.batchnorm._BatchNorm) or not args:
            return None
        x, lead = args[0], self.lead
        dims = _INPUT_DIMS.get(type(module).__name__[-2:])
        if (dims is None or not isinstance(x, torch.Tensor) or x.dim() - lead not in dims
                or x.shape[lead + 1] != module.num_features):
            return None
        if module.training or module.running_mean is None:
            raise ValueError(
                f"{type(module).__name__} in train mode normalizes with the statistics of "
                f"its batch, which the {tuple(x.shape[:lead])} samples of the batched "
                "layers before it would share: predict in eval mode (model.eval()), or "
                "draw the samples one at a time (Predictive(..., parallel=False))")
        self._folded[id(module)] = x.shape[:lead + 1]
        return (x.reshape((-1,) + x.shape[lead + 1:]),) + args[1:]

    def _unfold(self, module: nn.Module, args: Tuple[Any, ...], out: Any) -> Any:
        rows = self._folded.pop(id(module), None)
        if rows is None:
            return None
        return out.reshape(rows + out.shape[1:])
