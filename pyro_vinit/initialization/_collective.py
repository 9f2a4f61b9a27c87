"""
Where I-BLM's data live: :class:`Collective` is what the pipeline asks of
them (the pool of rows, passes over it, global statistics, how the units'
regressions are shared out), :class:`LocalCollective` its one-process
implementation, in which every collective is the identity. The
process-group implementation is
:class:`~pyro_vinit.initialization._process_group.ProcessGroupCollective`.
"""

from contextlib import ExitStack, nullcontext
from typing import (
    Any,
    Callable,
    ContextManager,
    Dict,
    Iterator,
    List,
    NamedTuple,
    Optional,
    Protocol,
    Tuple,
)

import numpy as np
import torch

from pyro_vinit.initialization._data import Data, DataPool
from pyro_vinit.initialization._options import IBLMOptions
from pyro_vinit.initialization._runs import NormSyncFn
from pyro_vinit.initialization._tracing import Layer, ModelStructure

#: ``(inputs, y, noise_var, idx, lo, hi) -> (means, variances)``: the regressions of
#: units ``lo, ..., hi - 1`` on their minibatches ``idx`` (rows of the tensors)
UnitSolver = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, int],
    Tuple[torch.Tensor, torch.Tensor],
]


class Chunk(NamedTuple):
    """One model run's share of a pass over the pool: the model arguments,
    the block of a subsampled plate (or None), how many of its rows are new
    (0: a run made only to take part in collectives) and the batch-norm
    synchronization the run must use (or None)."""

    args: Tuple[Any, ...]
    plate_rows: Optional[torch.Tensor]
    keep: int
    norm_sync: Optional[NormSyncFn]


class Collective(Protocol):
    """What I-BLM needs to know of where its data live."""

    def open_pool(self, data: Data, options: IBLMOptions, stack: ExitStack) -> DataPool:
        """Reads the data into the pool of rows (and keeps it)."""
        ...

    def check_structure(self, structure: ModelStructure, guide: torch.nn.Module) -> None:
        """Checks the model's structure and the set-up guide's class and parameter
        shapes (the same on every process)."""
        ...

    def agree(self) -> ContextManager[None]:
        """A block of local work whose failure every process must hear of."""
        ...

    def chunks(self, chunk_rows: int, block_size: Optional[int]) -> Iterator[Chunk]:
        """The model runs of one pass over every row of the pool."""
        ...

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum of ``tensor`` over the processes."""
        ...

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """The first process's ``tensor``."""
        ...

    def mean(self, y: torch.Tensor) -> torch.Tensor:
        """The mean of every element of ``y`` (rows along dim 0)."""
        ...

    def std(self, y: torch.Tensor) -> torch.Tensor:
        """The (unbiased) std of every element of ``y``."""
        ...

    def column_std(self, y: torch.Tensor) -> torch.Tensor:
        """The (unbiased) std of every column of ``y`` ``(rows, k)``."""
        ...

    def take(self, local: torch.Tensor, idx: torch.Tensor,
             cols: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``local[idx]`` (or ``local[idx, cols]``) for pool rows ``idx``."""
        ...

    def window(self, scores: torch.Tensor, start: torch.Tensor,
               batch_size: int) -> torch.Tensor:
        """Rows ``(units, batch_size)``: unit :math:`j`'s are those at ranks
        ``start[j], ..., start[j] + batch_size - 1`` of the ascending order of
        ``scores[:, j]``."""
        ...

    def solve_units(self, num_units: int, inputs: torch.Tensor, y: torch.Tensor,
                    noise_var: torch.Tensor, idx: torch.Tensor,
                    solve: UnitSolver) -> Tuple[torch.Tensor, torch.Tensor]:
        """Every unit's regression on its minibatch ``idx[unit]`` of pool rows."""
        ...

    def solve_shared_rows(self, layer: Layer, inputs: torch.Tensor, y: torch.Tensor,
                          noise_var: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor,
                          jitter: float, solve: UnitSolver) -> Tuple[torch.Tensor, torch.Tensor]:
        """Every unit's regression on the same pool rows ``rows``."""
        ...

    def reduce_norm_statistics(self, accumulated: Dict[int, List[Any]]) -> None:
        """Sums batch-norm statistics accumulated over the pool's rows."""
        ...


def argsort_rows(scores: torch.Tensor) -> torch.Tensor:
    """``scores.argsort(-1)`` of a matrix; on the CPU by NumPy's sort, several times
    faster than torch's there (the order of tied scores is unspecified by both)."""
    if scores.device.type != "cpu" or scores.dtype not in (torch.float32, torch.float64):
        return scores.argsort(-1)
    order = np.argsort(scores.detach().contiguous().numpy(), axis=-1)
    return torch.from_numpy(order).to(torch.long)


class LocalCollective:
    """All the data in this process: :class:`Collective` with identities."""

    def __init__(self) -> None:
        self._pool: Optional[DataPool] = None

    @property
    def pool(self) -> DataPool:
        if self._pool is None:
            raise RuntimeError("open_pool must be called first")
        return self._pool

    def open_pool(self, data: Data, options: IBLMOptions, stack: ExitStack) -> DataPool:
        self._pool = DataPool(data, options.max_pool_size)
        return self._pool

    def check_structure(self, structure: ModelStructure, guide: torch.nn.Module) -> None:
        pass

    def agree(self) -> ContextManager[None]:
        return nullcontext()

    def chunks(self, chunk_rows: int, block_size: Optional[int]) -> Iterator[Chunk]:
        for args, rows, keep in self.pool.iterate(chunk_rows, block_size):
            yield Chunk(args, rows, keep, None)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def mean(self, y: torch.Tensor) -> torch.Tensor:
        return y.mean()

    def std(self, y: torch.Tensor) -> torch.Tensor:
        return y.std()

    def column_std(self, y: torch.Tensor) -> torch.Tensor:
        return y.std(0)

    def take(self, local: torch.Tensor, idx: torch.Tensor,
             cols: Optional[torch.Tensor] = None) -> torch.Tensor:
        return local[idx] if cols is None else local[idx, cols]

    def window(self, scores: torch.Tensor, start: torch.Tensor,
               batch_size: int) -> torch.Tensor:
        order = argsort_rows(scores.T)  # (units, n)
        rows = start[:, None] + torch.arange(batch_size, device=scores.device)  # (units, batch)
        return order.gather(1, rows)

    def solve_units(self, num_units: int, inputs: torch.Tensor, y: torch.Tensor,
                    noise_var: torch.Tensor, idx: torch.Tensor,
                    solve: UnitSolver) -> Tuple[torch.Tensor, torch.Tensor]:
        return solve(inputs, y, noise_var, idx, 0, num_units)

    def solve_shared_rows(self, layer: Layer, inputs: torch.Tensor, y: torch.Tensor,
                          noise_var: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor,
                          jitter: float, solve: UnitSolver) -> Tuple[torch.Tensor, torch.Tensor]:
        idx = rows.expand(layer.num_units, len(rows))
        return solve(inputs, y, noise_var, idx, 0, layer.num_units)

    def reduce_norm_statistics(self, accumulated: Dict[int, List[Any]]) -> None:
        pass
