"""
I-BLM over the ranks of a :mod:`torch.distributed` process group: each rank
holds a shard of the data, and the initializer's global quantities (row
indices, minibatch selection, regression statistics, noise and normalization
statistics) are combined with a few collective calls per layer, so that every
rank computes what one process computes on the concatenated shards.

Rows are named by their *global position* in the pool: the ranks' rows in
rank order (or a random subset of them, drawn alike on every rank, when
there are more than ``max_pool_size``). :class:`ShardedPool` knows which rank
owns each global position and where the row is in that rank's shard.
"""

import math
from contextlib import contextmanager
from typing import Any, Iterator, List, Optional, Sequence, Tuple, Type, cast

import torch
import torch.distributed as dist

from pyro_vinit.initialization._data import DataPool

# the standard exception classes every rank re-raises (see _error_class)
_ERRORS = (ValueError, TypeError, RuntimeError, KeyError, IndexError, NotImplementedError)


def _error_class(error: BaseException) -> Type[Exception]:
    """The class every rank raises for ``error``: pyro_vinit's own (e.g.
    ``NoLayersError``), else the first of ``_ERRORS`` it derives from, else
    RuntimeError."""
    cls = type(error)
    if cls.__module__.startswith("pyro_vinit.") and issubclass(cls, _ERRORS):
        return cast(Type[Exception], cls)
    return next((base for base in cls.__mro__ if base in _ERRORS), RuntimeError)


class Shards:
    """
    The ranks of a process group and the collectives the initializer uses,
    on tensors of any device (moved to the backend's device and back).

    :param process_group: A :class:`torch.distributed.ProcessGroup` of which
        this process is a member, e.g. ``torch.distributed.group.WORLD``.
    """

    def __init__(self, process_group: Any):
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError(
                "init_guide_iblm: process_group was given but torch.distributed is not "
                "initialized; call torch.distributed.init_process_group first (torchrun sets "
                "its environment), or pass process_group=None for one process"
            )
        if not isinstance(process_group, dist.ProcessGroup):
            raise ValueError(
                "init_guide_iblm: process_group must be a torch.distributed.ProcessGroup "
                f"(e.g. torch.distributed.group.WORLD), got {type(process_group).__name__}"
            )
        rank = dist.get_rank(process_group)
        if rank < 0:
            raise ValueError(
                "init_guide_iblm: this process is not a member of the given process_group; "
                "call it only on the group's ranks, each with its own shard"
            )
        self.group = process_group
        self.rank = rank
        self.size = dist.get_world_size(process_group)
        backend = dist.get_backend(process_group)
        self.device = (torch.device("cuda", torch.cuda.current_device())
                       if backend == "nccl" else torch.device("cpu"))

    @staticmethod
    def size_of(process_group: Any) -> int:
        """The number of ranks of ``process_group`` (1 for None)."""
        if process_group is None:
            return 1
        if not (dist.is_available() and dist.is_initialized()):
            return 0  # Shards() explains
        return dist.get_world_size(process_group) if isinstance(
            process_group, dist.ProcessGroup) else 0

    # ---- collectives ---------------------------------------------------------------------------

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum of ``tensor`` over the ranks (a new tensor, on ``tensor``'s device)."""
        buf = tensor.detach().to(self.device, copy=True)
        dist.all_reduce(buf, group=self.group)
        return buf.to(tensor.device)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Rank ``src``'s ``tensor`` (group rank), on every rank."""
        buf = tensor.detach().to(self.device, copy=True)
        dist.broadcast(buf, src=dist.get_global_rank(self.group, src), group=self.group)
        return buf.to(tensor.device)

    def all_gather(self, tensor: torch.Tensor, sizes: Sequence[int],
                   fill: float = 0.0) -> torch.Tensor:
        """The ranks' ``tensor`` (rank ``r``'s has ``sizes[r]`` rows, the same
        trailing shape everywhere), padded with ``fill`` to the largest
        size: shape ``(size, max(sizes), *trailing)``."""
        longest = max(sizes)
        buf = tensor.new_full((longest,) + tensor.shape[1:], fill).to(self.device)
        buf[: tensor.shape[0]] = tensor.to(self.device)
        out = [torch.empty_like(buf) for _ in range(self.size)]
        dist.all_gather(out, buf, group=self.group)
        return torch.stack(out).to(tensor.device)

    def all_gather_rows(self, tensor: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
        """The concatenation of the ranks' ``tensor`` in rank order."""
        gathered = self.all_gather(tensor, sizes)
        return torch.cat([gathered[r, :s] for r, s in enumerate(sizes)])

    def gather_objects(self, obj: Any) -> List[Any]:
        out: List[Any] = [None] * self.size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    # ---- agreement ------------------------------------------------------------------------------

    @contextmanager
    def agree(self) -> Iterator[None]:
        """
        Runs a block of rank-local work; if it raised on any rank, every rank
        raises the same error (naming the rank), so that no rank is left
        waiting in a collective the others never reach.
        """
        error: Optional[BaseException] = None
        try:
            yield
        except Exception as e:  # every exception: the other ranks must hear of it
            error = e
        failed = self.all_reduce(torch.tensor([float(error is not None)]))
        if not failed.item():
            return
        reports = self.gather_objects(None if error is None else (_error_class(error),
                                                                  str(error)))
        rank, (cls, message) = next((r, m) for r, m in enumerate(reports) if m is not None)
        raise cls(f"init_guide_iblm failed on rank {rank} of {self.size}: {message}") from error

    def check_equal(self, what: str, value: Any, fix: str) -> List[Any]:
        """Raises the same ValueError on every rank unless ``value`` is the same on all."""
        values = self.gather_objects(value)
        for rank, other in enumerate(values):
            if other != values[0]:
                raise ValueError(
                    f"init_guide_iblm with a process_group: the ranks differ in {what}: rank "
                    f"0 has {values[0]}, rank {rank} has {other}; {fix}"
                )
        return values

    @contextmanager
    def shared_rng(self, device: torch.device) -> Iterator[None]:
        """
        Every rank draws from rank 0's torch random state inside the block
        (so all ranks draw the same minibatches as one process would); ranks
        other than 0 get their own state back afterwards.
        """
        own = torch.get_rng_state()
        torch.set_rng_state(self.broadcast(own).cpu())
        own_cuda = None
        if device.type == "cuda":
            own_cuda = torch.cuda.get_rng_state(device)
            torch.cuda.set_rng_state(self.broadcast(own_cuda).cpu(), device)
        try:
            yield
        finally:
            if self.rank != 0:
                torch.set_rng_state(own)
                if own_cuda is not None:
                    torch.cuda.set_rng_state(own_cuda, device)


# ---------------------------------------------------------------------- the data


def data_signature(pool: DataPool) -> List[Any]:
    """What must agree across ranks: per argument, the trailing shape and dtype
    of a row-indexed tensor, or the type of another argument."""
    out: List[Tuple[Any, ...]] = []
    for a, aligned in zip(pool.args, pool._aligned):
        if aligned:
            out.append(("rows", tuple(a.shape[1:]), str(a.dtype)))
        elif isinstance(a, torch.Tensor):
            out.append(("tensor", tuple(a.shape), str(a.dtype)))
        else:
            out.append(("other", type(a).__name__))
    return out


class NormSync:
    """Batch-normalization statistics over every rank's rows of the current
    chunk; a rank without rows in it takes part with ``weight = 0``."""

    def __init__(self, shards: Shards):
        self.shards = shards
        self.weight = 1.0

    def __call__(self, x: torch.Tensor, dims: List[int]) -> Tuple[torch.Tensor, torch.Tensor]:
        """The mean and (biased) variance of ``x`` over ``dims`` and the ranks."""
        count = torch.tensor([x.numel() // x.shape[1] * self.weight], dtype=x.dtype,
                             device=x.device)
        total = self.shards.all_reduce(torch.cat([count, x.sum(dims) * self.weight]))
        mean = total[1:] / total[0]
        shape = [1] * x.dim()
        shape[1] = -1
        squares = (x - mean.reshape(shape)).pow(2).sum(dims) * self.weight
        var = self.shards.all_reduce(squares) / total[0]
        return mean, var


class ShardedPool(DataPool):
    """
    This rank's rows of a data pool spread over the ranks. ``num_rows`` is the
    global number of rows, the index space of :meth:`batch_indices`;
    ``local_rows`` this rank's; ``owner`` and ``local_pos`` map each global
    position to its rank and its row there.
    """

    shards: Shards

    def __init__(self, shards: Shards, local: DataPool, counts: Sequence[int]):
        self.shards = shards
        self.whole = False  # (a shard: a per-example latent's guide is set up elsewhere)
        self._aligned = local._aligned
        self.local_args = local.args
        self.counts = [int(c) for c in counts]

    def finish(self, max_rows: int) -> None:
        """Draws the global subsample (after the ranks agreed on the data) and
        maps the global positions onto the ranks."""
        shards, counts = self.shards, self.counts
        total = sum(counts)
        offsets = [sum(counts[:r]) for r in range(len(counts))]
        device = self.device_of(self.local_args)
        starts = torch.tensor(offsets, device=device)
        args = self.local_args
        if total > max_rows:
            # as DataPool draws its subsample, in the global index space
            keep = torch.randperm(total, device=device)[:max_rows]
            owner = torch.searchsorted(starts, keep, right=True) - 1
            mine = keep[owner == shards.rank] - offsets[shards.rank]
            args = tuple(a[mine] if al else a for a, al in zip(args, self._aligned))
            total = max_rows
        else:
            owner = torch.repeat_interleave(torch.arange(len(counts), device=device),
                                            torch.tensor(counts, device=device))
        local_pos = torch.empty_like(owner)
        sizes = []
        for r in range(shards.size):
            where = owner == r
            sizes.append(int(where.sum()))
            local_pos[where] = torch.arange(sizes[-1], device=device)
        empty = [r for r, s in enumerate(sizes) if s == 0]
        if empty:
            raise ValueError(
                f"init_guide_iblm: rank(s) {empty} have no rows among the {total} the pool "
                f"keeps of {sum(counts)} (shard sizes {counts}); give every rank data, or "
                "raise max_pool_size"
            )
        self.args, self.num_rows, self.sizes = args, total, sizes
        self.local_rows = sizes[shards.rank]
        self.owner, self.local_pos = owner, local_pos
        self.positions = torch.nonzero(owner == shards.rank)[:, 0]
        del self.local_args

    @staticmethod
    def device_of(args: Sequence[Any]) -> torch.device:
        return next((a.device for a in args if isinstance(a, torch.Tensor)),
                    torch.device("cpu"))

    def chunks(self, rows_per_chunk: int) -> Iterator[Tuple[Any, ...]]:
        for start in range(0, self.local_rows, rows_per_chunk):
            yield self.select(slice(start, start + rows_per_chunk))

    # ---- global statistics ---------------------------------------------------------------------

    def mean(self, t: torch.Tensor) -> torch.Tensor:
        """The mean of every element of the ranks' ``t`` (rows along dim 0)."""
        s = self.shards.all_reduce(torch.stack([t.sum(), t.new_tensor(float(t.numel()))]))
        return s[0] / s[1]

    def column_std(self, y: torch.Tensor) -> torch.Tensor:
        """The (unbiased) std of every column of the ranks' ``y`` (rows, k)."""
        n = self.num_rows
        mean = self.shards.all_reduce(y.sum(0)) / n
        return (self.shards.all_reduce((y - mean).pow(2).sum(0)) / max(n - 1, 1)).sqrt()

    def std(self, y: torch.Tensor) -> torch.Tensor:
        """The (unbiased) std of every element of the ranks' ``y``."""
        count = self.shards.all_reduce(torch.stack([y.new_tensor(float(y.numel())), y.sum()]))
        mean = count[1] / count[0]
        squares = self.shards.all_reduce((y - mean).pow(2).sum().reshape(1))[0]
        return (squares / (count[0] - 1).clamp_min(1)).sqrt()

    def at(self, local: torch.Tensor, idx: torch.Tensor,
           cols: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``local[idx]`` (or ``local[idx, cols]``) for global positions ``idx``
        of any shape: each rank fills in the rows it owns, and a sum over the
        ranks completes it."""
        owned = self.owner[idx] == self.shards.rank
        rows = self.local_pos[idx][owned]
        out = local.new_zeros(idx.shape + (local.shape[1:] if cols is None else ()))
        out[owned] = local[rows] if cols is None else local[rows, cols.expand_as(idx)[owned]]
        return self.shards.all_reduce(out)


# ---------------------------------------------------------------------- minibatches


def local_window(pool: ShardedPool, scores: torch.Tensor, start: torch.Tensor,
                 batch_size: int) -> torch.Tensor:
    """
    Global positions ``(units, batch_size)``: for unit :math:`j`, the rows at
    ranks ``start[j], ..., start[j] + batch_size - 1`` of the ascending order of
    ``scores[:, j]`` over all ranks' rows (this rank's ``scores``: ``(local
    rows, units)``), in that order, as ``argsort`` of the gathered scores
    would give; ties are broken by position.

    Without gathering the scores: every rank sends every ``q``-th of its
    sorted scores (:math:`q \\approx \\sqrt{N / 2R}`), which bounds the global
    rank of any value within :math:`R q`; then only the scores between the
    two bounds that surely enclose the window, with the counts below them.
    Three collectives, :math:`O(h (N / q + B + R q))` elements.
    """
    shards, sizes = pool.shards, pool.sizes
    n, units = pool.num_rows, scores.shape[1]
    vals, perm = scores.sort(0)  # (local rows, units)
    q = max(1, math.isqrt(n // (2 * shards.size)))
    inf = torch.tensor(math.inf, dtype=torch.float64, device=scores.device)
    # 1. every q-th sorted score of every rank: splitters[r, i] is at rank r's position (i+1)q-1
    counts = torch.tensor([s // q for s in sizes], device=scores.device)
    splitters = shards.all_gather(vals[q - 1 :: q].double(), [int(c) for c in counts],
                                  fill=math.inf)  # (R, M, units)
    shard_rows = torch.tensor(sizes, device=scores.device)
    candidates = torch.cat([splitters.reshape(-1, units),
                            -inf.expand(1, units), inf.expand(1, units)])  # (C, units)
    cand_t = candidates.T.contiguous()
    below_hi = torch.zeros_like(cand_t, dtype=torch.long)  # bound on #(score < v)
    upto_lo = torch.zeros_like(cand_t, dtype=torch.long)  # bound on #(score <= v), from below
    for r in range(shards.size):
        spl = splitters[r].T.contiguous()  # (units, M), ascending, inf-padded
        less = torch.searchsorted(spl, cand_t).clamp_max(counts[r])
        leq = torch.searchsorted(spl, cand_t, right=True).clamp_max(counts[r])
        below_hi += torch.minimum(shard_rows[r], (less + 1) * q - 1)
        upto_lo += leq * q
    # (-inf and inf bound the window whatever their bounds say: the max and min below
    # fall back to them when no splitter qualifies)
    start = start.to(scores.device)
    lo = torch.where(below_hi <= start[:, None], cand_t, -inf).amax(1)  # (units,)
    hi = torch.where(upto_lo >= (start + batch_size)[:, None], cand_t, inf).amin(1)
    # 2. each rank's scores in [lo, hi], with how many of its scores lie below lo
    sorted_t = vals.T.double().contiguous()  # (units, local rows)
    first = torch.searchsorted(sorted_t, lo[:, None])[:, 0]
    last = torch.searchsorted(sorted_t, hi[:, None], right=True)[:, 0]
    stats = shards.all_gather(torch.stack([first, last - first])[None], [1] * shards.size)
    below, inside = stats[:, 0, 0], stats[:, 0, 1]  # (R, units)
    width = int(inside.max())
    offsets = first[:, None] + torch.arange(width, device=scores.device)
    valid = offsets < last[:, None]
    offsets = offsets.clamp_max(max(pool.local_rows - 1, 0))
    cand_vals = torch.where(valid, sorted_t.gather(1, offsets), inf)
    local_rows = perm.T.gather(1, offsets)
    cand_pos = torch.where(valid, pool.positions[local_rows], n).double()
    both = shards.all_gather(torch.stack([cand_vals, cand_pos], -1)[None],
                             [1] * shards.size)[:, 0]  # (R, units, width, 2)
    both = both.permute(1, 0, 2, 3).reshape(units, -1, 2)
    # 3. the window: sort by (score, position)
    by_pos = both[..., 1].argsort(1)
    both = both.gather(1, by_pos[..., None].expand_as(both))
    by_val = both[..., 0].sort(dim=1, stable=True).indices
    ordered = both[..., 1].gather(1, by_val)
    shift = start - below.sum(0)
    window = shift[:, None] + torch.arange(batch_size, device=scores.device)
    return ordered.gather(1, window).long()


# ---------------------------------------------------------------------- the regressions


def gather_batches(pool: ShardedPool, tensors: Sequence[torch.Tensor],
                   idx: torch.Tensor) -> Tuple[List[torch.Tensor], torch.Tensor]:
    """
    The rows of ``tensors`` (this rank's, rows along dim 0) that the minibatches
    ``idx`` (global positions) select, from their ranks: ``(compact tensors,
    idx into them)``; one all-gather of only the selected rows.
    """
    shards = pool.shards
    selected = idx.unique()  # type: ignore[no-untyped-call]  # torch's is unannotated; sorted
    owner = pool.owner[selected]
    mine = selected[owner == shards.rank]
    sizes = [int((owner == r).sum()) for r in range(shards.size)]
    rows = pool.local_pos[mine]
    # (in their promoted dtype, as torch.cat gives them; each is cast back below)
    flat = torch.cat([t[rows].reshape(len(rows), -1) for t in tensors], 1)
    gathered = shards.all_gather(flat, sizes)  # (R, max size, width)
    # the position of each selected row among its owner's contribution
    rank_in_owner = torch.empty_like(owner)
    for r in range(shards.size):
        where = owner == r
        rank_in_owner[where] = torch.arange(int(where.sum()), device=owner.device)
    compact = gathered[owner, rank_in_owner]
    out: List[torch.Tensor] = []
    at = 0
    for t in tensors:
        width = t[:1].numel()
        out.append(compact[:, at : at + width].reshape((len(selected),) + t.shape[1:]).to(t.dtype))
        at += width
    return out, torch.searchsorted(selected, idx)


def unit_share(shards: Shards, num_units: int) -> Tuple[int, int]:
    """This rank's contiguous range of a layer's units."""
    return (num_units * shards.rank // shards.size,
            num_units * (shards.rank + 1) // shards.size)


def all_gather_units(shards: Shards, num_units: int,
                     *tensors: torch.Tensor) -> Tuple[torch.Tensor, ...]:
    """The ranks' shares (:func:`unit_share`) of per-unit tensors, concatenated."""
    sizes = [num_units * (r + 1) // shards.size - num_units * r // shards.size
             for r in range(shards.size)]
    flat = torch.stack(tensors, 1)  # (share, k, width)
    full = shards.all_gather_rows(flat, sizes)
    return tuple(full[:, i] for i in range(len(tensors)))
