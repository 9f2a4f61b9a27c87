"""
Data-parallel SVI on ``torch.distributed`` (``gloo``, loopback only) for the
tests of this folder: every case trains the same small Bayesian network from
the same start on the same global minibatches, either with one process per
rank under :class:`~torch.nn.parallel.DistributedDataParallel`
(:func:`run_ranks`), or in one process (:func:`reference`).

Seeding: one seed (``SEED``) for the data and the guide's parameters,
``SEED + rank`` for each rank's noise. The one-process reference keeps one
torch generator state per rank and runs each rank's shard under that rank's
state, then averages the shards' losses as DDP averages their gradients: the
two computations then agree up to float rounding.
"""

import inspect
import os
import socket
from contextlib import ExitStack
from typing import Callable, Dict, List, NamedTuple, Optional

import pyro
import torch
import torch.distributed as dist
from pyro.infer import Trace_ELBO, TraceMeanField_ELBO
from pyro.infer.autoguide import AutoNormal, init_to_sample

from pyro_vinit import AutoKTiedNormal, AutoRadialNormal
from pyro_vinit.nn import BayesianClassifier, bayesianize, mlp
from pyro_vinit.poutine import KLAnnealingMessenger, flipout, local_reparam
from pyro_vinit.schedules import LinearWarmup

WORLD_SIZE = 2
SEED = 3
NUM_DATA = 64
GLOBAL_BATCH = 16
NUM_STEPS = 6
SIZES = (6, 8, 3)
LR = 0.05


class Case(NamedTuple):
    guide: Callable  # model -> guide
    elbo: type
    handler: Optional[Callable]  # () -> messenger, entered around every loss evaluation
    annealing: bool = False
    # Pyro's default global param store, or per-module parameters as Pyro's Lightning example
    module_local_params: bool = True


CASES: Dict[str, Case] = {
    "ktied_lrt": Case(lambda m: AutoKTiedNormal(m, rank=2, init_loc_fn=init_to_sample),
                      TraceMeanField_ELBO, local_reparam),
    "radial_flipout": Case(lambda m: AutoRadialNormal(m, init_loc_fn=init_to_sample),
                           TraceMeanField_ELBO, flipout),
    "autonormal": Case(lambda m: AutoNormal(m, init_loc_fn=init_to_sample), Trace_ELBO, None,
                       module_local_params=False),
    "autonormal_lrt": Case(lambda m: AutoNormal(m, init_loc_fn=init_to_sample), Trace_ELBO,
                           local_reparam),
    "ktied_lrt_kl_annealing": Case(
        lambda m: AutoKTiedNormal(m, rank=2, init_loc_fn=init_to_sample), TraceMeanField_ELBO,
        local_reparam, annealing=True),
}


class HandledLoss(torch.nn.Module):
    """The ELBO module run under a KL annealing messenger and a weight-noise
    handler: the handlers must see the guide and the model, so they wrap the
    whole loss, inside the module DDP wraps."""

    def __init__(self, elbo_module, handler=None, annealing=None):
        super().__init__()
        self.elbo = elbo_module
        self.handler = handler
        self.annealing = annealing

    def forward(self, x, y):
        with ExitStack() as stack:
            if self.annealing is not None:
                stack.enter_context(self.annealing)
            if self.handler is not None:
                stack.enter_context(self.handler())
            return self.elbo(x, y)


def make_data(dtype=torch.float64):
    """The training set and the global minibatches (index tensors), from ``SEED``."""
    g = torch.Generator().manual_seed(SEED)
    x = torch.randn(NUM_DATA, SIZES[0], generator=g, dtype=dtype)
    teacher = torch.randn(SIZES[0], SIZES[-1], generator=g, dtype=dtype)
    y = (x @ teacher).argmax(-1)
    batches = [torch.randperm(NUM_DATA, generator=g)[:GLOBAL_BATCH] for _ in range(NUM_STEPS)]
    return x, y, batches


def shard(batch: torch.Tensor, rank: int, world_size: int = WORLD_SIZE) -> torch.Tensor:
    size = len(batch) // world_size
    return batch[rank * size : (rank + 1) * size]


def build(case: Case, num_data: Optional[int] = NUM_DATA, dtype=torch.float64):
    """Model, guide (with all its parameters) and the wrapped loss, from ``SEED``."""
    pyro.set_rng_seed(SEED)
    pyro.clear_param_store()
    x, y, _ = make_data(dtype)
    model = BayesianClassifier(bayesianize(mlp(SIZES)).to(dtype), num_data=num_data)
    guide = case.guide(model)
    guide(x[:1], y[:1])  # creates every parameter, before DDP and the optimizer see them
    annealing = KLAnnealingMessenger(LinearWarmup(4)) if case.annealing else None
    loss = HandledLoss(case.elbo()(model, guide), case.handler, annealing)
    return model, guide, loss


def snapshot(guide) -> Dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in guide.state_dict().items()}


def no_forward_buffer_sync() -> dict:
    """DDP's option not to broadcast the buffers (the layers' constant prior
    scales) at every forward, under its current name."""
    from torch.nn.parallel import DistributedDataParallel

    params = inspect.signature(DistributedDataParallel.__init__).parameters
    if "forward_sync_buffers" in params:  # torch >= 2.13 deprecates broadcast_buffers
        return {"forward_sync_buffers": False}
    return {"broadcast_buffers": False}


def train_rank(rank: int, world_size: int, case: Case) -> dict:
    """One rank's training under DDP (the process group is initialized)."""
    from torch.nn.parallel import DistributedDataParallel

    with pyro.settings.context(module_local_params=case.module_local_params):
        model, guide, loss_fn = build(case)
        x, y, batches = make_data()
        ddp = DistributedDataParallel(loss_fn, find_unused_parameters=False,
                                      **no_forward_buffer_sync())
        optim = torch.optim.Adam(ddp.parameters(), lr=LR)
        pyro.set_rng_seed(SEED + rank)  # each rank its own noise
        losses, kl_weights = [], []
        for batch in batches:
            idx = shard(batch, rank, world_size)
            optim.zero_grad()
            loss = ddp(x[idx], y[idx])
            loss.backward()
            optim.step()
            losses.append(loss.item())
            if loss_fn.annealing is not None:
                kl_weights.append(loss_fn.annealing.scale)
                loss_fn.annealing.step()  # every rank: λ follows the global step
        return {"params": snapshot(guide), "losses": losses, "kl_weights": kl_weights}


def reference(case: Case) -> dict:
    """One process: each global batch's shards under the ranks' noise, losses averaged."""
    with pyro.settings.context(module_local_params=case.module_local_params):
        model, guide, loss_fn = build(case)
        x, y, batches = make_data()
        optim = torch.optim.Adam(loss_fn.parameters(), lr=LR)
        states = []
        for rank in range(WORLD_SIZE):
            pyro.set_rng_seed(SEED + rank)
            states.append(torch.get_rng_state())
        losses, kl_weights = [], []
        for batch in batches:
            optim.zero_grad()
            shard_losses = []
            for rank in range(WORLD_SIZE):
                torch.set_rng_state(states[rank])
                shard_losses.append(loss_fn(x[shard(batch, rank)], y[shard(batch, rank)]))
                states[rank] = torch.get_rng_state()
            loss = torch.stack(shard_losses).mean()
            loss.backward()
            optim.step()
            losses.append([v.item() for v in shard_losses])
            if loss_fn.annealing is not None:
                kl_weights.append(loss_fn.annealing.scale)
                loss_fn.annealing.step()
        return {"params": snapshot(guide), "losses": losses, "kl_weights": kl_weights}


def scaling_rank(rank: int, world_size: int) -> dict:
    """
    One DDP backward on this rank's shard of the first global batch, with the
    *same* noise seed on every rank (so one weight sample serves all of them,
    as in a full-batch step): the all-reduced gradient and the rank's loss.
    """
    from torch.nn.parallel import DistributedDataParallel

    case = CASES["ktied_lrt"]._replace(handler=None)
    with pyro.settings.context(module_local_params=True):
        model, guide, loss_fn = build(case)
        x, y, batches = make_data()
        ddp = DistributedDataParallel(loss_fn, **no_forward_buffer_sync())
        pyro.set_rng_seed(SEED + 100)
        idx = shard(batches[0], rank, world_size)
        loss = ddp(x[idx], y[idx])
        loss.backward()
        grads = {n: p.grad.clone() for n, p in loss_fn.named_parameters()}
        return {"grads": grads, "loss": loss.item()}


def scaling_full_batch() -> dict:
    """The full global batch in one process, under the same noise seed."""
    case = CASES["ktied_lrt"]._replace(handler=None)
    with pyro.settings.context(module_local_params=True):
        model, guide, loss_fn = build(case)
        x, y, batches = make_data()
        pyro.set_rng_seed(SEED + 100)
        loss = loss_fn(x[batches[0]], y[batches[0]])
        loss.backward()
        return {"grads": {n: p.grad.clone() for n, p in loss_fn.named_parameters()},
                "loss": loss.item()}


def loopback_interface() -> Optional[str]:
    """The name of the loopback network interface, if the platform has one."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except (AttributeError, OSError):
        return None
    for name in ("lo", "lo0"):
        if name in names:
            return name
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(rank: int, world_size: int, port: int, out_dir: str, names: List[str]) -> None:
    """Entry point of a spawned rank: runs every named case and the scaling
    check, and saves the results to ``out_dir/rank<rank>.pt``."""
    # Loopback only: gloo binds the loopback interface, the store listens on 127.0.0.1.
    os.environ["GLOO_SOCKET_IFNAME"] = loopback_interface()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size)
    try:
        with pyro.validation_enabled(True):
            results = {name: train_rank(rank, world_size, CASES[name]) for name in names}
            results["scaling"] = scaling_rank(rank, world_size)
    finally:
        dist.destroy_process_group()
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


def run_ranks(out_dir: str, names: List[str], world_size: int = WORLD_SIZE) -> List[dict]:
    """Spawns ``world_size`` gloo processes running :func:`worker`; returns
    each rank's results."""
    import torch.multiprocessing as mp

    mp.spawn(worker, args=(world_size, free_port(), out_dir, names), nprocs=world_size)
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(world_size)]


def spawn_or_skip(run_ranks: Callable[[str, List[str]], List[dict]], out_dir: str,
                  cases: List[str]) -> List[dict]:
    """``run_ranks(out_dir, cases)``, or a pytest skip naming the reason where
    ``gloo`` processes cannot start."""
    import warnings

    import pytest
    from torch.multiprocessing import ProcessExitedException

    for attempt in (1, 2):
        try:
            return run_ranks(out_dir, cases)
        except ProcessExitedException as e:
            # A rank killed by a signal (seen once in a full CI run: a gloo thread
            # aborting at start-up, "terminate called without an active exception")
            # is retried once on a fresh port; a Python error in a rank is a
            # ProcessRaisedException and fails at once, and so does a second crash.
            if attempt == 2:
                raise
            warnings.warn(f"a gloo rank crashed ({e}); retrying the spawn once", stacklevel=2)
        except Exception as e:  # pragma: no cover - only where gloo cannot start
            if "gloo" in str(e).lower() or "connect" in str(e).lower():
                pytest.skip(f"gloo processes could not start here: {e}")
            raise
    raise AssertionError("unreachable")


def assert_ranks_identical(ranks: List[dict], name: str) -> None:
    """Every rank's parameters of case ``name`` equal rank 0's, bit for bit."""
    first = ranks[0][name]["params"]
    for other in ranks[1:]:
        assert other[name]["params"].keys() == first.keys()
        for key, value in first.items():
            assert torch.equal(other[name]["params"][key], value), key


def threaded_ranks(size: int, fn: Callable[[int], object]) -> List[object]:
    """``[fn(0), ..., fn(size - 1)]``, each run in a thread of this process as
    that rank of a ``size``-rank default process group (torch's ``threaded``
    test backend): in process, so that the mutation tool sees the calls, and
    in milliseconds. Only for code that keeps no global state per rank (not
    Pyro's handler stack or param store, nor the global random generator).
    Re-raises the error of the first rank that failed; a rank that fails
    wakes the others from their collectives."""
    import threading

    from torch.testing._internal.distributed.multi_threaded_pg import (
        ProcessLocalGroup,
        _install_threaded_pg,
        _uninstall_threaded_pg,
    )

    assert not dist.is_initialized()
    results: List[object] = [None] * size
    errors: Dict[int, BaseException] = {}
    store = dist.HashStore()

    def run(rank: int) -> None:
        dist.init_process_group("threaded", rank=rank, world_size=size, store=store)
        try:
            results[rank] = fn(rank)
        except BaseException as e:  # (re-raised in the caller's thread)
            errors[rank] = e
            ProcessLocalGroup.exception_handle(e)
        finally:
            dist.destroy_process_group()

    _install_threaded_pg()
    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    ProcessLocalGroup.reset()
    try:
        threads = [threading.Thread(target=run, args=(rank,), daemon=True)
                   for rank in range(size)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
    finally:
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
        _uninstall_threaded_pg()
    if errors:
        raise errors[min(errors)]
    assert not any(thread.is_alive() for thread in threads), "a rank hangs"
    return results
