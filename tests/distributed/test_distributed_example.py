"""examples/distributed_mnist.py: its I-BLM call, and a two-process torchrun smoke run."""

import inspect
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


@pytest.mark.parametrize("accepts_group", [True, False])
def test_iblm_call_follows_the_signature(example, monkeypatch, accepts_group):
    """With ``process_group`` in init_guide_iblm's signature every rank passes
    its shard and the group; without it only rank 0 runs I-BLM, on all data."""
    calls = []

    if accepts_group:
        def fake_iblm(guide, data, *, batch_size=128, process_group=None):
            calls.append((data, process_group))
    else:
        def fake_iblm(guide, data, *, batch_size=128):
            calls.append((data, None))

    monkeypatch.setattr(example, "init_guide_iblm", fake_iblm)
    assert ("process_group" in inspect.signature(example.init_guide_iblm).parameters
            ) == accepts_group
    x, y = torch.arange(10.0)[:, None], torch.arange(10)
    args = SimpleNamespace(iblm_batch_size=4)
    if accepts_group:
        example.initialize(None, x, y, rank=1, world_size=2, args=args)
        (data, group), = calls
        assert torch.equal(data[0], x[1::2]) and torch.equal(data[1], y[1::2])
        assert group is dist.group.WORLD
    else:
        example.initialize(None, x, y, rank=0, world_size=1, args=args)
        (data, group), = calls
        assert torch.equal(data[0], x) and group is None


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
    # I-BLM's result reached every rank before DDP existed, and DDP kept them equal
    assert results["replica_max_difference"] == {"init": 0.0, "final": 0.0}
    assert results["final"]["accuracy"] > 0.5
    assert results["curve"][-1]["step"] == results["config"]["steps"]
    # rank 0 alone reports
    assert result.stdout.count("test accuracy") == 2
