"""
:class:`~pyro_vinit.initialization._distributed.Shards` in this process: what it
reads from a process group (a one-rank ``gloo`` group, initialized and destroyed
around each test) and the refusals of a process_group it cannot use, each with
what to do.
"""

import os
import re
from functools import partial

import pyro
import pytest
import torch
import torch.distributed as dist

from pyro_vinit import IBLMGuideInitializer
from pyro_vinit.initialization._data import DataPool
from pyro_vinit.initialization._distributed import (
    NormSync,
    ShardedPool,
    Shards,
    all_gather_units,
    data_signature,
    gather_batches,
    local_window,
)
from tests.common import assert_close
from tests.distributed import _harness

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available()
    or _harness.loopback_interface() is None,
    reason="needs torch.distributed with the gloo backend and a loopback network interface",
)


@pytest.fixture
def one_rank(monkeypatch):
    """A one-rank gloo group (the default group) for the test's duration."""
    assert not dist.is_initialized()
    monkeypatch.setitem(os.environ, "GLOO_SOCKET_IFNAME", _harness.loopback_interface())
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_refused_before_init_process_group():
    assert not dist.is_initialized()
    message = ("init_guide_iblm: process_group was given but torch.distributed is not "
               "initialized; call torch.distributed.init_process_group first (torchrun sets "
               "its environment), or pass process_group=None for one process")
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        IBLMGuideInitializer(process_group=object())


def test_refuses_what_is_no_process_group(one_rank):
    message = ("init_guide_iblm: process_group must be a torch.distributed.ProcessGroup "
               "(e.g. torch.distributed.group.WORLD), got object")
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        IBLMGuideInitializer(process_group=object())
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        Shards(object())


def test_refuses_a_group_without_this_process(one_rank, monkeypatch):
    # dist.get_rank answers -1 for a group this process is not in (only a multi-process
    # job has one; here get_rank is told to)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: -1)
    message = ("init_guide_iblm: this process is not a member of the given process_group; "
               "call it only on the group's ranks, each with its own shard")
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        Shards(dist.group.WORLD)


@pytest.mark.parametrize("subgroup", [False, True])
def test_reads_rank_size_and_backend_of_the_given_group(one_rank, monkeypatch, subgroup):
    group = dist.new_group([0]) if subgroup else dist.group.WORLD
    assert isinstance(group, dist.ProcessGroup)
    asked = []
    for name in ("get_rank", "get_world_size", "get_backend"):
        real = getattr(dist, name)

        def spy(group=None, _real=real, _name=name):
            asked.append((_name, group))
            return _real(group)

        monkeypatch.setattr(dist, name, spy)
    shards = Shards(group)
    monkeypatch.undo()
    # the given group is asked, not the default one (None)
    assert sorted(asked) == [("get_backend", group), ("get_rank", group),
                             ("get_world_size", group)]
    assert shards.group is group
    assert (shards.rank, shards.size) == (0, 1)
    # gloo's collectives run on the CPU, whatever the tensor's device
    assert shards.device == torch.device("cpu")
    total = shards.all_reduce(torch.tensor([1.5, -2.0], dtype=torch.float64))
    assert total.tolist() == [1.5, -2.0] and total.dtype == torch.float64


def test_nccl_collectives_run_on_the_current_cuda_device(one_rank, monkeypatch):
    # (the device choice only: the group stays gloo, its backend is reported as nccl)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert Shards(dist.group.WORLD).device == torch.device("cuda", 3)


# ---------------------------------------------------------------- several ranks, in threads
# (torch's threaded test backend: every rank a thread of this process, see
# _harness.threaded_ranks; the two-process tests are in test_iblm_distributed.py)


def _pool(shards, counts, *args, max_rows=10**9):
    pool = ShardedPool(shards, DataPool(args), counts)
    pool.finish(max_rows)
    return pool


def _shard(t, counts, rank):
    start = sum(counts[:rank])
    return t[start:start + counts[rank]]


@pytest.mark.parametrize("scores", ["distinct", "tied"])
@pytest.mark.parametrize("counts", [[30, 45], [40, 7, 25], [20, 1, 15]],
                         ids=["two_ranks", "three_ranks", "a_rank_of_one_row"])
def test_local_window_is_that_of_the_stable_order_of_all_ranks_scores(counts, scores):
    # the rows at places start .. start + B - 1 of each unit's ascending order of the
    # scores of every rank's rows, ties by position, as argsort of the gathered scores
    generator = torch.Generator().manual_seed(len(counts))
    n = sum(counts)
    if scores == "tied":
        every = torch.randint(0, 4, (n, 4), generator=generator).double()
    else:
        every = torch.randn(n, 4, generator=generator, dtype=torch.float64)
    order = every.argsort(dim=0, stable=True).T
    for batch_size in (1, 8):
        start = torch.tensor([0, n // 3, n // 2 + 1, n - batch_size])
        want = torch.stack([order[j, s:s + batch_size] for j, s in enumerate(start.tolist())])

        def rank_window(rank, start, batch_size):
            x = _shard(every, counts, rank)
            pool = _pool(Shards(dist.group.WORLD), counts, x)
            return local_window(pool, x, start, batch_size)

        run = partial(rank_window, start=start, batch_size=batch_size)
        for window in _harness.threaded_ranks(len(counts), run):
            assert torch.equal(window, want)


@pytest.mark.parametrize("counts", [[1, 1], [3, 5, 4]], ids=["a_row_each", "three_ranks"])
def test_sharded_pool_statistics_are_those_of_all_ranks_rows(counts):
    generator = torch.Generator().manual_seed(0)
    every = torch.randn(sum(counts), 3, generator=generator, dtype=torch.float64)
    idx = torch.tensor([[0, sum(counts) - 1], [1, 0]])

    def statistics(rank):
        x = _shard(every, counts, rank)
        pool = _pool(Shards(dist.group.WORLD), counts, x)
        return (pool.mean(x), pool.std(x), pool.std(x[:, 0]), pool.column_std(x),
                pool.at(x, idx), pool.at(x, idx, torch.tensor([2, 1])),
                [args[0] for args in pool.chunks(2)])

    results = _harness.threaded_ranks(len(counts), statistics)
    for rank, (mean, std, std_0, column_std, rows, cells, chunks) in enumerate(results):
        assert_close(mean, every.mean())
        assert_close(std, every.reshape(-1).std())
        assert_close(std_0, every[:, 0].std())
        assert torch.equal(torch.cat(chunks), _shard(every, counts, rank))
        assert all(len(chunk) <= 2 for chunk in chunks)
        assert_close(column_std, every.std(0))
        assert torch.equal(rows, every[idx])
        assert torch.equal(cells, every[idx, torch.tensor([2, 1])])


def test_sharded_pool_maps_positions_to_ranks_and_draws_the_global_subsample():
    # (finish reads the rank and the number of ranks only: run rank by rank)
    from types import SimpleNamespace

    counts = [4, 1, 3]
    every = torch.arange(8.0)[:, None] * torch.ones(1, 2)
    for max_rows in (8, 10):  # (as many rows as the data has, or more: no subsample)
        for rank in range(3):
            x = _shard(every, counts, rank)
            pool = _pool(SimpleNamespace(rank=rank, size=3), counts, x, 7, max_rows=max_rows)
            assert torch.equal(pool.args[0], x) and pool.args[1] == 7
            assert pool.num_rows == 8 and pool.sizes == counts and pool.local_rows == counts[rank]
            assert torch.equal(pool.positions, torch.arange(8)[_shard(torch.arange(8), counts,
                                                                      rank)])
            assert torch.equal(pool.owner, torch.tensor([0, 0, 0, 0, 1, 2, 2, 2]))
            assert torch.equal(pool.local_pos, torch.tensor([0, 1, 2, 3, 0, 0, 1, 2]))
    # more rows than max_rows: the subsample one process draws from the rows of all ranks
    pyro.set_rng_seed(3)
    whole = DataPool((every, 7), max_rows=6)
    for rank in range(3):
        pyro.set_rng_seed(3)
        x = _shard(every, counts, rank)
        pool = _pool(SimpleNamespace(rank=rank, size=3), counts, x, 7, max_rows=6)
        assert pool.num_rows == 6 and pool.args[1] == 7
        assert torch.equal(pool.args[0], whole.args[0][pool.positions])
    # a rank left without rows: refused on every rank, naming the ranks
    pyro.set_rng_seed(0)
    kept = int(torch.randperm(8)[0])
    empty = [r for r in range(3) if not sum(counts[:r]) <= kept < sum(counts[:r + 1])]
    message = (f"init_guide_iblm: rank(s) {empty} have no rows among the 1 the pool keeps of 8 "
               "(shard sizes [4, 1, 3]); give every rank data, or raise max_pool_size")
    pyro.set_rng_seed(0)
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        _pool(SimpleNamespace(rank=0, size=3), counts, _shard(every, counts, 0), max_rows=1)


def test_shards_reduce_gather_and_broadcast_within_their_group():
    # ranks 1 and 2 of three in a group of their own: group ranks 0 and 1
    def collectives(rank):
        group = dist.new_group([1, 2])
        if rank == 0:
            return None
        shards = Shards(group)
        mine = torch.tensor([float(rank)])
        summed = shards.all_reduce(mine)
        assert torch.equal(mine, torch.tensor([float(rank)]))  # (a new tensor)
        sent = torch.tensor([10.0 * rank])
        broadcast = shards.broadcast(sent, src=1)
        assert torch.equal(sent, torch.tensor([10.0 * rank]))  # (a new tensor)
        with pytest.raises(ValueError) as error:
            shards.check_equal("the data", "ab"[shards.rank], "give every rank the same")
        return (shards.rank, shards.size, summed,
                broadcast,
                shards.all_gather(torch.full((rank, 2), float(rank)), [1, 2]),
                shards.gather_objects(rank), shards.check_equal("the data", "x", "-"),
                str(error.value))

    _, first, second = _harness.threaded_ranks(3, collectives)
    assert first[:2] == (0, 2) and second[:2] == (1, 2)
    gathered = torch.tensor([[[1.0, 1.0], [0.0, 0.0]], [[2.0, 2.0], [2.0, 2.0]]])
    message = ("init_guide_iblm with a process_group: the ranks differ in the data: rank 0 "
               "has a, rank 1 has b; give every rank the same")
    for result in (first, second):
        assert torch.equal(result[2], torch.tensor([3.0]))
        assert torch.equal(result[3], torch.tensor([20.0]))
        assert torch.equal(result[4], gathered)
        assert result[5] == [1, 2] and result[6] == ["x", "x"]
        assert result[7] == message


def test_norm_sync_gives_the_statistics_of_every_ranks_rows():
    # batch-norm statistics over dims (0, 2) of every rank's chunk; a rank without rows in
    # the chunk takes part with weight 0
    generator = torch.Generator().manual_seed(0)
    every = torch.randn(7, 3, 5, generator=generator, dtype=torch.float64)
    counts = [3, 4]

    def statistics(rank, empty=False):
        sync = NormSync(Shards(dist.group.WORLD))
        x = _shard(every, counts, rank)
        if empty and rank == 1:
            sync.weight = 0.0
            x = torch.ones(1, 3, 5, dtype=torch.float64)
        return sync(x, [0, 2])

    for mean, var in _harness.threaded_ranks(2, statistics):
        assert_close(mean, every.mean((0, 2)))
        assert_close(var, every.var((0, 2), unbiased=False))
    for mean, var in _harness.threaded_ranks(2, partial(statistics, empty=True)):
        assert_close(mean, every[:3].mean((0, 2)))
        assert_close(var, every[:3].var((0, 2), unbiased=False))


@pytest.mark.parametrize("counts", [[3, 5], [3, 1, 4]], ids=["two_ranks", "three_ranks"])
def test_gather_batches_and_units_from_their_ranks(counts):
    labels = torch.arange(8) * 3
    x = torch.randn(8, 2, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    idx = torch.tensor([[7, 1, 4], [1, 3, 0]])

    def gathered(rank):
        shards = Shards(dist.group.WORLD)
        mine = (_shard(labels, counts, rank), _shard(x, counts, rank))
        pool = _pool(shards, counts, *mine)
        (rows_labels, rows_x), where = gather_batches(pool, mine, idx)
        (again_x, again_labels), again = gather_batches(pool, mine[::-1], idx)
        assert torch.equal(again_x[again], rows_x[where])
        assert torch.equal(again_labels[again], rows_labels[where])
        units = None if len(counts) > 2 else all_gather_units(
            shards, 5, *(torch.full((3 if rank else 2, 4), rank + k) for k in (0.0, 0.5)))
        return rows_labels[where], rows_x[where], units

    for rows_labels, rows_x, units in _harness.threaded_ranks(len(counts), gathered):
        assert rows_labels.dtype == torch.int64 and torch.equal(rows_labels, labels[idx])
        assert torch.equal(rows_x, x[idx])
        if len(counts) == 2:  # (units 0, 1 on rank 0 and 2, 3, 4 on rank 1)
            first, second = units
            assert torch.equal(first, torch.tensor([0.0, 0.0, 1.0, 1.0, 1.0])[:, None].expand(5, 4))
            assert torch.equal(second, first + 0.5)


def test_data_signature_names_what_the_ranks_must_agree_on():
    pool = DataPool((torch.zeros(5, 3), torch.zeros(5, dtype=torch.long), torch.ones(2), 7))
    assert data_signature(pool) == [("rows", (3,), "torch.float32"), ("rows", (), "torch.int64"),
                                    ("tensor", (2,), "torch.float32"), ("other", "int")]
