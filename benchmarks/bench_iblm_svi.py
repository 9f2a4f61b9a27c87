"""
The comparison of [1] on our data: test error (or RMSE) and test MNLL versus
SVI iteration after each of the seven initializations, plus an ablation of
I-BLM's calibrated defaults against the literal recipe, right after init.

Problems (AutoNormal guide, N(0, 1/D_in) priors; the problems, the SVI runs and
the figure are those of ``examples/initializer_comparison.py``, this script adds
the speed-up, the ablation and the result files):

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

    python benchmarks/bench_iblm_svi.py                       # full run (~5 minutes)
    python benchmarks/bench_iblm_svi.py --problems digits_mlp diabetes --kl-warmup 400 \
        --tag kl_warmup                                       # KL annealing (~2 minutes)
    python benchmarks/bench_iblm_svi.py --problems digits_mlp --steps 200
    python benchmarks/bench_iblm_svi.py --quick               # smoke run

[1] Rossi, Michiardi, Filippone (2019) "Good Initializations of Variational
Bayes for Deep Models"
"""

import argparse
import json
import math
import os
import time

import pyro
import pyro.poutine as poutine
import torch
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoNormal
from torch import nn

from pyro_vinit import init_guide
from pyro_vinit.data import load_diabetes, load_digits, toy_regression
from pyro_vinit.metrics import classification_metrics, regression_metrics
from pyro_vinit.nn import BayesianClassifier, BayesianRegressor, bayesianize, mlp
from pyro_vinit.poutine import KLAnnealingMessenger
from pyro_vinit.schedules import LinearWarmup

HERE = os.path.dirname(os.path.abspath(__file__))

# The problems, the SVI runs and the figure are those of
# ``examples/initializer_comparison.py`` (kept in step with it by hand: examples and
# benchmarks do not import each other).
METHODS = ["iblm", "uninformative", "heuristic", "xavier", "orthogonal", "lsuv", "map"]


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
    I-BLM is the thick black line.
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
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    name = "bench_iblm_svi" + (f"_{args.tag}" if args.tag else "")
    with open(os.path.join(HERE, "results", name + ".json"), "w") as f:
        json.dump(results, f, indent=2)
    plot_curves({p: r["curves"] for p, r in results["problems"].items()},
                os.path.join(HERE, "results", name + ".png"))


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
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--problems", nargs="+", default=list(PROBLEMS), choices=list(PROBLEMS))
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=None, help="SVI steps (default per problem)")
    parser.add_argument("--eval-every", type=int, default=40)
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--kl-warmup", type=int, default=0,
                        help="KL annealing: λ grows linearly from 0 to 1 over this many steps")
    parser.add_argument("--tag", default="", help="suffix of the result files")
    parser.add_argument("--quick", action="store_true", help="tiny run, no files")
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.steps, args.eval_every, args.samples = 1, 10, 5, 2
    main(args)
