"""
I-BLM over two ``gloo`` processes, each with its own shard, against one
process on the concatenated shards (see ``test_iblm_distributed.py``).

Seeding: model and data from ``SEED``; rank 0 keeps that random stream, the
other ranks are reseeded with ``SEED + rank`` before initializing, so the
ranks agree only through the initializer's own shared random state.
"""

import os
from datetime import timedelta
from typing import Callable, Dict, List, NamedTuple, Optional

import pyro
import pyro.distributions as dist
import torch
import torch.distributed as tdist
import torch.nn.functional as F
from pyro.infer.autoguide import AutoNormal
from pyro.nn import PyroModule, PyroSample
from torch import nn

from pyro_vinit import AutoKTiedNormal, init_guide_iblm
from pyro_vinit.nn import BayesianClassifier, bayesianize, mlp
from tests.distributed._harness import free_port, loopback_interface

WORLD_SIZE = 2
SEED = 11
# rank 0's shard is smaller than the default batch_size (128); N = 187
SHARDS = (37, 150)


class NoisyRegressor(PyroModule):
    """Regression whose noise std is a latent site that I-BLM estimates."""

    def __init__(self):
        super().__init__()
        self.net = bayesianize(mlp((5, 16, 16, 1), activation=nn.Tanh)).double()

    def forward(self, x, y=None):
        sigma = pyro.sample("sigma", dist.LogNormal(torch.tensor(0.0, dtype=x.dtype), 1.0))
        mean = self.net(x).squeeze(-1)
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", dist.Normal(mean, sigma), obs=y)
        return mean


class DestandardizedRegressor(NoisyRegressor):
    """NoisyRegressor mapping its output to the targets' scale (out * 3 + 10), which
    I-BLM's output targets undo (the map checked on every rank's rows)."""

    def forward(self, x, y=None):
        sigma = pyro.sample("sigma", dist.LogNormal(torch.tensor(0.0, dtype=x.dtype), 1.0))
        mean = self.net(x).squeeze(-1) * 3.0 + 10.0
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", dist.Normal(mean, sigma), obs=y)
        return mean


class ScaledPlateClassifier(PyroModule):
    """A classifier whose data plate draws the rows at hand, scaled to the data set
    (pyro.plate("data", N, subsample_size=len(x)), as fit's minibatches take it)."""

    def __init__(self):
        super().__init__()
        self.net = bayesianize(mlp((6, 24, 3))).double()

    def forward(self, x, y=None):
        logits = self.net(x)
        with pyro.plate("data", sum(SHARDS), subsample_size=x.shape[0]):
            pyro.sample("obs", dist.Categorical(logits=logits), obs=y)
        return logits


class FixedSubsampleClassifier(PyroModule):
    """A classifier that indexes its rows by a plate of a fixed subsample size, that of
    rank 1's shard (its first chunk's rows, not rank 0's)."""

    def __init__(self):
        super().__init__()
        self.w = PyroSample(dist.Normal(torch.tensor(0.0, dtype=torch.float64), 1.0)
                            .expand([3, 6]).to_event(2))

    def forward(self, x, y=None):
        w = self.w  # (drawn outside the plate)
        with pyro.plate("data", sum(SHARDS), subsample_size=SHARDS[1]) as rows:
            logits = F.linear(x[rows], w)
            pyro.sample("obs", dist.Categorical(logits=logits), obs=y[rows])
        return logits


def _classification_data(d=6, k=3):
    g = torch.Generator().manual_seed(SEED)
    x = torch.randn(sum(SHARDS), d, generator=g, dtype=torch.float64)
    y = (x @ torch.randn(d, k, generator=g, dtype=torch.float64)).argmax(-1)
    return x, y


def _imbalanced_data():
    """Class 2 is rare: the slabs of units regressing onto its column often hold
    none of it, and those units get a random batch instead."""
    x, _ = _classification_data()
    y = torch.where(x[:, 0] > 1.5, 2, (x[:, 1] > 0).long())
    return x, y


def _regression_data():
    g = torch.Generator().manual_seed(SEED)
    x = torch.randn(sum(SHARDS), 5, generator=g, dtype=torch.float64)
    y = torch.sin(x[:, 0]) + x[:, 1] * x[:, 2] + 0.2 * torch.randn(
        sum(SHARDS), generator=g, dtype=torch.float64)
    return x, y


def _mlp_classifier():
    return BayesianClassifier(bayesianize(mlp((6, 24, 24, 3))).double(), num_data=sum(SHARDS))


def _bn_classifier():
    net = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16, affine=False), nn.ReLU(),
                        nn.Linear(16, 16), nn.BatchNorm1d(16, affine=False), nn.ReLU(),
                        nn.Linear(16, 3))
    return BayesianClassifier(bayesianize(net).double(), num_data=sum(SHARDS))


class Case(NamedTuple):
    model: Callable[[], nn.Module]
    guide: Callable[[nn.Module], nn.Module]
    data: Callable
    options: Dict
    # set the guide up (on two rows) before initializing, or let the initializer do it
    setup_first: bool = True


CASES: Dict[str, Case] = {
    # the default options throughout
    "mlp_classification_autonormal": Case(_mlp_classifier, AutoNormal,
                                          _classification_data, {}),
    "mlp_classification_ktied": Case(_mlp_classifier, lambda m: AutoKTiedNormal(m, rank=2),
                                     _classification_data, {}, setup_first=False),
    "regression_learned_noise_ktied": Case(NoisyRegressor, lambda m: AutoKTiedNormal(m, rank=2),
                                           _regression_data, {}),
    "regression_learned_noise_autonormal": Case(NoisyRegressor, AutoNormal,
                                                _regression_data, {}),
    "regression_destandardized": Case(DestandardizedRegressor, AutoNormal,
                                      lambda: tuple(t * 3.0 + 10.0 if i else t for i, t in
                                                    enumerate(_regression_data())), {}),
    # units whose local batch has a constant target column get random batches
    "imbalanced_small_batches": Case(_mlp_classifier, AutoNormal, _imbalanced_data,
                                     {"batch_size": 16}),
    # the second layer (24 inputs, 16 rows per unit) solved on 2 principal directions
    "projected_wide_layer": Case(_mlp_classifier, AutoNormal, _classification_data,
                                 {"batch_size": 16, "input_rank": 2}),
    # batch normalization, in chunks of 64 rows (rank 0 has no rows in the second and third
    # of the global chunks), from a pool of 160 of the 187 rows (a global random subset)
    "batchnorm_chunks_subsample": Case(_bn_classifier, AutoNormal, _classification_data,
                                       {"chunk_rows": 64, "max_pool_size": 160}),
    # a plate of the rows at hand, scaled to the data set: read in blocks of its subsample
    # size (each rank's own), its shards of other sizes failed inside local_window
    "scaled_plate": Case(ScaledPlateClassifier, AutoNormal, _classification_data, {}),
    # a fixed subsample as large as one rank's first chunk (that rank alone had run a
    # model to tell, which moved its generator and split the ranks' shared stream)
    "fixed_subsample": Case(FixedSubsampleClassifier, AutoNormal, _classification_data, {},
                            setup_first=False),
}


def shard(t: torch.Tensor, rank: int) -> torch.Tensor:
    start = sum(SHARDS[:rank])
    return t[start : start + SHARDS[rank]]


def snapshot(model, guide) -> Dict[str, torch.Tensor]:
    out = {f"guide.{k}": v.detach().clone() for k, v in guide.state_dict().items()}
    out.update({f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()})
    return out


def build(case: Case):
    pyro.clear_param_store()
    pyro.set_rng_seed(SEED)
    x, y = case.data()
    model = case.model()
    guide = case.guide(model)
    if case.setup_first:
        guide(x[:2], y[:2])
    return model, guide, x, y


def reference(name: str) -> Dict[str, torch.Tensor]:
    """One process on the concatenated shards."""
    case = CASES[name]
    with pyro.settings.context(module_local_params=True):
        model, guide, x, y = build(case)
        init_guide_iblm(guide, (x, y), **case.options)
        return snapshot(model, guide)


def run_case(rank: int, name: str, break_shard: Optional[Callable] = None,
             guide_for: Optional[Callable] = None) -> dict:
    case = CASES[name]
    with pyro.settings.context(module_local_params=True):
        model, guide, x, y = build(case)
        if guide_for is not None:
            guide = guide_for(rank, model)
        if rank:
            pyro.set_rng_seed(SEED + rank)  # only the initializer's shared stream may align them
        x, y = shard(x, rank), shard(y, rank)
        if break_shard is not None:
            x, y = break_shard(rank, x, y)
        before = snapshot(model, guide)
        try:
            init_guide_iblm(guide, (x, y), process_group=tdist.group.WORLD, **case.options)
        except Exception as e:
            return {"error": (type(e).__name__, str(e)),
                    "unchanged": all(torch.equal(before[k], v)
                                     for k, v in snapshot(model, guide).items())}
        return {"params": snapshot(model, guide)}


def _wide_features_on_rank_1(rank, x, y):
    return (torch.cat([x, x[:, :1]], 1) if rank == 1 else x), y


def _bad_labels_on_rank_1(rank, x, y):
    return x, (y.clone().fill_(7) if rank == 1 else y)


ERROR_CASES = {"mismatched_features": _wide_features_on_rank_1,
               "bad_labels_on_one_rank": _bad_labels_on_rank_1}

#: Guides that differ between the ranks (each not set up before I-BLM): rank 1's k-tied
#: guide of another rank failed with a bare index error in the minibatches' windows.
GUIDE_ERROR_CASES = {
    "mismatched_guide_rank": lambda rank, model: AutoKTiedNormal(model, rank=2 + rank),
    "mismatched_guide_class": lambda rank, model: (AutoKTiedNormal(model) if rank
                                                   else AutoNormal(model)),
}


def worker(rank: int, world_size: int, port: int, out_dir: str, names: List[str]) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = loopback_interface()
    torch.set_num_threads(1)
    # a hang (a rank left in a collective) fails the test instead of stalling it
    tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                             world_size=world_size, timeout=timedelta(seconds=60))
    try:
        with pyro.validation_enabled(True):
            results = {name: run_case(rank, name) for name in names}
            for name, breaker in ERROR_CASES.items():
                results[name] = run_case(rank, "mlp_classification_autonormal", breaker)
            for name, guide_for in GUIDE_ERROR_CASES.items():
                results[name] = run_case(rank, "mlp_classification_autonormal",
                                         guide_for=guide_for)
    finally:
        tdist.destroy_process_group()
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


def run_ranks(out_dir: str, names: List[str]) -> List[dict]:
    import torch.multiprocessing as mp

    mp.spawn(worker, args=(WORLD_SIZE, free_port(), out_dir, names), nprocs=WORLD_SIZE)
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(WORLD_SIZE)]
