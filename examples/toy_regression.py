"""
Toy regression: a deep Bayesian MLP trained from a random start and from an
I-BLM start, in the spirit of Figure 1 of Rossi et al. [1].

The data are the paper's toy problem (:func:`pyro_vinit.data.toy_regression`):
500 points :math:`x \\sim U[-10, 10]`,
:math:`y = \\sin x + \\sin(x/2) + \\sin(x/3) - \\sin(x/4) + \\varepsilon`,
:math:`\\varepsilon \\sim \\mathcal N(0, e^{-2})`. The model is a 1-500-500-500-1
tanh MLP with N(0, 1/D_in) priors (about 500,000 weights) and a Normal
likelihood with the true noise scale :math:`e^{-1}`; the guide is AutoNormal.
Two starts get the same budget of :func:`~pyro_vinit.fit` steps, with fit's
configuration (:func:`~pyro_vinit.fit_config`: Adam at 1e-3,
TraceMeanField_ELBO, the KL term weighted by 0.01, under
:func:`~pyro_vinit.poutine.local_reparam`, minibatches of 128):

- ``random``: the weight means drawn from the prior (``init_to_sample``, the
  usual random initialization of a deterministic network) and AutoNormal's
  default ``init_scale=0.1``, trained by ``fit(..., init=None)``;
- ``iblm``: fit's own start, :func:`~pyro_vinit.initialization.init_guide_iblm`
  with fit's options (stds capped at a tenth of the prior's) except for its
  rows per unit: 128 (``--iblm-batch-size``) instead of fit's 250 (512, at
  most half the data), a slightly better start here (see the tutorial
  page). ``fit(model, guide, (x, y), init_options={"batch_size": 128})``
  runs the same I-BLM itself; the script runs it first, to plot the start,
  and then calls ``fit(..., init=None)``.

The script plots the predictive mean ± 2 standard deviations (weight
uncertainty plus the likelihood noise) on a grid over the data, right after
initialization and after training, and reports the test RMSE and MNLL
(:mod:`pyro_vinit.metrics`) along the way.

Usage::

    python examples/toy_regression.py            # a few minutes on 2 cores
    python examples/toy_regression.py --quick    # smoke run, seconds
    python examples/toy_regression.py --kl-weight 1   # the full ELBO, for comparison

[1] Rossi, Michiardi, Filippone (2019) "Good Initializations of Variational
Bayes for Deep Models"
"""

import argparse
import math
import os
import time

import pyro
import torch
from pyro.infer import Predictive
from pyro.infer.autoguide import AutoNormal, init_to_sample
from torch import nn

from pyro_vinit import FitConfig, fit, init_guide_iblm
from pyro_vinit.data import toy_function, toy_regression
from pyro_vinit.metrics import regression_metrics
from pyro_vinit.nn import BayesianRegressor, bayesianize, mlp

from _outputs import save_results

INITS = ["random", "iblm"]
NOISE = math.exp(-1)  # the data's noise scale, used as the likelihood's
FIT = FitConfig()  # fit's defaults, which every training flag below starts from


def make_model(width, depth, num_data):
    sizes = (1,) + (width,) * depth + (1,)
    return BayesianRegressor(bayesianize(mlp(sizes, nn.Tanh)), noise_scale=NOISE,
                             num_data=num_data)


def initialized_guide(init, model, x, y, iblm_batch_size):
    if init == "random":
        guide = AutoNormal(model, init_loc_fn=init_to_sample)
        guide(x, y)  # draws the means now, before anything else touches the RNG
    elif init == "iblm":
        # the I-BLM of fit(model, guide, (x, y), init_options={"batch_size": iblm_batch_size})
        guide = init_guide_iblm(AutoNormal(model), (x, y),
                                batch_size=min(iblm_batch_size, len(x)),
                                max_scale_ratio=FIT.max_scale_ratio)
    else:
        raise ValueError(f"unknown init {init!r}, expected one of {INITS}")
    return guide


@torch.no_grad()
def predict(model, guide, x, num_samples):
    """Network outputs of ``num_samples`` posterior draws, shape ``(S, N)``."""
    predictive = Predictive(model, guide=guide, num_samples=num_samples,
                            return_sites=["_RETURN"])
    return predictive(x)["_RETURN"]


def snapshot(model, guide, data, grid, num_samples):
    """Test metrics and the predictive band on ``grid``."""
    _, _, x_test, y_test = data
    metrics = regression_metrics(y_test, loc=predict(model, guide, x_test, num_samples),
                                 scale=NOISE)
    f = predict(model, guide, grid, num_samples)
    # the predictive of y adds the likelihood noise to the spread of the means
    sd = (f.var(0) + NOISE**2).sqrt()
    return {**metrics, "mean": f.mean(0).tolist(), "sd": sd.tolist()}


def train(init, data, grid, args):
    x, y, x_test, y_test = data
    pyro.clear_param_store()
    pyro.set_rng_seed(args.seed)
    model = make_model(args.width, args.depth, len(x))
    start = time.perf_counter()
    guide = initialized_guide(init, model, x, y, args.iblm_batch_size)
    init_seconds = time.perf_counter() - start
    before = snapshot(model, guide, data, grid, args.num_samples)

    # the guide is initialized: fit trains it from there, with its configuration
    start = time.perf_counter()
    history = fit(model, guide, (x, y), steps=args.steps, batch_size=args.batch_size,
                  lr=args.lr, kl_weight=args.kl_weight, init=None,
                  validation=(x_test, y_test), eval_every=args.eval_every,
                  num_samples=args.eval_samples, progress=not args.quick)
    svi_seconds = time.perf_counter() - start
    after = snapshot(model, guide, data, grid, args.num_samples)
    return {"init_seconds": init_seconds, "svi_seconds": svi_seconds,
            "step_0": before, f"step_{args.steps}": after,
            "curve": [{**c, "step": int(c["step"])} for c in history.validation]}


def plot(args, data, grid, results):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x, y = data[0][:, 0], data[1]
    g = grid[:, 0]
    stages = ["step_0", f"step_{args.steps}"]
    fig, axes = plt.subplots(len(stages), len(INITS), figsize=(5.2 * len(INITS), 3.4 * len(stages)),
                             sharex=True, sharey=True, squeeze=False)
    for i, stage in enumerate(stages):
        for j, init in enumerate(INITS):
            ax, r = axes[i, j], results[init][stage]
            mean, sd = torch.tensor(r["mean"]), torch.tensor(r["sd"])
            ax.fill_between(g, mean - 2 * sd, mean + 2 * sd, color="C0", alpha=0.25,
                            label="mean ± 2 sd")
            ax.plot(g, toy_function(g), color="k", lw=1, ls="--", label="true f")
            ax.scatter(x, y, s=3, color="C3", alpha=0.5, label="training data")
            ax.plot(g, mean, color="C0", lw=1.8, label="predictive mean")
            when = "after init" if stage == "step_0" else f"after {args.steps} fit steps"
            ax.set_title(f"{init}, {when}: test RMSE {r['rmse']:.2f}, MNLL {r['mnll']:.2f}",
                         fontsize=9)
            ax.set_ylim(-6, 6)
    for ax in axes[-1]:
        ax.set_xlabel("x")
    for ax in axes[:, 0]:
        ax.set_ylabel("y")
    axes[0, 0].legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    paths = [os.path.join(args.out_dir, "toy_regression.png")]
    fig.savefig(paths[0], dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2))
    for init in INITS:
        steps = [c["step"] for c in results[init]["curve"]]
        for ax, key in zip(axes, ("rmse", "mnll")):
            ax.plot(steps, [c[key] for c in results[init]["curve"]], label=init)
    for ax, label in zip(axes, ("test RMSE", "test MNLL")):
        ax.set_xlabel(f"fit step (Adam, lr {args.lr:g}, KL weight {args.kl_weight:g})")
        ax.set_ylabel(label)
    axes[0].legend()
    fig.tight_layout()
    paths.append(os.path.join(args.out_dir, "learning_curves.png"))
    fig.savefig(paths[1], dpi=110)
    plt.close(fig)
    return paths


def main(args):
    torch.set_num_threads(args.threads)
    data = toy_regression(seed=args.data_seed)
    grid = torch.linspace(-args.grid_limit, args.grid_limit, args.grid_points).unsqueeze(-1)
    start = time.perf_counter()
    results = {init: train(init, data, grid, args) for init in INITS}
    elapsed = time.perf_counter() - start

    final = f"step_{args.steps}"
    print(f"| init | RMSE @0 | RMSE @{args.steps} | MNLL @0 | MNLL @{args.steps} "
          "| init (s) | SVI (s) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for init, r in results.items():
        print(f"| {init} | {r['step_0']['rmse']:.3f} | {r[final]['rmse']:.3f} "
              f"| {r['step_0']['mnll']:.3f} | {r[final]['mnll']:.3f} "
              f"| {r['init_seconds']:.2f} | {r['svi_seconds']:.0f} |")
    print(f"\ntotal time {elapsed:.0f} s")

    summary = {
        init: {stage: {k: r[stage][k] for k in ("rmse", "mnll")}
               for stage in ("step_0", final)}
        for init, r in results.items()
    }
    save_results(args.out_dir, {"config": vars(args), "seconds": elapsed, "summary": summary,
                                "grid": grid[:, 0].tolist(), "results": results},
                 lambda: plot(args, data, grid, results))
    return summary


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=500)
    parser.add_argument("--depth", type=int, default=3, help="hidden layers")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--lr", type=float, default=FIT.lr, help="Adam's (fit's default)")
    parser.add_argument("--batch-size", type=int, default=128, help="fit's default")
    parser.add_argument("--kl-weight", type=float, default=FIT.kl_weight,
                        help="the weight of the KL term (fit's default; 1: the full ELBO)")
    parser.add_argument("--iblm-batch-size", type=int, default=128,
                        help="I-BLM's rows per unit (fit's is 250 here: 512, at most half "
                        "the data)")
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--eval-samples", type=int, default=16,
                        help="posterior samples of the learning-curve metrics")
    parser.add_argument("--num-samples", type=int, default=100,
                        help="posterior samples of the figure and the final metrics")
    parser.add_argument("--grid-points", type=int, default=400)
    parser.add_argument("--grid-limit", type=float, default=12.0,
                        help="the plot covers [-limit, limit]; the data lie in [-10, 10]")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data-seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out-dir", default="results/toy_regression")
    parser.add_argument("--quick", action="store_true", help="smoke run (seconds)")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.eval_every = 10, 5
        args.eval_samples, args.num_samples, args.grid_points = 4, 8, 100
    return args


if __name__ == "__main__":
    main(parse_args())
