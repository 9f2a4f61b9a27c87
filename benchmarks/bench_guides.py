"""
SVI step time and parameter count of AutoKTiedNormal (k = 1, 2, 3) and
AutoRadialNormal against Pyro's AutoNormal, side by side in one run.

Bayesian MLP 64→400→400→10 (N(0, 1/D_in) priors) on scikit-learn digits,
minibatches of 128, CPU. The guides are timed in interleaved rounds (every
guide runs one block of steps per round), and each guide's time is the median
over rounds of its per-step time, so that machine noise hits all guides alike;
ratios are to AutoNormal with the same ELBO.

Usage::

    python -m benchmarks.bench_guides            # full run (~2 minutes)
    python -m benchmarks.bench_guides --quick    # smoke run
"""

import statistics
import time

import pyro
import torch
from pyro.infer import SVI, Trace_ELBO, TraceMeanField_ELBO
from pyro.infer.autoguide import AutoNormal
from tqdm import tqdm

from benchmarks.harness import make_parser, result_stem, write_json
from benchmarks.harness import parse_args as harness_parse_args
from pyro_vinit import AutoKTiedNormal, AutoRadialNormal
from pyro_vinit.data import load_digits
from pyro_vinit.nn import BayesianClassifier, bayesianize, mlp

GUIDES = {
    "AutoNormal": lambda m: AutoNormal(m),
    "AutoKTiedNormal(k=1)": lambda m: AutoKTiedNormal(m, rank=1),
    "AutoKTiedNormal(k=2)": lambda m: AutoKTiedNormal(m, rank=2),
    "AutoKTiedNormal(k=3)": lambda m: AutoKTiedNormal(m, rank=3),
    "AutoRadialNormal": lambda m: AutoRadialNormal(m),
}
ELBOS = {"Trace_ELBO": Trace_ELBO, "TraceMeanField_ELBO": TraceMeanField_ELBO}


def make_svi(name, elbo, x, y, sizes):
    model = BayesianClassifier(bayesianize(mlp(sizes)), num_data=len(x))
    guide = GUIDES[name](model)
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 1e-3}), ELBOS[elbo]())
    svi.step(x[:128], y[:128])  # set up the guide
    num_params = sum(p.numel() for p in guide.parameters())
    return svi, num_params


def main(args):
    torch.set_num_threads(args.threads)
    # The guides are timed side by side, and guides of one class would share parameter
    # names in Pyro's global param store: with module-local parameters each guide owns
    # its own, as an nn.Module does (SVI and its optimizer work the same).
    pyro.settings.set(module_local_params=True)
    pyro.set_rng_seed(0)
    x, y, _, _ = load_digits()
    sizes = (64,) + (args.width,) * args.depth + (10,)
    batches = [torch.randint(0, len(x), (args.batch_size,)) for _ in range(args.steps)]

    results = {"config": vars(args), "sizes": sizes, "elbos": {}}
    for elbo in args.elbos:
        pyro.clear_param_store()
        runs = {name: make_svi(name, elbo, x, y, sizes) for name in GUIDES}
        per_step = {name: [] for name in GUIDES}
        for _ in tqdm(range(args.rounds), desc=elbo):
            for name, (svi, _) in runs.items():
                start = time.perf_counter()
                for idx in batches:
                    svi.step(x[idx], y[idx])
                per_step[name].append((time.perf_counter() - start) / len(batches))
        base = statistics.median(per_step["AutoNormal"])
        base_params = runs["AutoNormal"][1]
        rows = {}
        for name, (_, num_params) in runs.items():
            step = statistics.median(per_step[name])
            rows[name] = {
                "step_ms": 1e3 * step,
                "time_ratio": step / base,
                "num_params": num_params,
                "param_ratio": num_params / base_params,
            }
        results["elbos"][elbo] = rows

    for elbo, rows in results["elbos"].items():
        print(f"\n{elbo}, MLP {'→'.join(map(str, sizes))}, batch {args.batch_size}, "
              f"{args.threads} thread(s), median of {args.rounds} rounds × {args.steps} steps")
        print("| guide | step (ms) | ÷ AutoNormal | variational params | ÷ AutoNormal |")
        print("|---|---:|---:|---:|---:|")
        for name, r in rows.items():
            print(f"| {name} | {r['step_ms']:.2f} | {r['time_ratio']:.2f}× | "
                  f"{r['num_params']:,} | {r['param_ratio']:.2f}× |")

    if not args.quick:
        path = write_json(result_stem(args, "bench_guides") + ".json", results)
        print(f"\nwrote {path}")
    return results


def parse_args(argv=None):
    parser = make_parser(__doc__, quick_help="tiny smoke run, no files")
    parser.add_argument("--width", type=int, default=400)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--steps", type=int, default=50, help="steps per round")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--elbos", nargs="+", default=list(ELBOS), choices=list(ELBOS))
    return harness_parse_args(parser, argv, quick={"width": 32, "steps": 3, "rounds": 2})


if __name__ == "__main__":
    main(parse_args())
