"""
Where the time of one SVI step goes: cProfile of AutoKTiedNormal(rank=2) +
``local_reparam()`` + TraceMeanField_ELBO, and of Pyro's AutoNormal with and
without ``local_reparam()``, on 64→400→400→10, batch 128, validation off.

Prints, per configuration, the wall time per step and the functions with the
largest own time (tottime) and cumulative time, the latter grouped by where
the code lives (``pyro_vinit``, ``pyro``, ``torch``), so that the Python
overhead can be told from the arithmetic (which cProfile books on the torch
builtins: ``F.linear``, ``Tensor.backward``, the optimizer's ``_foreach`` ops).

Usage::

    python -m benchmarks.profile_lrt               # all three configurations
    python -m benchmarks.profile_lrt --steps 200 --top 25
"""

import cProfile
import io
import pstats
import time
from collections import defaultdict

import pyro
import torch
from pyro.infer import SVI, TraceMeanField_ELBO
from pyro.infer.autoguide import AutoNormal

from benchmarks.harness import make_parser, parse_args
from pyro_vinit import AutoKTiedNormal, local_reparam
from pyro_vinit.nn import BayesianClassifier, bayesianize, mlp

SIZES = (64, 400, 400, 10)


def make_step(guide_cls, lrt, num_data=1437, batch=128, **kwargs):
    pyro.set_rng_seed(0)
    model = BayesianClassifier(bayesianize(mlp(SIZES)), num_data=num_data)
    guide = guide_cls(model, **kwargs)
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 1e-3}), TraceMeanField_ELBO())
    x, y = torch.randn(batch, SIZES[0]), torch.randint(0, SIZES[-1], (batch,))
    step = local_reparam(svi.step) if lrt else svi.step
    return lambda: step(x, y)


CONFIGS = {
    "AutoKTiedNormal(rank=2) + local_reparam()": (AutoKTiedNormal, True, {"rank": 2}),
    "AutoNormal + local_reparam()": (AutoNormal, True, {}),
    "AutoNormal": (AutoNormal, False, {}),
}


def where(filename):
    for part in ("pyro_vinit", "pyro", "torch"):
        if f"/{part}/" in filename:
            return part
    return "builtins" if filename == "~" else "other"


def profile(step, steps, top):
    for _ in range(10):  # warm-up (parameters created, caches filled)
        step()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    ms = (time.perf_counter() - start) / steps * 1e3
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        step()
    prof.disable()
    stats = pstats.Stats(prof)
    own = defaultdict(float)
    for (filename, _, _), (_, _, tottime, _, _) in stats.stats.items():
        own[where(filename)] += tottime
    total = sum(own.values())
    out = io.StringIO()
    stats.stream = out
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    return ms, {k: v / total for k, v in own.items()}, out.getvalue()


def main(args):
    torch.set_num_threads(args.threads)
    pyro.enable_validation(False)
    pyro.settings.set(module_local_params=True)
    for name, (cls, lrt, kwargs) in CONFIGS.items():
        ms, shares, text = profile(make_step(cls, lrt, **kwargs), args.steps, args.top)
        print(f"\n=== {name}: {ms:.2f} ms/step unprofiled")
        print("own time by package: " + ", ".join(
            f"{k} {v:.0%}" for k, v in sorted(shares.items(), key=lambda kv: -kv[1])))
        if not args.quiet:
            print(text)


if __name__ == "__main__":
    parser = make_parser(__doc__, out=False, tag=False, quick_help="a few steps")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--quiet", action="store_true", help="the summary lines only")
    main(parse_args(parser, quick={"steps": 5}))
