"""
I-BLM over the ranks of a :mod:`torch.distributed` process group:
:class:`ProcessGroupCollective`, the :class:`~pyro_vinit.initialization._collective.Collective`
whose pool is sharded over the ranks (see :mod:`~pyro_vinit.initialization._distributed`),
so that every rank computes what one process computes on the concatenated
shards.
"""

import warnings
from contextlib import ExitStack
from typing import Any, ContextManager, Dict, Iterator, List, Optional, Tuple

import torch

from pyro_vinit.initialization._collective import Chunk, Collective, LocalCollective, UnitSolver
from pyro_vinit.initialization._data import Data, DataPool, is_args_tuple
from pyro_vinit.initialization._distributed import (
    NormSync,
    ShardedPool,
    Shards,
    all_gather_units,
    data_signature,
    gather_batches,
    local_window,
    unit_share,
)
from pyro_vinit.initialization._options import IBLMOptions
from pyro_vinit.initialization._regressions import (
    shared_rows_statistics,
    solve_statistics,
    unit_inputs,
    unit_priors,
)
from pyro_vinit.initialization._tracing import Layer, ModelStructure


def check_process_group(process_group: Optional[Any]) -> None:
    """Raises, saying why, unless ``process_group`` is None or a group of this process."""
    if Shards.size_of(process_group) == 0:
        Shards(process_group)  # raises the reason


def collective_for(process_group: Optional[Any]) -> Collective:
    """The collective of ``process_group``: local for None or a group of one rank."""
    if Shards.size_of(process_group) > 1:
        return ProcessGroupCollective(Shards(process_group))
    return LocalCollective()


class ProcessGroupCollective:
    """
    The data sharded over the ranks of a process group: every rank calls
    I-BLM with the same options and its own shard, and every global quantity
    (row indices, minibatches, regression statistics, noise and normalization
    statistics) is combined with a few collective calls, so that every rank
    computes what one process computes on the concatenated shards.

    :param Shards shards: The ranks of the process group.
    """

    def __init__(self, shards: Shards) -> None:
        self.shards = shards
        self._pool: Optional[ShardedPool] = None
        self._norm_sync = NormSync(shards)
        self._sync_norms = False

    @property
    def pool(self) -> ShardedPool:
        if self._pool is None:
            raise RuntimeError("open_pool must be called first")
        return self._pool

    def open_pool(self, data: Data, options: IBLMOptions, stack: ExitStack) -> DataPool:
        """The ranks check that they agree (data layout, options), enter rank 0's
        random state (in ``stack``), and draw the pool in the global row space."""
        shards = self.shards
        with shards.agree():
            local = DataPool(data, None if is_args_tuple(data) else options.max_pool_size)
        reports = shards.gather_objects(
            (local.num_rows, data_signature(local), repr(options)))
        fix = ("call init_guide_iblm with the same options and a shard of the same data on "
               "every rank")
        for rank, (_, layout, opts) in enumerate(reports):
            for what, mine, first in (("their data arguments (per argument: trailing shape "
                                       "and dtype of the rows)", layout, reports[0][1]),
                                      ("their options", opts, reports[0][2])):
                if mine != first:
                    raise ValueError(
                        f"init_guide_iblm with a process_group: the ranks differ in {what}: "
                        f"rank 0 has {first}, rank {rank} has {mine}; {fix}"
                    )
        pool = ShardedPool(shards, local, [r[0] for r in reports])
        stack.enter_context(shards.shared_rng(local.device))
        pool.finish(options.max_pool_size)
        self._pool = pool
        return pool

    def check_structure(self, structure: ModelStructure, guide: torch.nn.Module) -> None:
        self.shards.check_equal("the model's structure", structure_signature(structure),
                                "every rank must run the same model and guide")
        shapes = {name: tuple(value.shape) for name, value in guide.state_dict().items()}
        self.shards.check_equal("their guides (class and parameter shapes)",
                                (type(guide).__name__, shapes),
                                "every rank must build the same guide (its class and options, "
                                "e.g. AutoKTiedNormal's rank)")
        if structure.batch_norm:
            if structure.block_size is None:
                self._sync_norms = True
            else:
                warn_not_exact(
                    "the model has batch normalization and a subsampled data plate: each "
                    "rank normalizes its own blocks while fitting")

    def agree(self) -> ContextManager[None]:
        return self.shards.agree()

    def chunks(self, chunk_rows: int, block_size: Optional[int]) -> Iterator[Chunk]:
        """As :meth:`LocalCollective.chunks` over this rank's rows; for a model
        with batch normalization, in the chunks of the global pool (every rank
        runs the model once per global chunk, on its rows of it, or on one row
        with ``keep = 0`` when it has none) with a :class:`NormSync`, so that
        batch normalization sees the statistics one process would."""
        pool = self.pool
        if not self._sync_norms:
            for args, rows, keep in pool.iterate(chunk_rows, block_size):
                yield Chunk(args, rows, keep, None)
            return
        mine = torch.cat([pool.owner.new_zeros(1), (pool.owner == self.shards.rank).cumsum(0)])
        for start in range(0, pool.num_rows, chunk_rows):
            lo, hi = int(mine[start]), int(mine[min(start + chunk_rows, pool.num_rows)])
            has_rows = hi > lo
            args = pool.select(slice(lo, hi) if has_rows else slice(0, 1))
            self._norm_sync.weight = 1.0 if has_rows else 0.0
            yield Chunk(args, None, hi - lo, self._norm_sync)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.shards.all_reduce(tensor)

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.shards.broadcast(tensor)

    def mean(self, y: torch.Tensor) -> torch.Tensor:
        return self.pool.mean(y)

    def std(self, y: torch.Tensor) -> torch.Tensor:
        return self.pool.std(y)

    def column_std(self, y: torch.Tensor) -> torch.Tensor:
        return self.pool.column_std(y)

    def take(self, local: torch.Tensor, idx: torch.Tensor,
             cols: Optional[torch.Tensor] = None) -> torch.Tensor:
        return self.pool.at(local, idx, cols)

    def window(self, scores: torch.Tensor, start: torch.Tensor,
               batch_size: int) -> torch.Tensor:
        return local_window(self.pool, scores, start, batch_size)

    def solve_units(self, num_units: int, inputs: torch.Tensor, y: torch.Tensor,
                    noise_var: torch.Tensor, idx: torch.Tensor,
                    solve: UnitSolver) -> Tuple[torch.Tensor, torch.Tensor]:
        """The selected rows from their ranks; each rank solves a share of the
        units, and the shares are all-gathered."""
        shards = self.shards
        (inputs, y, noise_var), idx = gather_batches(
            self.pool, (inputs, y, noise_var), idx)
        lo, hi = unit_share(shards, num_units)
        with shards.agree():
            means, variances = solve(inputs, y, noise_var, idx, lo, hi)
        means, variances = all_gather_units(shards, num_units, means, variances)
        return means, variances

    def solve_shared_rows(self, layer: Layer, inputs: torch.Tensor, y: torch.Tensor,
                          noise_var: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor,
                          jitter: float, solve: UnitSolver) -> Tuple[torch.Tensor, torch.Tensor]:
        r"""The regressions of every unit on the rows ``rows`` (global positions),
        from the ranks' all-reduced statistics :math:`X^\top L^{-1} X`,
        :math:`X^\top L^{-1} y` (the primal form, whatever the solver)."""
        shards, pool, h = self.shards, self.pool, layer.num_units
        dtype, device = inputs.dtype, inputs.device
        with shards.agree():
            local = pool.local_pos[rows[pool.owner[rows] == shards.rank]]
            x = unit_inputs(layer, inputs[local])
            groups = x.shape[2]
            t, noise = y[local][:, cols], noise_var[local][:, cols]
            if layer.fixed_bias is not None:
                t = t - layer.fixed_bias.to(t)
            gram, rhs = shared_rows_statistics(
                x, t.to(dtype), noise.to(dtype),
                torch.arange(h, device=device) // (h // groups), layer.bias_name is not None)
        total = shards.all_reduce(torch.cat([gram.reshape(-1), rhs.reshape(-1)]))
        gram, rhs = total[: gram.numel()].reshape(gram.shape), total[gram.numel() :].reshape(
            rhs.shape)
        with shards.agree():
            prior_loc, prior_scale = unit_priors(layer, torch.arange(h, device=device))
            mean, precision = solve_statistics(
                gram, rhs, prior_loc.to(dtype), prior_scale.to(dtype), jitter)
        return mean, precision.reciprocal()

    def reduce_norm_statistics(self, accumulated: Dict[int, List[Any]]) -> None:
        for stats in accumulated.values():
            total = self.shards.all_reduce(torch.cat([
                torch.as_tensor(stats[2]).to(stats[3]).reshape(1), stats[3], stats[4]]))
            size = (len(total) - 1) // 2
            stats[2], stats[3], stats[4] = total[0], total[1 : 1 + size], total[1 + size :]


def warn_not_exact(what: str) -> None:
    warnings.warn(
        f"init_guide_iblm with a process_group: {what}, so the result is not exactly that "
        "of one process on the concatenated shards (every rank still gets the same one)",
        UserWarning, stacklevel=6,
    )


def structure_signature(structure: ModelStructure) -> Dict[str, Any]:
    """What the ranks' traces of the model must agree on."""
    likelihood = structure.likelihood
    return {
        "layers": [(layer.weight_name, tuple(layer.weight_shape), layer.role)
                   for layer in structure.layers],
        "likelihood": None if likelihood is None else (likelihood.family, likelihood.noise,
                                                        likelihood.noise_name),
        "block_size": structure.block_size,
        "batch_norm": structure.batch_norm,
    }
