"""
Data-parallel SVI on this machine: the time of one global SVI step with one
process against two ``gloo`` processes (DistributedDataParallel, loopback),
and, on paper, the bytes one DDP gradient all-reduce moves per step; and the
time of I-BLM (``init_guide_iblm``) on all the data in one process against
two processes each passing its half with ``process_group``, with the
elements its collectives move (counted).

The step is the one of ``examples/distributed_mnist.py``: AutoKTiedNormal
(k = 2) + ``local_reparam`` + KL annealing, ``TraceMeanField_ELBO`` as a
module, ``torch.optim.Adam``, float32. A global batch of B points is one
process's minibatch, or two shards of B/2 under DDP. Three set-ups run in
interleaved rounds (each round starts each set-up in fresh processes, so
machine noise hits all alike) and each time is the median over rounds:

- 1 process, 1 thread;
- 1 process, 2 threads (the same two cores as two processes);
- 2 processes under DDP, 1 thread each.

The 2-process set-up also times the all-reduce alone (a flat tensor of the
gradient's size, as DDP's buckets send it), so the step's communication
share is measured, not guessed.

I-BLM (default options, AutoNormal, float32, synthetic data with a
teacher's labels) runs in interleaved rounds too: 1 process, 1 thread,
against 2 processes, 1 thread each; the median over rounds. Its
communication is counted by wrapping the initializer's collectives: the
elements each rank receives (an all-reduce's or broadcast's result, an
all-gather's padded result).

Usage::

    python -m benchmarks.bench_distributed            # full run (15 minutes on a loaded 2-core box)
    python -m benchmarks.bench_distributed --part iblm  # only I-BLM (keeps the stored SVI results)
    python -m benchmarks.bench_distributed --quick    # smoke run
"""

import json
import os
import socket
import statistics
import tempfile
import time

import pyro
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from pyro.infer import Trace_ELBO, TraceMeanField_ELBO
from pyro.infer.autoguide import AutoNormal, init_to_sample
from torch.nn.parallel import DistributedDataParallel

from benchmarks.harness import make_parser, parse_args
from pyro_vinit import AutoKTiedNormal, AutoRadialNormal, init_guide_iblm
from pyro_vinit.nn import BayesianClassifier, bayesianize, mlp
from pyro_vinit.poutine import HandledELBO, KLAnnealingMessenger, local_reparam
from pyro_vinit.schedules import LinearWarmup

# (name, layer sizes, global batch B, nominal training set size N)
PROBLEMS = [
    ("digits MLP 64-100-10", (64, 100, 10), 128, 1257),
    ("MNIST MLP 784-400-400-10", (784, 400, 400, 10), 128, 60000),
    ("MNIST MLP 784-400-400-10", (784, 400, 400, 10), 1024, 60000),
]
# (name, layer sizes, rows N of the data set)
IBLM_PROBLEMS = [
    ("digits-size MLP 64-100-10", (64, 100, 10), 1257),
    ("MNIST-size MLP 784-400-400-10", (784, 400, 400, 10), 10000),
]
IBLM_SETUPS = [("1 process", 1), ("2 processes", 2)]
SETUPS = [("1 process, 1 thread", 1, 1), ("1 process, 2 threads", 1, 2),
          ("2 processes (DDP), 1 thread each", 2, 1)]
GUIDES = {
    "AutoNormal": (lambda m: AutoNormal(m), Trace_ELBO),
    "AutoKTiedNormal(k=2)": (lambda m: AutoKTiedNormal(m, rank=2), TraceMeanField_ELBO),
    "AutoRadialNormal": (lambda m: AutoRadialNormal(m), TraceMeanField_ELBO),
}


def make_loss(sizes, num_data, x, y):
    model = BayesianClassifier(bayesianize(mlp(sizes)), num_data=num_data)
    guide = AutoKTiedNormal(model, rank=2, init_loc_fn=init_to_sample, init_scale=1e-2)
    guide(x[:1], y[:1])
    annealing = KLAnnealingMessenger(LinearWarmup(1000))
    return HandledELBO(TraceMeanField_ELBO()(model, guide), annealing, local_reparam)


def time_problem(rank, world_size, sizes, batch, num_data, steps, warmup):
    """Seconds per global step (on rank 0), and of a gradient-sized all-reduce."""
    pyro.set_rng_seed(0)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4 * batch, sizes[0], generator=g)
    y = torch.randint(0, sizes[-1], (4 * batch,), generator=g)
    loss_fn = make_loss(sizes, num_data, x, y)
    module = DistributedDataParallel(loss_fn) if world_size > 1 else loss_fn
    optim = torch.optim.Adam(module.parameters(), lr=1e-3)
    pyro.set_rng_seed(1 + rank)
    shard = batch // world_size

    def step(i):
        start = (i % 4) * batch + rank * shard
        optim.zero_grad()
        module(x[start : start + shard], y[start : start + shard]).backward()
        optim.step()
        loss_fn.annealing.step()

    for i in range(warmup):
        step(i)
    if world_size > 1:
        dist.barrier()
    begin = time.perf_counter()
    for i in range(steps):
        step(i)
    if world_size > 1:
        dist.barrier()
    seconds = (time.perf_counter() - begin) / steps
    allreduce = None
    if world_size > 1:
        flat = torch.zeros(sum(p.numel() for p in loss_fn.parameters()))
        for _ in range(warmup):
            dist.all_reduce(flat)
        dist.barrier()
        begin = time.perf_counter()
        for _ in range(steps):
            dist.all_reduce(flat)
        dist.barrier()
        allreduce = (time.perf_counter() - begin) / steps
    return seconds, allreduce


def loopback_interface():
    names = [name for _, name in socket.if_nameindex()]
    return next((n for n in ("lo", "lo0") if n in names), None)


def worker(rank, world_size, threads, port, out_path, problems, steps, warmup):
    torch.set_num_threads(threads)
    pyro.enable_validation(False)  # as in production training
    # Each guide keeps its own parameters (in the global store, guides of one class share them).
    pyro.settings.set(module_local_params=True)
    if world_size > 1:
        os.environ["GLOO_SOCKET_IFNAME"] = loopback_interface()  # loopback only
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size)
    results = [time_problem(rank, world_size, sizes, batch, n, steps, warmup)
               for _, sizes, batch, n in problems]
    if world_size > 1:
        dist.destroy_process_group()
    if rank == 0:
        torch.save(results, out_path)


def count_collectives():
    """Wraps torch.distributed's collectives to count the calls and the
    elements each rank receives (an all-gather's whole result, an
    all-reduce's or broadcast's tensor)."""
    tally = {"calls": 0, "elements": 0}

    def received(name, args):
        if name == "all_gather":  # (output list, input)
            return sum(t.numel() for t in args[0])
        if name == "all_gather_object":
            return 0
        return args[0].numel()

    def wrap(name, fn):
        def counted(*args, **kwargs):
            out = fn(*args, **kwargs)
            tally["calls"] += 1
            tally["elements"] += received(name, args)
            return out
        return counted

    for name in ("all_reduce", "broadcast", "all_gather", "all_gather_object"):
        setattr(dist, name, wrap(name, getattr(dist, name)))
    return tally


def time_iblm(rank, world_size, sizes, n):
    """Seconds of init_guide_iblm on this rank's share of n rows (on rank 0)."""
    pyro.set_rng_seed(0)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, sizes[0], generator=g)
    y = (x @ torch.randn(sizes[0], sizes[-1], generator=g)).argmax(-1)
    model = BayesianClassifier(bayesianize(mlp(sizes)), num_data=n)
    guide = AutoNormal(model)
    guide(x[:2], y[:2])
    lo, hi = n * rank // world_size, n * (rank + 1) // world_size
    group = dist.group.WORLD if world_size > 1 else None
    if world_size > 1:
        dist.barrier()
    begin = time.perf_counter()
    init_guide_iblm(guide, (x[lo:hi], y[lo:hi]), process_group=group)
    if world_size > 1:
        dist.barrier()
    return time.perf_counter() - begin


def iblm_worker(rank, world_size, port, out_path, problems):
    torch.set_num_threads(1)
    pyro.enable_validation(False)
    pyro.settings.set(module_local_params=True)
    tally = count_collectives()
    if world_size > 1:
        os.environ["GLOO_SOCKET_IFNAME"] = loopback_interface()  # loopback only
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size)
    results = []
    for _, sizes, n in problems:
        tally.update(calls=0, elements=0)
        seconds = time_iblm(rank, world_size, sizes, n)
        results.append({"seconds": seconds, "collectives": tally["calls"],
                        "elements_received": tally["elements"]})
    if world_size > 1:
        dist.destroy_process_group()
    if rank == 0:
        torch.save(results, out_path)


def run_iblm_setup(world_size, problems):
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "iblm.pt")
        mp.spawn(iblm_worker, nprocs=world_size,
                 args=(world_size, free_port(), out_path, problems))
        return torch.load(out_path)


def run_iblm(problems, rounds):
    runs = {name: [] for name, _ in IBLM_SETUPS}
    for r in range(rounds):
        for name, world_size in IBLM_SETUPS:
            runs[name].append(run_iblm_setup(world_size, problems))
            print(f"I-BLM round {r + 1}/{rounds}: {name} done", flush=True)
    rows = []
    for i, (name, sizes, n) in enumerate(problems):
        row = {"problem": name, "rows": n,
               "parameters": 2 * sum(a * b + b for a, b in zip(sizes[:-1], sizes[1:]))}
        for setup, _ in IBLM_SETUPS:
            row[setup] = statistics.median(run[i]["seconds"] for run in runs[setup])
        two = runs[IBLM_SETUPS[1][0]][0][i]
        row["collectives"], row["elements_received"] = two["collectives"], two["elements_received"]
        rows.append(row)
    return {"rounds": runs, "times": rows}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_setup(world_size, threads, problems, steps, warmup):
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "times.pt")
        mp.spawn(worker, nprocs=world_size,
                 args=(world_size, threads, free_port(), out_path, problems, steps, warmup))
        return torch.load(out_path)


def communication_volume():
    """Guide parameters P per problem and guide; DDP all-reduces P gradient
    elements per step. A ring all-reduce over R ranks has each rank send and
    receive 2 (R - 1) / R * P elements: P elements each way for R = 2."""
    rows = []
    pyro.settings.set(module_local_params=True)
    for name, sizes, _, _ in {p[0]: p for p in PROBLEMS}.values():
        x, y = torch.zeros(1, sizes[0]), torch.zeros(1, dtype=torch.long)
        for guide_name, (make_guide, _) in GUIDES.items():
            pyro.clear_param_store()
            guide = make_guide(BayesianClassifier(bayesianize(mlp(sizes))))
            guide(x, y)
            p = sum(v.numel() for v in guide.parameters())
            rows.append({"problem": name, "guide": guide_name, "parameters": p,
                         "MB_per_rank_R2_float32": p * 4 / 1e6,
                         "MB_per_rank_R2_float64": p * 8 / 1e6})
    return rows


def report(results):
    lines = ["Seconds per global SVI step (median over rounds; AutoKTiedNormal k=2 + LRT, float32)",
             "", "| problem | B | " + " | ".join(s[0] for s in SETUPS)
             + " | 2-proc speed-up vs 1 proc 1 thread | all-reduce alone |",
             "|---|---|" + "---|" * len(SETUPS) + "---|---|"]
    for row in results["times"]:
        cells = [f"{row[s[0]] * 1e3:.2f} ms" for s in SETUPS]
        speedup = row[SETUPS[0][0]] / row[SETUPS[2][0]]
        lines.append(f"| {row['problem']} | {row['batch']} | " + " | ".join(cells)
                     + f" | {speedup:.2f}x | {row['allreduce'] * 1e3:.2f} ms |")
    lines += ["", "Gradient all-reduce volume per step (on paper): P guide parameters; "
              "with R = 2 ranks each rank sends and receives P elements",
              "", "| problem | guide | P | MB per rank, float32 | MB per rank, float64 |",
              "|---|---|---|---|---|"]
    for row in results["communication"]:
        lines.append(f"| {row['problem']} | {row['guide']} | {row['parameters']:,} | "
                     f"{row['MB_per_rank_R2_float32']:.2f} | {row['MB_per_rank_R2_float64']:.2f} |")
    return "\n".join(lines)


def iblm_report(iblm):
    lines = ["I-BLM (init_guide_iblm, default options, AutoNormal, float32): seconds, median "
             "over rounds; 2 processes: each passes half the rows and process_group",
             "", "| problem | N | " + " | ".join(s[0] for s in IBLM_SETUPS)
             + " | speed-up | collective calls (2 processes) | elements received per rank "
             "| as DDP gradient all-reduces of AutoNormal (2 x weights) |",
             "|---|---|" + "---|" * len(IBLM_SETUPS) + "---|---|---|---|"]
    for row in iblm["times"]:
        cells = [f"{row[s[0]]:.2f} s" for s in IBLM_SETUPS]
        speedup = row[IBLM_SETUPS[0][0]] / row[IBLM_SETUPS[1][0]]
        lines.append(f"| {row['problem']} | {row['rows']} | " + " | ".join(cells)
                     + f" | {speedup:.2f}x | {row['collectives']} | "
                     f"{row['elements_received']:,} | "
                     f"{row['elements_received'] / row['parameters']:.1f} |")
    return "\n".join(lines)


def main(args):
    problems = PROBLEMS[:1] if args.quick else PROBLEMS
    path = os.path.join(args.out, "bench_distributed.json")
    if args.part == "iblm" and not args.quick:
        with open(path) as f:  # the stored SVI results, kept
            results = json.load(f)
        results["iblm_config"] = vars(args)
        results["iblm_load_average_before"] = os.getloadavg()
        results["iblm"] = run_iblm(IBLM_PROBLEMS, args.rounds)
        results["iblm_load_average_after"] = os.getloadavg()
        write(args, results)
        return
    results = {"config": vars(args), "cpu_count": os.cpu_count(),
               "load_average_before": os.getloadavg()}
    rounds = {s[0]: [] for s in SETUPS}
    for r in range(args.rounds):
        for name, world_size, threads in SETUPS:
            rounds[name].append(run_setup(world_size, threads, problems, args.steps, args.warmup))
            print(f"round {r + 1}/{args.rounds}: {name} done", flush=True)
    results["rounds"] = rounds
    results["times"] = []
    for i, (name, _, batch, _) in enumerate(problems):
        row = {"problem": name, "batch": batch}
        for setup, _, _ in SETUPS:
            row[setup] = statistics.median(run[i][0] for run in rounds[setup])
        row["allreduce"] = statistics.median(run[i][1] for run in rounds[SETUPS[2][0]])
        results["times"].append(row)
    results["communication"] = communication_volume()
    results["load_average_after"] = os.getloadavg()
    if args.part == "all":
        results["iblm_load_average_before"] = os.getloadavg()
        results["iblm"] = run_iblm(IBLM_PROBLEMS[:1] if args.quick else IBLM_PROBLEMS,
                                   args.rounds)
        results["iblm_load_average_after"] = os.getloadavg()
    write(args, results)


def _load(values):
    return tuple(round(v, 2) for v in values)


def write(args, results):
    text = report(results)
    text += "\n\nLoad average (1, 5, 15 min) before / after the run, on {} cores: {} / {}".format(
        os.cpu_count(), _load(results["load_average_before"]),
        _load(results["load_average_after"]))
    if "iblm" in results:
        text += "\n\n" + iblm_report(results["iblm"])
        text += "\n\nLoad average before / after the I-BLM runs, on {} cores: {} / {}".format(
            os.cpu_count(), _load(results["iblm_load_average_before"]),
            _load(results["iblm_load_average_after"]))
    print(text)
    if not args.quick:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "bench_distributed.json"), "w") as f:
            json.dump(results, f, indent=2)
        with open(os.path.join(args.out, "bench_distributed.md"), "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    parser = make_parser(__doc__, threads=False, tag=False, quick_help="one small round, no files")
    parser.add_argument("--part", choices=["all", "iblm"], default="all",
                        help="iblm: time only I-BLM, keeping the stored SVI results")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40, help="timed steps per measurement")
    parser.add_argument("--warmup", type=int, default=5)
    main(parse_args(parser, quick={"rounds": 1, "steps": 5, "warmup": 2}))
