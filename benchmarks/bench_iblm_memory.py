"""
I-BLM's peak resident memory and time versus width, on a wide network.

Bayesian MLP 20-h-h-3 (tanh and ReLU, N(0, 1/D_in) priors) on 2,000 rows of
3-class Gaussian blobs, AutoNormal, I-BLM with its defaults, one thread. Each
configuration runs in a fresh process, which reports its peak resident set
size (``ru_maxrss``) after setting the guide up (Pyro's own cost: the model's
prototype trace and the guide's parameters) and after I-BLM, and I-BLM's
wall time. The issue's target: at most 1 GB for h = 4000.

Usage::

    python -m benchmarks.bench_iblm_memory            # full run (a few minutes)
    python -m benchmarks.bench_iblm_memory --quick    # smoke run
"""

import json
import os
import subprocess
import sys

from benchmarks.harness import make_parser, parse_args, result_stem, write_json

_CHILD = r"""
import json, resource, sys, time
import torch
torch.set_num_threads(1)
import pyro
from pyro.infer.autoguide import AutoNormal
from pyro_vinit import init_guide_iblm
from pyro_vinit.nn import BayesianClassifier, bayesianize, mlp
from pyro_vinit.testing.user_models import blobs

width, activation, rows = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
pyro.set_rng_seed(0)
x, y, _, _ = blobs(num_classes=3, dim=20, n=rows)
act = torch.nn.Tanh if activation == "tanh" else torch.nn.ReLU
model = BayesianClassifier(bayesianize(mlp((20, width, width, 3), act)), num_data=len(x))
guide = AutoNormal(model)
with torch.no_grad():
    guide(x[:8], y[:8])
setup = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
start = time.perf_counter()
init_guide_iblm(guide, (x, y))
seconds = time.perf_counter() - start
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps({"width": width, "activation": activation, "setup_peak_mb": setup,
                  "init_peak_mb": peak, "init_seconds": seconds,
                  "num_weights": 20 * width + width * width + 3 * width}))
"""


def main(args):
    rows = []
    for width in args.widths:
        for activation in args.activations:
            out = subprocess.run(
                [sys.executable, "-c", _CHILD, str(width), activation, str(args.rows)],
                capture_output=True, text=True, check=True,
                env={**os.environ, "OMP_NUM_THREADS": "1"},
            )
            row = json.loads(out.stdout.strip().splitlines()[-1])
            rows.append(row)
            print(f"h={width} {activation}: peak {row['init_peak_mb']:.0f} MB "
                  f"(after setup {row['setup_peak_mb']:.0f} MB), {row['init_seconds']:.1f} s",
                  flush=True)
    print()
    print("| h | activation | weights | peak after setup (MB) | peak after I-BLM (MB) "
          "| I-BLM (s) |")
    print("|---:|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['width']} | {r['activation']} | {r['num_weights']:,} | "
              f"{r['setup_peak_mb']:.0f} | {r['init_peak_mb']:.0f} | {r['init_seconds']:.1f} |")
    if args.quick:
        return
    result = {"setup": {"model": "MLP 20-h-h-3, N(0, 1/D_in) priors", "guide": "AutoNormal",
                        "data": f"{args.rows} rows of 3-class Gaussian blobs", "threads": 1},
              "rows": rows}
    write_json(result_stem(args, "bench_iblm_memory") + ".json", result)


if __name__ == "__main__":
    parser = make_parser(__doc__, threads=False, tag=False, quick_help="small widths, no files")
    parser.add_argument("--widths", type=int, nargs="+", default=[100, 500, 1000, 2000, 4000])
    parser.add_argument("--activations", nargs="+", default=["tanh", "relu"])
    parser.add_argument("--rows", type=int, default=2000)
    main(parse_args(parser, quick={"widths": [50, 100], "activations": ["relu"], "rows": 300}))
