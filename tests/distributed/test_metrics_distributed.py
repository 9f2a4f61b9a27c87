"""
Streaming metrics under ``torch.distributed``: two ``gloo`` processes each
accumulate their own uneven share of the test batches, :meth:`sync` sums the
statistics, and every rank then computes the values of the functions on all
the test points at once.
"""

import os

import pytest
import torch
import torch.distributed as dist

from pyro_vinit import metrics
from tests.distributed import _harness

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available()
    or _harness.loopback_interface() is None,
    reason="needs torch.distributed with the gloo backend and a loopback network interface",
)

# uneven batches per rank; in "one_rank_empty" rank 1 sees no batch at all
SPLITS = {
    "uneven": [[(0, 1), (1, 40)], [(40, 41), (41, 103)]],
    "one_rank_empty": [[(0, 50), (50, 103)], []],
}


def _data():
    g = torch.Generator().manual_seed(0)
    logits = 2 * torch.randn(7, 103, 4, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 4, (103,), generator=g)
    targets = torch.randn(103, generator=g, dtype=torch.float64)
    loc = targets + 0.5 * torch.randn(7, 103, generator=g, dtype=torch.float64)
    return logits, labels, targets, loc


def _rank_results(rank: int) -> dict:
    logits, labels, targets, loc = _data()
    results = {}
    for name, split in SPLITS.items():
        cls, reg, auroc = (metrics.ClassificationMetrics(), metrics.RegressionMetrics(),
                           metrics.OODAUROC())
        for start, stop in split[rank]:
            cls.update(labels[start:stop], logits=logits[:, start:stop])
            reg.update(targets[start:stop], loc=loc[:, start:stop], scale=0.3)
            scores = metrics.predictive_entropy(logits=logits[:, start:stop])
            auroc.update(scores_in=scores[: (stop - start) // 2],
                         scores_out=scores[(stop - start) // 2 :])
        for acc in (cls, reg, auroc):
            acc.sync()
        results[name] = {"classification": cls.compute(), "regression": reg.compute(),
                         "count": cls.calibration().count, "auroc": auroc.compute()}
    errors = []
    for call in (lambda: cls.sync(), lambda: cls.update(labels[:3], logits=logits[:, :3]),
                 lambda: auroc.sync(), lambda: auroc.update(scores_in=targets)):
        try:
            call()
        except RuntimeError as e:
            errors.append(str(e))
    results["errors"] = errors
    return results


def _worker(rank: int, world_size: int, port: int, out_dir: str) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = _harness.loopback_interface()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size)
    try:
        results = _rank_results(rank)
    finally:
        dist.destroy_process_group()
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


def _run_ranks(out_dir: str, names: list) -> list:
    import torch.multiprocessing as mp

    world_size = _harness.WORLD_SIZE
    mp.spawn(_worker, args=(world_size, _harness.free_port(), out_dir), nprocs=world_size)
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(world_size)]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return _harness.spawn_or_skip(_run_ranks, str(tmp_path_factory.mktemp("metrics")), [])


@pytest.mark.parametrize("name", list(SPLITS))
def test_synced_metrics_equal_single_process(ranks, name):
    logits, labels, targets, loc = _data()
    expected = {
        "classification": metrics.classification_metrics(labels, logits=logits),
        "regression": metrics.regression_metrics(targets, loc=loc, scale=0.3),
    }
    count = metrics.calibration(labels, logits=logits).count
    # each batch's first half in distribution, its second half out
    scores = metrics.predictive_entropy(logits=logits)
    is_in = torch.zeros(len(labels), dtype=torch.bool)
    for start, stop in sum(SPLITS[name], []):
        is_in[start : start + (stop - start) // 2] = True
    auroc = metrics.ood_auroc(scores[is_in], scores[~is_in]).item()
    for rank in ranks:
        assert rank[name]["auroc"] == pytest.approx(auroc, abs=1e-12, rel=0)
        for kind, values in expected.items():
            for key, value in values.items():
                assert rank[name][kind][key] == pytest.approx(value, abs=1e-12, rel=0), key
        assert torch.equal(rank[name]["count"], count)


def test_sync_twice_and_update_after_sync_raise(ranks):
    for rank in ranks:
        assert len(rank["errors"]) == 4
        for message, what in zip(rank["errors"], ["sync() was already called",
                                                  "update() after sync()"] * 2):
            assert what in message and "reset()" in message
