"""
:class:`~pyro_vinit.initialization._distributed.Shards` in this process: what it
reads from a process group (a one-rank ``gloo`` group, initialized and destroyed
around each test) and the refusals of a process_group it cannot use, each with
what to do.
"""

import os
import re

import pytest
import torch
import torch.distributed as dist

from pyro_vinit import IBLMGuideInitializer
from pyro_vinit.initialization._distributed import Shards
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
