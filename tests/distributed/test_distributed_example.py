"""examples/distributed_mnist.py: its I-BLM call, and a two-process torchrun smoke run."""

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from tests.distributed._harness import loopback_interface

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "examples", "distributed_mnist.py")


@pytest.fixture
def example(monkeypatch):
    monkeypatch.syspath_prepend(os.path.join(ROOT, "examples"))
    import distributed_mnist

    return distributed_mnist


@pytest.mark.parametrize("rank, world_size", [(1, 2), (0, 1)])
def test_iblm_call_passes_the_shard_and_group(example, monkeypatch, rank, world_size):
    """Under torchrun every rank passes its shard and the process group; in one
    process, all the data and no group."""
    calls = []

    def fake_iblm(guide, data, *, batch_size=128, max_scale_ratio=None, process_group=None):
        calls.append((data, process_group))

    monkeypatch.setattr(example, "init_guide_iblm", fake_iblm)
    x, y = torch.arange(10.0)[:, None], torch.arange(10)
    example.initialize(None, x, y, rank=rank, world_size=world_size,
                       args=SimpleNamespace(iblm_batch_size=4, max_scale_ratio=0.1))
    (data, group), = calls
    assert torch.equal(data[0], x[rank::world_size]) and torch.equal(data[1], y[rank::world_size])
    assert group is (dist.group.WORLD if world_size > 1 else None)


@pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available() or loopback_interface() is None,
    reason="needs torch.distributed with the gloo backend and a loopback network interface",
)
def test_torchrun_two_processes(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MPLBACKEND": "Agg", "PYTHONPATH": ROOT,
           # loopback only, for the rendezvous (--standalone: localhost) and for gloo
           "GLOO_SOCKET_IFNAME": loopback_interface()}
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         SCRIPT, "--quick", "--out-dir", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=env,
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    with open(tmp_path / "results.json") as f:
        results = json.load(f)
    assert results["world_size"] == 2
    # I-BLM gave every rank the same result before DDP existed, and DDP kept them equal
    assert results["replica_max_difference"] == {"init": 0.0, "final": 0.0}
    assert results["final"]["accuracy"] > 0.5
    assert results["curve"][-1]["step"] == results["config"]["steps"]
    # rank 0 alone reports
    assert result.stdout.count("test accuracy") == 2
