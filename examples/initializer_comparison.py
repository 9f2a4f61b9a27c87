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
linearly from 0 to 1 over the run (:class:`~pyro_vinit.poutine.KLAnnealingMessenger`)
and draws it as a dashed line.

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

import pyro
import pyro.poutine as poutine
import torch
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoNormal
from torch import nn
from tqdm import tqdm

from pyro_vinit import init_guide
from pyro_vinit.data import load_diabetes, load_digits, toy_regression
from pyro_vinit.metrics import classification_metrics, regression_metrics
from pyro_vinit.nn import BayesianClassifier, BayesianRegressor, bayesianize, mlp
from pyro_vinit.poutine import KLAnnealingMessenger
from pyro_vinit.schedules import LinearWarmup

from _outputs import save_results

METHODS = ["iblm", "uninformative", "heuristic", "xavier", "orthogonal", "lsuv", "map"]
WARMUP = "iblm + KL warm-up"


def _cnn():
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(),
        nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.ReLU(),
        nn.Flatten(), nn.Linear(16 * 4 * 4, 10),
    )


# ``batch`` is I-BLM's (and LSUV's) batch size: each unit's regression needs
# well more rows than the layer has inputs, and the CNN's last layer has 257.
PROBLEMS = {
    "digits_mlp": dict(task="classification", data=lambda: load_digits(),
                       net=lambda: mlp((64,) + (100,) * 5 + (10,)), steps=400),
    "digits_cnn": dict(task="classification", data=lambda: load_digits(image=True),
                       net=_cnn, steps=400, batch=512),
    "toy": dict(task="regression", data=lambda: toy_regression(), noise=math.exp(-1),
                net=lambda: mlp((1, 500, 500, 500, 1), nn.Tanh), steps=300),
    "diabetes": dict(task="regression", data=lambda: load_diabetes(), noise=0.7,
                     net=lambda: mlp((10,) + (100,) * 5 + (1,)), steps=400),
}


def iblm_batch_size(problem):
    return PROBLEMS[problem].get("batch", 128)


def make(problem, data, seed):
    """A fresh model and AutoNormal guide for ``problem``, with the RNG seeded
    and the param store cleared."""
    pyro.set_rng_seed(seed)
    pyro.clear_param_store()
    spec = PROBLEMS[problem]
    net = bayesianize(spec["net"]())
    n = len(data[0])
    if spec["task"] == "classification":
        model = BayesianClassifier(net, num_data=n)
    else:
        model = BayesianRegressor(net, noise_scale=spec["noise"], num_data=n)
    return model, AutoNormal(model)


@torch.no_grad()
def evaluate(problem, model, guide, x, y, num_samples):
    """Test ``error`` (error rate or RMSE) and ``mnll`` of the Monte Carlo predictive."""
    outs = []
    for _ in range(num_samples):
        trace = poutine.trace(guide).get_trace(x)
        outs.append(poutine.replay(model, trace=trace)(x))
    outs = torch.stack(outs)
    if PROBLEMS[problem]["task"] == "classification":
        m = classification_metrics(y, logits=outs)
        return {"error": m["error_rate"], "mnll": m["mnll"]}
    m = regression_metrics(y, loc=outs, scale=PROBLEMS[problem]["noise"])
    return {"error": m["rmse"], "mnll": m["mnll"]}


def run_svi(problem, method, data, seed, *, steps, eval_every, num_samples, batch_size=64,
            lr=1e-3, kl_warmup=0, map_seconds=None):
    """
    Initializes a fresh guide with ``method`` and runs SVI on it.

    :param int kl_warmup: If positive, the KL weight grows linearly from 0 to 1
        over this many steps; 0 keeps the full ELBO throughout.
    :param float map_seconds: Wall-clock budget of ``method="map"``.
    :return: The learning curve ``{"step", "error", "mnll"}`` and the seconds
        the initialization took.
    """
    x, y, x_test, y_test = data
    model, guide = make(problem, data, seed)
    start = time.perf_counter()
    # map_steps is unbounded so that map_seconds alone limits MAP
    init_guide(guide, (x, y), method=method, batch_size=iblm_batch_size(problem),
               map_steps=10**6, map_seconds=map_seconds)
    init_seconds = time.perf_counter() - start
    svi = SVI(model, guide, pyro.optim.Adam({"lr": lr}), Trace_ELBO())
    annealing = KLAnnealingMessenger(LinearWarmup(kl_warmup) if kl_warmup else 1.0)
    g = torch.Generator().manual_seed(seed)
    curve = {"step": [], "error": [], "mnll": []}
    for step in range(steps + 1):
        if step % eval_every == 0 or step == steps:
            m = evaluate(problem, model, guide, x_test, y_test, num_samples)
            curve["step"].append(step)
            curve["error"].append(m["error"])
            curve["mnll"].append(m["mnll"])
        if step < steps:
            idx = torch.randint(0, len(x), (batch_size,), generator=g)
            with annealing:
                svi.step(x[idx], y[idx])
            annealing.step()
    return curve, init_seconds


def mean_curves(runs):
    out = {"step": runs[0]["step"]}
    for k in ("error", "mnll"):
        out[k] = [sum(r[k][i] for r in runs) / len(runs) for i in range(len(out["step"]))]
    return out


def warm_up(problem, data):
    """Pays one-time costs (imports, first solves) outside the timed initializations."""
    _, guide = make(problem, data, 0)
    init_guide(guide, data[:2], method="iblm", batch_size=iblm_batch_size(problem))
    init_guide(guide, data[:2], method="map", map_steps=2)


def compare(problem, data, *, methods=METHODS, repeats, steps, eval_every, num_samples,
            batch_size=64, kl_warmup=0, progress=None):
    """
    SVI after each initialization in ``methods``, ``repeats`` seeds each.

    :return: The mean learning curve and the mean initialization time of
        each method, as two dicts keyed by method.
    """
    warm_up(problem, data)
    curves, init_seconds, iblm_seconds = {}, {}, {}
    # MAP is timed against I-BLM, so I-BLM runs first
    for method in sorted(methods, key=lambda m: m != "iblm"):
        runs, secs = [], []
        for seed in range(repeats):
            budget = iblm_seconds.get(seed) if method == "map" else None
            curve, s = run_svi(problem, method, data, seed, steps=steps, eval_every=eval_every,
                               num_samples=num_samples, batch_size=batch_size,
                               kl_warmup=kl_warmup, map_seconds=budget)
            if method == "iblm":
                iblm_seconds[seed] = s
            runs.append(curve)
            secs.append(s)
            if progress is not None:
                progress.update()
        curves[method] = mean_curves(runs)
        init_seconds[method] = sum(secs) / len(secs)
    return curves, init_seconds


def plot_curves(curves_by_problem, path, title=None):
    """
    Test error (top) and test MNLL (bottom) versus SVI step, one column per
    problem; ``curves_by_problem`` maps a problem to ``{method: curve}``.
    I-BLM is the thick black line, I-BLM with KL warm-up (if present) the
    dashed one.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    problems = list(curves_by_problem)
    colors = dict(zip(METHODS[1:], plt.get_cmap("tab10").colors))
    fig, axes = plt.subplots(2, len(problems), figsize=(4.6 * len(problems), 6.8), squeeze=False)
    for j, problem in enumerate(problems):
        regression = PROBLEMS[problem]["task"] == "regression"
        for method, c in curves_by_problem[problem].items():
            if method == "iblm":
                style = dict(lw=2.5, color="k", zorder=3)
            elif method == WARMUP:
                style = dict(lw=2.0, color="k", ls="--", zorder=3)
            else:
                style = dict(lw=1.3, color=colors.get(method))
            axes[0, j].plot(c["step"], c["error"], label=method, **style)
            axes[1, j].plot(c["step"], c["mnll"], label=method, **style)
        axes[0, j].set_title(problem)
        axes[0, j].set_ylabel("test RMSE" if regression else "test error")
        axes[1, j].set_ylabel("test MNLL")
        axes[1, j].set_xlabel("SVI step (Adam, lr 1e-3)")
        axes[1, j].set_yscale("log")
        if regression:  # the uninformative prior's outputs are huge
            axes[0, j].set_yscale("log")
        else:
            axes[0, j].set_ylim(0, 1)
            # an uninformative start has an MNLL in the thousands: keep the
            # scale readable around chance (log 10 = 2.3) and say what is cut
            axes[1, j].set_ylim(0.1, 10)
            cut = [m for m, c in curves_by_problem[problem].items() if min(c["mnll"]) > 10]
            if cut:
                axes[1, j].text(0.98, 0.97, f"off scale (> 10): {', '.join(cut)}", fontsize=8,
                                ha="right", va="top", transform=axes[1, j].transAxes)
    axes[0, 0].legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


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
    total = len(args.problems) * args.repeats * (len(METHODS) + bool(args.kl_warmup))
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
                 f"{args.batch_size}; dashed: I-BLM with the KL weight warmed up from 0 to 1")
        written = [plot_curves(curves, os.path.join(args.out_dir, "initializer_comparison.png"),
                               title=title)]
        for problem, c in curves.items():
            written.append(plot_curves({problem: c}, os.path.join(args.out_dir, f"{problem}.png")))
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
