"""
The comparison of [1] on our data: test error (or RMSE) and test MNLL versus
SVI iteration after each of the seven initializations, plus an ablation of
I-BLM's calibrated defaults against the literal recipe, right after init.

Problems (AutoNormal guide, N(0, 1/D_in) priors; the problems, the SVI runs and
the figure are :mod:`pyro_vinit.testing.paper_problems`, shared with
``examples/initializer_comparison.py``; this script adds the speed-up, the
ablation and the result files):

* ``digits_mlp``: scikit-learn digits, ReLU MLP 64-100×5-10;
* ``digits_cnn``: digits as 8×8 images, conv(8, 3×3) → ReLU → conv(16, 3×3,
  stride 2) → ReLU → linear(10);
* ``toy``: f(x) = sin x + sin x/2 + sin x/3 − sin x/4 + N(0, e⁻²) on
  [−10, 10] (500 training points), tanh MLP 1-500×3-1 (Figure 1 of [1]),
  likelihood noise e⁻¹;
* ``diabetes``: scikit-learn diabetes (standardized), ReLU MLP 10-100×5-1,
  likelihood noise 0.7.

SVI uses the paper's optimizer, Adam with lr 1e-3, minibatches of 64 and
Trace_ELBO with one sample, the likelihood scaled to the full training set.
To fit the 2 shared cores of the development machine the run is cut down
from the paper's: ``--repeats 2`` seeds, 400 SVI steps (300 for the large
toy network; one step of these small networks takes ~20 ms in Pyro), test
metrics every 40 steps from 16 posterior samples (the paper: 128), one
thread. I-BLM uses batches of 128 (512 images for the CNN, whose
last layer has 257 inputs: each unit's regression should have more rows
than inputs). MAP runs Adam at lr 1e-2 for the same wall-clock time as
I-BLM took on the same seed, i.e. the comparison is at equal
initialization cost.

The "speed-up" is the number of SVI steps the best baseline (by final test
MNLL, mean over seeds) needs to first reach its final MNLL, divided by the
steps I-BLM needs to reach the same value (a lower bound when I-BLM is there
at step 0, counted as one evaluation interval); it is computed against the
paper's five baselines and against all six (with MAP).

With the full KL term, SVI at this learning rate washes a good start out on
these small data sets (the KL of tens of thousands of weights to their prior
outweighs a thousand data points); ``--kl-warmup`` anneals it instead
(:class:`~pyro_vinit.poutine.KLAnnealingMessenger`, λ linear from 0 to 1).

Usage::

    python -m benchmarks.bench_iblm_svi                       # full run (~5 minutes)
    python -m benchmarks.bench_iblm_svi --problems digits_mlp diabetes --kl-warmup 400 \
        --tag kl_warmup                                       # KL annealing (~2 minutes)
    python -m benchmarks.bench_iblm_svi --problems digits_mlp --steps 200
    python -m benchmarks.bench_iblm_svi --quick               # smoke run

[1] Rossi, Michiardi, Filippone (2019) "Good Initializations of Variational
Bayes for Deep Models"
"""

import time

import torch

from benchmarks.harness import make_parser, parse_args, result_stem, write_json
from pyro_vinit import init_guide
from pyro_vinit.testing.paper_problems import INITIALIZERS as METHODS
from pyro_vinit.testing.paper_problems import (
    PROBLEMS,
    compare,
    evaluate,
    iblm_batch_size,
    make,
    plot_curves,
)

_PAPER = dict(hidden_batches="random", propagate="sample")
ABLATION = {
    "classification": {
        "calibrated (default)": {},
        "random hidden batches": dict(hidden_batches="random"),
        "sampled propagation": dict(propagate="sample"),
        "targets not centered": dict(center_targets=False),
        "paper recipe": dict(center_targets=False, **_PAPER),
    },
    "regression": {
        "calibrated (default)": {},
        "random hidden batches": dict(hidden_batches="random"),
        "sampled propagation": dict(propagate="sample"),
        "one target sign": dict(alternate_hidden_signs=False),
        "paper recipe": dict(alternate_hidden_signs=False, **_PAPER),
    },
}


def speedup(curves, baselines, eval_every):
    """SVI steps the best of ``baselines`` (by final mean test MNLL) needs to reach
    its final MNLL, over the steps I-BLM needs to reach the same value. A step-0
    I-BLM counts as one evaluation interval, so the ratio is then a lower bound."""
    final = {m: curves[m]["mnll"][-1] for m in baselines}
    best = min(final, key=final.get)
    target = final[best]

    def first(c):
        return next((s for s, v in zip(c["step"], c["mnll"]) if v <= target), None)

    iblm_step, best_step = first(curves["iblm"]), first(curves[best])
    ratio = None
    if iblm_step is not None and best_step:
        ratio = best_step / max(iblm_step, eval_every)
    return {"best_baseline": best, "target_mnll": target, "best_baseline_step": best_step,
            "iblm_step": iblm_step, "speedup": ratio, "speedup_is_lower_bound": iblm_step == 0}


def ablation(problem, data, args):
    x, y, x_test, y_test = data
    rows = {}
    for name, options in ABLATION[PROBLEMS[problem]["task"]].items():
        metrics = []
        for r in range(args.repeats):
            model, guide = make(problem, data, 100 + r)
            init_guide(guide, (x, y), method="iblm", batch_size=iblm_batch_size(problem),
                       **options)
            metrics.append(evaluate(problem, model, guide, x_test, y_test, args.samples))
        rows[name] = {k: sum(m[k] for m in metrics) / len(metrics) for k in ("error", "mnll")}
    return rows


def main(args):
    torch.set_num_threads(args.threads)
    results = {"setup": {k: v for k, v in vars(args).items()}, "problems": {}}
    for problem in args.problems:
        start = time.perf_counter()
        data = PROBLEMS[problem]["data"]()
        # MAP gets the wall-clock budget I-BLM used on the same seed (see compare).
        curves, init_times = compare(
            problem, data, repeats=args.repeats, steps=args.steps or PROBLEMS[problem]["steps"],
            eval_every=args.eval_every, num_samples=args.samples, batch_size=args.batch_size,
            kl_warmup=args.kl_warmup,
        )
        for method, c in curves.items():
            print(f"{problem:>10} {method:>13}: init {init_times[method]:6.2f}s  "
                  f"error {c['error'][0]:.3f} -> {c['error'][-1]:.3f}  "
                  f"mnll {c['mnll'][0]:.3f} -> {c['mnll'][-1]:.3f}", flush=True)
        summary = {
            "paper_baselines": speedup(curves, METHODS[1:6], args.eval_every),
            "all_baselines": speedup(curves, METHODS[1:], args.eval_every),
        }
        abl = ablation(problem, data, args)
        results["problems"][problem] = {
            "task": PROBLEMS[problem]["task"], "curves": curves, "init_seconds": init_times,
            "speedup": summary, "ablation_right_after_init": abl,
            "wall_seconds": time.perf_counter() - start,
        }
        print(f"{problem}: {summary}")
        for name, m in abl.items():
            print(f"    ablation {name:>34}: error {m['error']:.3f}  mnll {m['mnll']:.3f}")
        print(f"    ({time.perf_counter() - start:.0f}s)", flush=True)
    print_tables(results)
    if args.quick:
        return
    stem = result_stem(args, "bench_iblm_svi")
    write_json(stem + ".json", results)
    plot_curves({p: r["curves"] for p, r in results["problems"].items()}, stem + ".png")


def print_tables(results):
    for problem, res in results["problems"].items():
        err = "error" if res["task"] == "classification" else "RMSE"
        last = res["curves"]["iblm"]["step"][-1]
        print(f"\n{problem}: test {err} / MNLL at SVI step 0 and {last}")
        print(f"| init | {err} @0 | {err} @end | MNLL @0 | MNLL @end | init (s) |")
        print("|---|---:|---:|---:|---:|---:|")
        for m, c in res["curves"].items():
            print(f"| {m} | {c['error'][0]:.3f} | {c['error'][-1]:.3f} | {c['mnll'][0]:.3f} | "
                  f"{c['mnll'][-1]:.3f} | {res['init_seconds'][m]:.2f} |")
        for which, s in res["speedup"].items():
            bound = "≥ " if s["speedup_is_lower_bound"] else ""
            ratio = "n/a" if s["speedup"] is None else f"{bound}{s['speedup']:.0f}×"
            print(f"{which}: best {s['best_baseline']} reaches its final MNLL "
                  f"{s['target_mnll']:.3f} at step {s['best_baseline_step']}; I-BLM at step "
                  f"{s['iblm_step']} (speed-up {ratio})")


if __name__ == "__main__":
    parser = make_parser(__doc__, quick_help="tiny run, no files")
    parser.add_argument("--problems", nargs="+", default=list(PROBLEMS), choices=list(PROBLEMS))
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=None, help="SVI steps (default per problem)")
    parser.add_argument("--eval-every", type=int, default=40)
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--kl-warmup", type=int, default=0,
                        help="KL annealing: λ grows linearly from 0 to 1 over this many steps")
    main(parse_args(parser, quick={"repeats": 1, "steps": 10, "eval_every": 5, "samples": 2}))
