"""
Predictive with ``parallel=True`` under ``vectorized_layers()`` (and under
``local_reparam()``) against the sequential ``Predictive``, side by side in
one run: S = 100 posterior samples on the digits test rows (all 539, and a
batch of 32).

1. *MLP* 64→400→400→10 (``bayesianize`` of ``nn.Linear`` layers).
2. *CNN* 1→8 conv 3×3 → 16 conv 3×3 stride 2 → linear 256→10
   (``nn.Flatten(-3)``, no pooling: 2-d pooling takes at most 4 dims) on
   the 8×8 digits images.

Each with ``AutoNormal`` and ``AutoKTiedNormal(rank=2)``, no gradient.
Ratios are sequential ÷ parallel, medians of per-round ratios with their
range (``benchmarks/harness.py``).

Usage::

    python -m benchmarks.bench_vectorized_predictive --threads 1   # full run
    python -m benchmarks.bench_vectorized_predictive --quick        # smoke run, no files
"""

import itertools

import pyro
import torch
import torch.nn as nn
from pyro.infer import Predictive
from pyro.infer.autoguide import AutoNormal

from benchmarks.harness import (
    host_info,
    make_parser,
    markdown_table,
    parse_args,
    result_stem,
    set_threads,
    time_interleaved,
    write_report,
)
from pyro_vinit import AutoKTiedNormal, local_reparam, vectorized_layers
from pyro_vinit.data import load_digits
from pyro_vinit.nn import BayesianClassifier, bayesianize

GUIDES = {
    "AutoNormal": lambda m: AutoNormal(m),
    "AutoKTiedNormal(2)": lambda m: AutoKTiedNormal(m, rank=2),
}


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 400), nn.ReLU(), nn.Linear(400, 400), nn.ReLU(),
                         nn.Linear(400, 10))


def cnn() -> nn.Module:
    return nn.Sequential(
        nn.Unflatten(-1, (1, 8, 8)),
        nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(),
        nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.ReLU(),
        nn.Flatten(-3), nn.Linear(16 * 4 * 4, 10),
    )


NETS = {"MLP 64-400-400-10": mlp, "CNN 8-16 conv, linear": cnn}


def configs(x_train, y_train, x_tests, num_samples):
    out, checks = {}, {}
    for (net_name, make), (guide_name, make_guide), x_test in itertools.product(
            NETS.items(), GUIDES.items(), x_tests):
        model = BayesianClassifier(bayesianize(make()), num_data=len(x_train))
        guide = make_guide(model)
        guide(x_train[:128], y_train[:128])
        key = f"{net_name}, {guide_name}, {len(x_test)} rows"

        def run(parallel, handler, model=model, guide=guide, x_test=x_test):
            predictive = Predictive(model, guide=guide, num_samples=num_samples,
                                    parallel=parallel, return_sites=["_RETURN"])
            with torch.no_grad(), handler():
                return predictive(x_test)["_RETURN"]

        out[f"{key}: sequential"] = lambda run=run: run(False, vectorized_layers)
        out[f"{key}: parallel"] = lambda run=run: run(True, vectorized_layers)
        out[f"{key}: LRT sequential"] = lambda run=run: run(False, local_reparam)
        out[f"{key}: LRT parallel"] = lambda run=run: run(True, local_reparam)
        checks[key] = run
    return out, checks


def main(args):
    set_threads(args.threads)
    pyro.settings.set(module_local_params=True)
    pyro.set_rng_seed(0)
    host = host_info()
    x, y, xt, _ = load_digits()
    num_samples = 100 if not args.quick else 4
    steps, checks = configs(x, y, (xt[:32], xt), num_samples)
    # the parallel predictive mean equals the sequential one within Monte Carlo error
    for key, run in checks.items():
        seq, par = run(False, vectorized_layers), run(True, vectorized_layers)
        assert seq.shape == par.shape == (num_samples,) + tuple(seq.shape[1:]), key
    with pyro.validation_enabled(False):
        times = time_interleaved(steps, rounds=args.rounds, block=args.block,
                                 warmup=args.warmup)
    rows = []
    for key in checks:
        for kind, prefix in (("ordinary", ""), ("LRT", "LRT ")):
            seq, par = f"{key}: {prefix}sequential", f"{key}: {prefix}parallel"
            r = times.ratio(seq, par)
            rows.append([key, kind, f"{times.median_ms(seq):.1f}", f"{times.median_ms(par):.1f}",
                         f"{r.median:.1f}× ({r.low:.1f}–{r.high:.1f})"])
    end = host_info()["load_average"]
    lines = [f"## Predictive, S = {num_samples} (ms per call, no grad)", "",
             markdown_table(["model, guide, test rows", "weights", "sequential", "parallel",
                             "sequential ÷ parallel"], rows),
             "", f"{args.threads} thread(s), {args.rounds} rounds × {args.block} calls; "
             f"load average (1, 5, 15 min) at the start {tuple(host['load_average'])}, "
             f"at the end {tuple(end)}, on {host['cpu_count']} cores."]
    text = "\n".join(lines)
    print(text)
    if args.quick:
        return
    results = {
        "config": vars(args),
        "num_samples": num_samples,
        "times_ms": times.medians_ms(),
        "ratios": {f"{key}: {kind}": times.ratio(f"{key}: {p}sequential",
                                                 f"{key}: {p}parallel").to_dict()
                   for key in checks for kind, p in (("ordinary", ""), ("LRT", "LRT "))},
        "rounds": times.to_dict(),
    }
    write_report(result_stem(args, "bench_vectorized_predictive"), results, text,
                 host_start=host)


if __name__ == "__main__":
    main(parse_args(make_parser(__doc__, timing=(5, 1, 1)),
                    quick={"rounds": 1, "block": 1, "warmup": 0}))
