"""
Gradient variance of the minibatch ELBO: ordinary weight sampling, the local
reparameterization trick (LRT) and Flipout, on a Bayesian MLP for digits.

In the spirit of Table 1 of Kingma, Salimans, Welling [1] and of the variance
experiments of Wen et al. [2]: how much noise does each way of sampling the
weights put into a stochastic gradient, and how much of it is left once
there is none?

Setup (the measurement of ``benchmarks/bench_gradient_variance.py``, written
out here on the public API in :func:`train_and_measure`):

- a 64-400-400-400-10 ReLU MLP on scikit-learn's digits with the N(0,
  1/D_in) priors of ``bayesianize`` and a fully factorized Normal guide
  placed at each site (:class:`~pyro_vinit.AutoMeanFieldNormal`), so that
  :class:`~pyro.infer.TraceMeanField_ELBO` uses the closed-form KL and all
  the gradient noise comes from the likelihood term; the guide's means
  start at a draw from the prior and its standard deviations at 0.1
  (AutoNormal's default);
- the KL weighted by N/60 000, the per-example KL weight of [1]'s MNIST
  runs: with the full KL, 1257 images cannot pull 370k weights off their
  prior, the network stays at chance and its gradients are those of noise;
- trained for 10 and then 100 epochs with :func:`~pyro_vinit.fit`'s
  configuration (:func:`~pyro_vinit.fit_config`: Adam at 1e-3,
  TraceMeanField_ELBO, under :func:`~pyro_vinit.poutine.local_reparam`;
  minibatches of 128) except for two settings of [1]'s protocol, kept
  because this is a measurement of that protocol, not a recipe: the KL
  weight N/60 000 above (fit's is 0.01) and the random start (fit starts
  from I-BLM, with standard deviations at most a tenth of the prior's: a
  narrow posterior, which, like ``--init-scale 0.01``'s, leaves less weight
  noise to remove);
- at each of these two points, for minibatches of 128 and of 1000 images
  (drawn without replacement), 100 gradients of the minibatch loss with
  respect to the means of the bottom (64→400) and the top (400→10) weights,
  each with a new minibatch and new weight noise, for each estimator:

  * *ordinary*: one weight sample shared by the whole minibatch;
  * *LRT* (:class:`~pyro_vinit.poutine.LocalReparamMessenger`): the
    pre-activations of each example sampled from their Gaussian marginal;
  * *Flipout* (:class:`~pyro_vinit.poutine.FlipoutMessenger`): one weight
    sample, decorrelated across examples by random sign flips;
  * *no weight noise*: every weight at its posterior mean, like the
    noise-free reference row of [1]'s Table 1. This is not an estimator of
    the ELBO's gradient; its variance comes from the choice of minibatch
    alone and approximates the floor that no weight-sampling scheme can go
    below (the variance over minibatches of the noise-averaged gradient).

The reported variance of a layer is the variance over draws, averaged over
the elements of its weight matrix.

``--init-scale 0.01`` starts (and, within 100 epochs, keeps) the
posterior much narrower: weight noise is then a small part of the gradient
noise, and the per-example schemes gain less (see the tutorial page).

Usage::

    python examples/gradient_variance.py            # one to three minutes, depending on the load
    python examples/gradient_variance.py --quick    # smoke run, seconds

[1] Kingma, Salimans, Welling (2015) "Variational Dropout and the Local
Reparameterization Trick"

[2] Wen, Vicol, Ba, Tran, Grosse (2018) "Flipout: Efficient
Pseudo-Independent Weight Perturbations on Mini-Batches"
"""

import argparse
import os
import time
from contextlib import ExitStack

import pyro
import torch
from pyro.infer import SVI, Predictive, TraceMeanField_ELBO
from pyro.infer.autoguide import init_to_sample
from pyro.poutine.messenger import Messenger
from pyro.poutine.util import site_is_subsample
from tqdm import tqdm

from pyro_vinit import AutoMeanFieldNormal, FitConfig, fit_config
from pyro_vinit.data import load_digits
from pyro_vinit.metrics import classification_metrics
from pyro_vinit.nn import BayesianClassifier, bayesianize, mlp
from pyro_vinit.poutine import (
    FlipoutMessenger,
    KLAnnealingMessenger,
    LocalReparamMessenger,
)

from _outputs import save_results

LAYERS = ("bottom", "top")
SIZES = (64, 400, 400, 400, 10)
# The KL weight per training example of [1]'s MNIST runs: KL / 60 000 per datum.
MNIST_SIZE = 60000
FIT = FitConfig()  # fit's defaults


class PosteriorMeanMessenger(Messenger):
    """Sets every latent site the guide samples to its distribution's mean (the model
    replays it): the gradient keeps the closed-form KL and loses all weight noise."""

    def _pyro_sample(self, msg):
        # ``done``: a value is already set (the ELBO replaying the guide into the model);
        # a plate's subsample site has no mean
        if msg["is_observed"] or msg["done"] or site_is_subsample(msg):
            return
        msg["value"] = msg["fn"].mean
        msg["done"] = True


# The estimators of the weight noise (None: one weight sample per minibatch, Pyro's
# ordinary sampling), and the noise-free floor.
ESTIMATORS = {
    "ordinary": None,
    "LRT": LocalReparamMessenger,
    "Flipout": FlipoutMessenger,
    "no weight noise": PosteriorMeanMessenger,
}


def gradient_variance(loss_fn, params, x, y, *, batch, draws, kl):
    """``draws`` gradients of the minibatch loss with respect to each of ``params``, each
    with a new minibatch (without replacement) and new weight noise, under each
    estimator: ``{estimator: {name: variance over draws (mean over elements), ...,
    "ms_per_draw": ms}}``."""
    out = {}
    for estimator, handler_cls in ESTIMATORS.items():
        grads = {name: [] for name in params}
        start = time.perf_counter()
        for _ in range(draws):
            idx = torch.randperm(len(x))[:batch]
            with ExitStack() as stack:
                stack.enter_context(kl)
                if handler_cls is not None:
                    stack.enter_context(handler_cls())
                loss = loss_fn(x[idx], y[idx])
            for name, g in zip(params, torch.autograd.grad(loss, list(params.values()))):
                grads[name].append(g)
        row = {name: torch.stack(g).var(0).mean().item() for name, g in grads.items()}
        row["ms_per_draw"] = (time.perf_counter() - start) / draws * 1e3
        out[estimator] = row
    return out


def train_and_measure(x, y, *, sizes, epochs, batch_sizes, draws, lr, prior_scale, kl_weight,
                      guide_kwargs, evaluate, log, train_batch_size=128):
    """[1]'s protocol: trains the mean-field guide of ``mlp(sizes)`` from a random start
    with fit's configuration at ``kl_weight`` (LRT), and at each checkpoint in ``epochs``
    (cumulative) measures :func:`gradient_variance` with respect to the means of the
    bottom and the top weight matrix for each batch size."""
    model = BayesianClassifier(bayesianize(mlp(tuple(sizes)), prior_scale=prior_scale),
                               num_data=len(x))
    guide = AutoMeanFieldNormal(model, **guide_kwargs)
    config = fit_config(guide, lr=lr, kl_weight=kl_weight)
    assert isinstance(config.weight_noise(), LocalReparamMessenger)  # fit trains it with LRT
    svi = SVI(model, guide, config.optimizer(), config.elbo())
    guide(x[:1], y[:1])  # a random start: the means drawn from the prior
    params = dict(guide.named_parameters())
    bottom = params["locs.net.0.weight_unconstrained"]
    top = params[f"locs.net.{2 * (len(sizes) - 2)}.weight_unconstrained"]
    elbo = TraceMeanField_ELBO()
    kl = KLAnnealingMessenger(config.kl_weight)  # in the gradient draws too
    steps_per_epoch = max(1, len(x) // train_batch_size)
    rows, done = [], 0
    for epoch in epochs:
        for _ in range((epoch - done) * steps_per_epoch):
            idx = torch.randint(0, len(x), (train_batch_size,))
            with config.handlers():
                svi.step(x[idx], y[idx])
        done = epoch
        metrics = evaluate(model, guide)
        for batch in batch_sizes:
            row = {"epochs": epoch, "batch": batch, "metrics": metrics}
            row.update(gradient_variance(
                lambda xb, yb: elbo.differentiable_loss(model, guide, xb, yb),
                {"bottom": bottom, "top": top}, x, y, batch=batch, draws=draws, kl=kl))
            rows.append(row)
            log(f"{epoch} epochs, batch {batch} done")
    return rows


def make_evaluate(x_test, y_test, num_samples):
    @torch.no_grad()
    def evaluate(model, guide):
        predictive = Predictive(model, guide=guide, num_samples=num_samples,
                                return_sites=["_RETURN"])
        metrics = classification_metrics(y_test, logits=predictive(x_test)["_RETURN"])
        metrics["accuracy"] = 1.0 - metrics["error_rate"]
        return metrics

    return evaluate


def ratios(rows):
    """Each estimator's variance divided by the ordinary estimator's."""
    return [
        {
            "epochs": row["epochs"],
            "batch": row["batch"],
            **{
                f"{name} / ordinary": {
                    layer: row[name][layer] / row["ordinary"][layer] for layer in LAYERS
                }
                for name in ESTIMATORS
                if name != "ordinary"
            },
        }
        for row in rows
    ]


def markdown_table(rows):
    names = list(ESTIMATORS)
    lines = [
        "| epochs | batch | layer | " + " | ".join(names) + " | LRT / ord. | Flipout / ord. "
        "| test acc. |",
        "|---:|---:|---|" + "---:|" * (len(names) + 3),
    ]
    for row in rows:
        for layer in LAYERS:
            ordinary = row["ordinary"][layer]
            values = " | ".join(f"{row[n][layer]:.3g}" for n in names)
            acc = row.get("metrics", {}).get("accuracy", float("nan"))
            lines.append(
                f"| {row['epochs']} | {row['batch']} | {layer} | {values} "
                f"| {row['LRT'][layer] / ordinary:.3f} | {row['Flipout'][layer] / ordinary:.3f} "
                f"| {acc:.3f} |"
            )
    lines += ["", "ms per gradient draw:", "",
              "| epochs | batch | " + " | ".join(names) + " |",
              "|---:|---:|" + "---:|" * len(names)]
    for row in rows:
        times = " | ".join(f"{row[n]['ms_per_draw']:.1f}" for n in names)
        lines.append(f"| {row['epochs']} | {row['batch']} | {times} |")
    return "\n".join(lines)


def plot(args, rows):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(ESTIMATORS)
    colors = dict(zip(names, ("C0", "C1", "C2", "C7")))
    epochs = sorted({row["epochs"] for row in rows})
    batches = sorted({row["batch"] for row in rows})
    fig, axes = plt.subplots(len(LAYERS), len(epochs), figsize=(5.2 * len(epochs), 7.2),
                             squeeze=False)
    width = 0.8 / len(names)
    for i, layer in enumerate(LAYERS):
        for j, epoch in enumerate(epochs):
            ax = axes[i][j]
            for g, batch in enumerate(batches):
                row = next(r for r in rows if r["epochs"] == epoch and r["batch"] == batch)
                for k, name in enumerate(names):
                    value = row[name][layer]
                    pos = g + (k - (len(names) - 1) / 2) * width
                    ax.bar(pos, value, width, color=colors[name],
                           label=name if g == 0 else None)
                    if name != "ordinary":
                        ax.annotate(f"×{value / row['ordinary'][layer]:.2g}", (pos, value),
                                    ha="center", va="bottom", fontsize=7)
            ax.set_yscale("log")
            ax.set_xticks(range(len(batches)), [f"batch {b}" for b in batches])
            ax.set_title(f"{layer} layer, after {epoch} epochs", fontsize=10)
            ax.set_ylabel("gradient variance of the means")
            ax.margins(y=0.15)
    axes[0][0].legend(fontsize=8)
    fig.suptitle("Variance of the minibatch ELBO gradient (×: ratio to ordinary)", fontsize=10)
    fig.tight_layout()
    path = os.path.join(args.out_dir, "gradient_variance.png")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return [path]


def main(args):
    torch.set_num_threads(args.threads)
    # validation only slows the thousands of gradient draws down
    pyro.enable_validation(False)
    pyro.clear_param_store()
    pyro.set_rng_seed(args.seed)
    x, y, x_test, y_test = load_digits()
    checkpoints = len(args.epochs) * len(args.batch_sizes)
    bar = tqdm(total=checkpoints, desc="gradient variance")
    start = time.perf_counter()
    rows = train_and_measure(
        x, y, sizes=tuple(args.sizes), epochs=args.epochs, batch_sizes=args.batch_sizes,
        draws=args.draws, lr=args.lr, prior_scale=args.prior_scale or None,
        kl_weight=len(x) / MNIST_SIZE if args.kl_weight is None else args.kl_weight,
        guide_kwargs=dict(init_loc_fn=init_to_sample, init_scale=args.init_scale),
        evaluate=make_evaluate(x_test, y_test, args.num_samples), log=lambda _: bar.update(),
    )
    bar.close()
    elapsed = time.perf_counter() - start
    print(markdown_table(rows))
    print(f"\ntotal time {elapsed:.0f} s")

    save_results(args.out_dir, {"config": vars(args), "seconds": elapsed, "variance": rows,
                                "ratios": ratios(rows)}, lambda: plot(args, rows))
    return rows


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES),
                        help="layer sizes of the MLP, input to output")
    parser.add_argument("--epochs", type=int, nargs="+", default=[10, 100],
                        help="training epochs (cumulative) at which to measure")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[128, 1000])
    parser.add_argument("--prior-scale", type=float, default=0.0,
                        help="N(0, s²) priors, from which the guide's means are drawn "
                        "(0: N(0, 1/D_in))")
    parser.add_argument("--kl-weight", type=float, default=None,
                        help="factor on the KL (default: N / 60000, the per-example KL "
                        "weight of [1]'s MNIST runs)")
    parser.add_argument("--init-scale", type=float, default=0.1,
                        help="initial standard deviation of the guide (0.1: AutoNormal's "
                        "default, the benchmark's)")
    parser.add_argument("--lr", type=float, default=FIT.lr, help="Adam's (fit's default)")
    parser.add_argument("--draws", type=int, default=100, help="gradient draws per estimate")
    parser.add_argument("--num-samples", type=int, default=64,
                        help="posterior samples of the test accuracy at each checkpoint")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out-dir", default="results/gradient_variance")
    parser.add_argument("--quick", action="store_true", help="smoke run (seconds)")
    args = parser.parse_args(argv)
    if args.quick:
        args.epochs, args.draws, args.num_samples = [1, 2], 5, 8
    return args


if __name__ == "__main__":
    main(parse_args())
