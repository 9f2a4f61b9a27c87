"""
Data-parallel SVI with DistributedDataParallel over two ``gloo`` processes:
the ranks stay identical, and equal one process training on the same global
minibatches with the same noise (see ``_harness.py`` for the set-up).
"""

import pyro
import pytest
import torch
import torch.distributed as dist

from tests.common import assert_close
from tests.distributed import _harness
from tests.distributed._harness import CASES, WORLD_SIZE

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available()
    or _harness.loopback_interface() is None,
    reason="needs torch.distributed with the gloo backend and a loopback network interface",
)

# float64 throughout: the ranks' gradients are summed by gloo in another order
# than autograd sums the reference's, so the two agree to rounding, not bitwise.
TOL = dict(atol=1e-10, rtol=1e-10)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """All cases in one spawn of two processes (starting them costs seconds)."""
    out_dir = tmp_path_factory.mktemp("ddp")
    return _harness.spawn_or_skip(_harness.run_ranks, str(out_dir), list(CASES))


@pytest.mark.parametrize("name", list(CASES))
def test_ranks_hold_identical_parameters(ranks, name):
    _harness.assert_ranks_identical(ranks, name)


@pytest.mark.parametrize("name", list(CASES))
def test_matches_single_process(ranks, name):
    expected = _harness.reference(CASES[name])
    actual = ranks[0][name]
    # each rank's loss is the reference's loss on that rank's shard, step by step
    for rank in range(WORLD_SIZE):
        assert_close(torch.tensor(ranks[rank][name]["losses"]),
                     torch.tensor([step[rank] for step in expected["losses"]]), **TOL)
    assert actual["params"].keys() == expected["params"].keys()
    start = _harness.snapshot(_harness.build(CASES[name])[1])
    for key, value in expected["params"].items():
        assert not torch.allclose(value, start[key]), f"{key} did not train"
        assert_close(actual["params"][key], value, **TOL, msg=key)


def test_kl_annealing_follows_global_step(ranks):
    name = "ktied_lrt_kl_annealing"
    weights = [r[name]["kl_weights"] for r in ranks]
    assert weights[0] == weights[1]
    # LinearWarmup(4): λ = t / 4 at global step t, capped at 1
    assert weights[0] == [min(t / 4, 1.0) for t in range(_harness.NUM_STEPS)]
    # and it matters: without annealing the same run ends elsewhere
    plain = _harness.reference(CASES[name]._replace(annealing=False))["params"]
    annealed = ranks[0][name]["params"]
    assert any(not torch.allclose(plain[k], annealed[k], atol=1e-6) for k in annealed)


def test_averaged_shard_gradient_is_full_batch_gradient(ranks):
    """
    With the likelihood scaled by N / b on each rank's shard of b = B / R
    points, the DDP-averaged gradient of the ranks' losses is the gradient of
    the full-batch ELBO estimate (likelihood scaled by N / B), for one weight
    sample shared by the ranks (same noise seed).
    """
    expected = _harness.scaling_full_batch()
    losses = [r["scaling"]["loss"] for r in ranks]
    assert_close(sum(losses) / WORLD_SIZE, expected["loss"], **TOL)
    assert losses[0] != losses[1]  # the shards do differ
    for r in ranks:
        assert r["scaling"]["grads"].keys() == expected["grads"].keys()
        for key, grad in expected["grads"].items():
            assert_close(r["scaling"]["grads"][key], grad, **TOL, msg=key)


def test_reference_seeds_each_shard():
    """The reference is sensitive to the per-rank noise: the same shards
    under one shared noise stream train differently."""
    case = CASES["ktied_lrt"]
    expected = _harness.reference(case)["params"]
    with pyro.settings.context(module_local_params=True):
        _, guide, loss_fn = _harness.build(case)
        x, y, batches = _harness.make_data()
        optim = torch.optim.Adam(loss_fn.parameters(), lr=_harness.LR)
        pyro.set_rng_seed(_harness.SEED)
        for batch in batches:
            optim.zero_grad()
            loss = sum(loss_fn(x[_harness.shard(batch, r)], y[_harness.shard(batch, r)])
                       for r in range(WORLD_SIZE)) / WORLD_SIZE
            loss.backward()
            optim.step()
    actual = _harness.snapshot(guide)
    assert any(not torch.allclose(actual[k], expected[k], atol=1e-6) for k in expected)
