"""
Initializer comparison: test error and test MNLL versus SVI iterations after
each of the seven initializations of Rossi et al. [1] (their Figures 7 and 8),
on a Bayesian MLP and a Bayesian CNN for scikit-learn's digits.

Every run builds the same model (N(0, 1/D_in) priors, an AutoNormal guide),
initializes the guide with :func:`~pyro_vinit.initialization.init_guide`
(``iblm``, ``uninformative``, ``heuristic``, ``xavier``, ``orthogonal``,
``lsuv`` or ``map``) and then runs SVI with the paper's optimizer: Adam at
learning rate 1e-3, minibatches of 64, Trace_ELBO with one sample. MAP gets
the wall-clock time I-BLM took on the same seed, so the two data-driven starts
cost the same. The test metrics come from the Monte Carlo predictive.

With the full KL term, SVI washes a good start out on a data set of 1,257
images. The script therefore also runs I-BLM with the KL weight warmed up
linearly from 0 to 1 over the run (:class:`~pyro_vinit.poutine.KLAnnealingMessenger`,
a dashed line) and with the KL weight 0.1 and ``max_scale_ratio=0.1`` (a
dotted line: the recipe these curves were measured with; ``pyro_vinit.fit``'s
measured default is now 0.01, see the training method page).

The problems and the protocol live in
:mod:`pyro_vinit.testing.paper_problems`, shared with
``benchmarks/bench_iblm_svi.py``.

The problems (``--problems``; ``benchmarks/bench_iblm_svi.py`` runs the same
ones and adds the speed-up table and the I-BLM ablation):

* ``digits_mlp``: ReLU MLP 64-100×5-10;
* ``digits_cnn``: digits as 8×8 images, conv(8, 3×3) → ReLU → conv(16, 3×3,
  stride 2) → ReLU → linear(10);
* ``toy``: the 1-d regression of [1], tanh MLP 1-500×3-1, likelihood noise e⁻¹;
* ``diabetes``: scikit-learn diabetes (standardized), ReLU MLP 10-100×5-1,
  likelihood noise 0.7.

Usage::

    python examples/initializer_comparison.py            # digits MLP and CNN, a few minutes
    python examples/initializer_comparison.py --quick    # smoke run, seconds
    python examples/initializer_comparison.py --problems toy diabetes

[1] Rossi, Michiardi, Filippone (2019) "Good Initializations of Variational
Bayes for Deep Models"
"""

import argparse
import math
import os
import time

import torch
from tqdm import tqdm

from pyro_vinit.testing.paper_problems import INITIALIZERS as METHODS
from pyro_vinit.testing.paper_problems import PROBLEMS, compare, plot_curves

from _outputs import save_results

WARMUP = "iblm + KL warm-up"
RECIPE = "iblm + recipe"
EXTRA_STYLES = {
    WARMUP: dict(lw=2.0, color="k", ls="--", zorder=3),
    RECIPE: dict(lw=2.0, color="k", ls=":", zorder=3),
}


def markdown_table(problem, curves, init_seconds):
    err = "error" if PROBLEMS[problem]["task"] == "classification" else "RMSE"
    last = next(iter(curves.values()))["step"][-1]
    lines = [
        f"{problem}: test {err} and MNLL at SVI step 0 and {last}",
        "",
        f"| init | {err} @0 | {err} @{last} | MNLL @0 | MNLL @{last} | init (s) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for method, c in curves.items():
        seconds = init_seconds.get(method, math.nan)
        lines.append(f"| {method} | {c['error'][0]:.3f} | {c['error'][-1]:.3f} "
                     f"| {c['mnll'][0]:.3f} | {c['mnll'][-1]:.3f} | {seconds:.2f} |")
    return "\n".join(lines)


def main(args):
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    results = {"config": vars(args), "problems": {}}
    extra = bool(args.kl_warmup) + bool(args.recipe)
    total = len(args.problems) * args.repeats * (len(METHODS) + extra)
    progress = tqdm(total=total, desc="SVI runs")
    for problem in args.problems:
        data = PROBLEMS[problem]["data"]()
        steps = args.steps or PROBLEMS[problem]["steps"]
        settings = dict(repeats=args.repeats, steps=steps, eval_every=args.eval_every,
                        num_samples=args.samples, batch_size=args.batch_size)
        curves, init_seconds = compare(problem, data, progress=progress, **settings)
        if args.kl_warmup:
            warm, warm_seconds = compare(problem, data, methods=["iblm"], progress=progress,
                                         kl_warmup=min(args.kl_warmup, steps), **settings)
            curves[WARMUP], init_seconds[WARMUP] = warm["iblm"], warm_seconds["iblm"]
        if args.recipe:
            recipe, recipe_seconds = compare(
                problem, data, methods=["iblm"], progress=progress, kl_weight=0.1,
                iblm_options={"max_scale_ratio": 0.1}, **settings)
            curves[RECIPE], init_seconds[RECIPE] = recipe["iblm"], recipe_seconds["iblm"]
        results["problems"][problem] = {
            "task": PROBLEMS[problem]["task"], "steps": steps,
            "curves": curves, "init_seconds": init_seconds,
        }
    progress.close()
    results["seconds"] = time.perf_counter() - start

    for problem, res in results["problems"].items():
        print("\n" + markdown_table(problem, res["curves"], res["init_seconds"]))
    print(f"\ntotal time {results['seconds']:.0f} s")

    def plot():
        curves = {p: r["curves"] for p, r in results["problems"].items()}
        title = (f"mean of {args.repeats} seeds; AutoNormal, Trace_ELBO, minibatches of "
                 f"{args.batch_size}\ndashed: I-BLM with the KL weight warmed up from 0 to 1; "
                 "dotted: I-BLM with the recipe (KL weight 0.1, stds capped)")
        written = [plot_curves(curves, os.path.join(args.out_dir, "initializer_comparison.png"),
                               title=title, styles=EXTRA_STYLES)]
        for problem, c in curves.items():
            written.append(plot_curves({problem: c}, os.path.join(args.out_dir, f"{problem}.png"),
                                       styles=EXTRA_STYLES))
        return written

    save_results(args.out_dir, results, plot)
    return results


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--problems", nargs="+", default=["digits_mlp", "digits_cnn"],
                        choices=list(PROBLEMS))
    parser.add_argument("--repeats", type=int, default=2, help="seeds per initialization")
    parser.add_argument("--steps", type=int, default=None, help="SVI steps (default per problem)")
    parser.add_argument("--eval-every", type=int, default=20)
    parser.add_argument("--samples", type=int, default=16,
                        help="posterior samples of each test evaluation")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--kl-warmup", type=int, default=400,
                        help="steps of the KL warm-up of the extra I-BLM run (0: no extra run)")
    parser.add_argument("--no-recipe", dest="recipe", action="store_false",
                        help="skip the extra I-BLM run with the training recipe")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out-dir", default="results/initializer_comparison")
    parser.add_argument("--quick", action="store_true", help="smoke run (seconds)")
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats, args.steps, args.eval_every, args.samples = 1, 10, 5, 2
        args.kl_warmup = min(args.kl_warmup, 10)
    return args


if __name__ == "__main__":
    main(parse_args())
