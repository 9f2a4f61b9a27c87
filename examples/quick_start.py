"""
Quick start: a Bayesian MLP on scikit-learn's digits with pyro-vinit.

The whole recipe of the library in one script:

1. ``bayesianize(mlp((64,) + (100,) * 5 + (10,)))`` turns an
   ``nn.Sequential`` into a Bayesian network with N(0, 1/D_in) priors, and
   :class:`~pyro_vinit.nn.BayesianClassifier` adds the Categorical
   likelihood, scaled to the full training set;
2. an :class:`~pyro_vinit.guides.AutoKTiedNormal` guide (rank 2; ``--guide
   radial`` for :class:`~pyro_vinit.guides.AutoRadialNormal`);
3. :func:`~pyro_vinit.initialization.init_guide_iblm` sets the guide from
   Bayesian linear regressions, layer by layer, onto the Dirichlet transform
   of the labels, with its stds capped at a tenth of the prior's
   (``max_scale_ratio=0.1``): the network is a good, calibrated classifier
   before the first SVI step;
4. SVI with the configuration of :func:`~pyro_vinit.fit` (from
   :func:`~pyro_vinit.fit_config`): :class:`~pyro.infer.TraceMeanField_ELBO`
   (closed-form KL) and Adam at 3e-3, each step run inside
   :func:`~pyro_vinit.poutine.local_reparam` (for the radial guide
   :func:`~pyro_vinit.poutine.flipout`: a radial posterior has no Gaussian
   pre-activations to sample) and inside a
   :class:`~pyro_vinit.poutine.KLAnnealingMessenger` that weights the KL
   term by 0.01;
5. test accuracy, MNLL and expected calibration error from
   :mod:`pyro_vinit.metrics`, right after the initialization (step 0) and
   during training.

Steps 3 and 4 are :func:`~pyro_vinit.fit`'s recipe, written out so that
each piece is a flag (the method page ``docs/methods/training.rst``): with
47,910 weights for 1,257 training images the full ELBO pulls the guide back
towards its prior and washes the start out; the KL weight of 0.01 and the
capped stds keep it. Every default here is ``fit``'s. The tutorial page
``docs/tutorials/quick_start.rst`` measures each choice against the
alternatives.

Writes ``results.json``, ``learning_curves.png`` (test error, test MNLL and
the training objective against SVI step) and ``reliability.png`` (the
reliability diagram of the final predictive) to ``--out-dir``.

Usage::

    python examples/quick_start.py                   # 20-60 s, depending on the load
    python examples/quick_start.py --guide radial    # radial posterior, Flipout
    python examples/quick_start.py --init sample     # without I-BLM, for comparison
    python examples/quick_start.py --quick           # smoke run, seconds
"""

import argparse
import os
import time

import pyro
import torch
from pyro.infer import SVI, Predictive, TraceMeanField_ELBO
from pyro.infer.autoguide import init_to_sample
from tqdm import tqdm

from pyro_vinit import AutoKTiedNormal, AutoRadialNormal, FitConfig, fit_config, init_guide_iblm
from pyro_vinit.data import load_digits
from pyro_vinit.metrics import calibration, classification_metrics
from pyro_vinit.nn import BayesianClassifier, bayesianize, mlp
from pyro_vinit.poutine import FlipoutMessenger, KLAnnealingMessenger, LocalReparamMessenger
from pyro_vinit.schedules import LinearWarmup

from _outputs import save_results

FIT = FitConfig()  # fit's defaults, which every flag below starts from


def make_guide(args, model):
    # Without I-BLM the weight means are drawn from the prior: with the
    # default init_to_feasible they would all be 0 and the hidden units would
    # stay interchangeable.
    kwargs = dict(init_scale=args.init_scale, init_loc_fn=init_to_sample)
    if args.guide == "ktied":
        return AutoKTiedNormal(model, rank=args.rank, **kwargs)
    return AutoRadialNormal(model, **kwargs)


@torch.no_grad()
def predict(model, guide, x, num_samples):
    """Per-sample logits ``(num_samples, N, 10)``."""
    predictive = Predictive(model, guide=guide, num_samples=num_samples, return_sites=["_RETURN"])
    return predictive(x)["_RETURN"]


def test_metrics(model, guide, x_test, y_test, num_samples):
    """The test metrics as floats, and the reliability diagram's data."""
    logits = predict(model, guide, x_test, num_samples)
    metrics = classification_metrics(y_test, logits=logits)
    metrics["accuracy"] = 1.0 - metrics["error_rate"]
    reliability = {k: v.tolist() for k, v in calibration(y_test, logits=logits)._asdict().items()}
    return metrics, reliability


def evaluate(model, guide, elbo, data, num_samples):
    x_train, y_train, x_test, y_test = data
    metrics = classification_metrics(y_test, logits=predict(model, guide, x_test, num_samples))
    metrics["accuracy"] = 1.0 - metrics["error_rate"]
    # The unannealed -ELBO on the whole training set, per image: the objective
    # the annealed minibatch losses converge to once λ = 1.
    with torch.no_grad():
        metrics["neg_elbo"] = elbo.loss(model, guide, x_train, y_train) / len(x_train)
    return metrics


def train(args, model, guide, data):
    x_train, y_train = data[:2]
    # fit's configuration: Adam, TraceMeanField_ELBO, the KL weight and the weight-noise handler
    config = fit_config(guide, lr=args.lr, kl_weight=args.kl_weight, average=args.average)
    elbo = TraceMeanField_ELBO()  # the unannealed objective, for the curves
    # fit's moving average of the parameters: what is evaluated, and kept at the end
    average = config.averager()
    svi = SVI(model, guide, config.optimizer(), config.elbo())
    # the KL term weighted by λ = kl_weight throughout (optionally reached by a linear warm-up)
    schedule = LinearWarmup(args.kl_warmup, end=args.kl_weight) if args.kl_warmup else None
    annealing = KLAnnealingMessenger(schedule or args.kl_weight)
    # LRT samples each example's pre-activations from their Gaussian marginal;
    # a radial posterior's pre-activations are not Gaussian, but its weight
    # noise is sign-symmetric, which is all Flipout needs.
    weight_noise = config.weight_noise
    assert isinstance(weight_noise(),
                      FlipoutMessenger if args.guide == "radial" else LocalReparamMessenger)
    curve, losses = [], []
    start = time.perf_counter()
    for step in tqdm(range(args.steps + 1), desc=f"SVI ({args.guide})"):
        if step % args.eval_every == 0 or step == args.steps:
            with average.swapped():
                metrics = evaluate(model, guide, elbo, data, args.eval_samples)
            loss = sum(losses) / len(losses) / len(x_train) if losses else None
            curve.append({"step": step, "kl_weight": annealing.scale, "train_loss": loss,
                          "seconds": time.perf_counter() - start, **metrics})
            losses = []
        if step == args.steps:
            average.write()
            break
        idx = torch.randint(0, len(x_train), (args.batch_size,))
        # Both handlers must see the guide and the model: they wrap the step.
        with annealing, weight_noise():
            losses.append(svi.step(x_train[idx], y_train[idx]))
        average.update()
        annealing.step()
    return curve


def plot(args, curve, reliability_init, reliability):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [c["step"] for c in curve]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    axes[0].plot(steps, [c["error_rate"] for c in curve], marker=".")
    axes[0].set_ylabel("test error")
    axes[1].plot(steps, [c["mnll"] for c in curve], marker=".", color="C1")
    axes[1].set_ylabel("test MNLL")
    loss_steps = [c["step"] for c in curve if c["train_loss"] is not None]
    axes[2].plot(loss_steps, [c["train_loss"] for c in curve if c["train_loss"] is not None],
                 color="C2", label="annealed minibatch loss")
    axes[2].plot(steps, [c["neg_elbo"] for c in curve], color="C3", marker=".",
                 label="-ELBO (λ = 1), training set")
    axes[2].set_ylabel("loss / training image")
    axes[2].legend(fontsize=8)
    axes[2].set_yscale("log")
    for ax in axes:
        ax.set_xlabel("SVI step")
        if args.kl_warmup:
            ax.axvline(args.kl_warmup, color="gray", lw=0.8, ls=":")
    fig.suptitle(f"Bayesian MLP on digits, {args.guide} guide, {args.init} init "
                 "(dotted: end of the KL warm-up)", fontsize=10)
    fig.tight_layout()
    paths = [os.path.join(args.out_dir, "learning_curves.png")]
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)

    edges = reliability["bin_edges"]
    width = edges[1] - edges[0]
    fig, (ax0, ax1) = plt.subplots(2, 1, figsize=(5, 5.8), sharex=True,
                                   gridspec_kw={"height_ratios": [3, 1]})
    for data, label, style in (
        (reliability, f"after {args.steps} steps, ECE {reliability['ece']:.3f}",
         dict(color="C0", edgecolor="k", lw=0.5)),
        (reliability_init, f"step 0 ({args.init}), ECE {reliability_init['ece']:.3f}",
         dict(fill=False, edgecolor="C3", lw=1.5)),
    ):
        accuracy = [a if a == a else 0.0 for a in data["accuracy"]]  # nan: empty bin
        ax0.bar(edges[:-1], accuracy, width=width, align="edge", label=label, **style)
        ax1.bar(edges[:-1], data["count"], width=width, align="edge", **style)
    ax0.plot([0, 1], [0, 1], "--", color="gray", label="perfect calibration")
    ax0.set_ylabel("accuracy in bin")
    ax0.set_title("reliability diagram, test set", fontsize=10)
    ax0.legend(fontsize=8, loc="upper left")
    ax1.set_yscale("log")
    ax1.set_xlabel("confidence (predicted class probability)")
    ax1.set_ylabel("test images")
    fig.tight_layout()
    paths.append(os.path.join(args.out_dir, "reliability.png"))
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)
    return paths


def report(name, metrics):
    print(f"{name}: test accuracy {metrics['accuracy']:.4f}, MNLL {metrics['mnll']:.4f}, "
          f"ECE {metrics['ece']:.4f}")


def main(args):
    pyro.set_rng_seed(args.seed)
    pyro.clear_param_store()
    torch.set_num_threads(args.threads)
    data = load_digits()
    x_train, y_train, x_test, y_test = data

    sizes = (x_train.shape[1],) + tuple(args.hidden) + (10,)
    net = bayesianize(mlp(sizes), prior_scale=args.prior_scale or None)
    model = BayesianClassifier(net, num_data=len(x_train))
    guide = make_guide(args, model)
    start = time.perf_counter()
    if args.init == "iblm":
        init_guide_iblm(guide, (x_train, y_train), batch_size=args.iblm_batch_size,
                        max_scale_ratio=args.max_scale_ratio)
    else:
        guide(x_train[:1], y_train[:1])  # set up the guide's parameters
    init_seconds = time.perf_counter() - start

    after_init, reliability_init = test_metrics(model, guide, x_test, y_test, args.num_samples)
    report(f"step 0, right after {args.init} init ({init_seconds:.2f} s)", after_init)
    curve = train(args, model, guide, data)
    final, reliability = test_metrics(model, guide, x_test, y_test, args.num_samples)
    report(f"step {args.steps}", final)

    results = {
        "config": vars(args),
        "init_seconds": init_seconds,
        "train_seconds": curve[-1]["seconds"],
        "num_guide_parameters": sum(p.numel() for p in guide.parameters()),
        "after_init": after_init,
        "final": final,
        "reliability": {"after_init": reliability_init, "final": reliability},
        "curve": curve,
    }
    save_results(args.out_dir, results, lambda: plot(args, curve, reliability_init, reliability))
    return results


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--guide", choices=["ktied", "radial"], default="ktied")
    parser.add_argument("--rank", type=int, default=2, help="k of the k-tied guide")
    parser.add_argument("--init", choices=["iblm", "sample"], default="iblm",
                        help="I-BLM, or weight means drawn from the prior")
    parser.add_argument("--iblm-batch-size", type=int, default=FIT.iblm_batch_size,
                        help="rows of each unit's regression in I-BLM")
    parser.add_argument("--init-scale", type=float, default=1e-2,
                        help="the guide's initial scales (replaced by I-BLM's variances)")
    parser.add_argument("--max-scale-ratio", type=float, default=FIT.max_scale_ratio,
                        help="I-BLM's stds at most this times the prior's")
    parser.add_argument("--prior-scale", type=float, default=0.0,
                        help="the N(0, s²) prior of every weight and bias "
                        "(0: bayesianize's default N(0, 1/D_in))")
    parser.add_argument("--hidden", type=int, nargs="+", default=[100] * 5,
                        help="hidden layer sizes")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--lr", type=float, default=FIT.lr)
    parser.add_argument("--kl-weight", type=float, default=FIT.kl_weight,
                        help="the weight λ of the KL term (1: the full ELBO)")
    parser.add_argument("--average", type=float, default=FIT.average,
                        help="decay of the parameters' moving average (0: the last step's)")
    parser.add_argument("--kl-warmup", type=int, default=0,
                        help="steps of a linear warm-up of the KL weight from 0 to λ (0: none)")
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--eval-samples", type=int, default=32,
                        help="posterior samples of the metrics during training")
    parser.add_argument("--num-samples", type=int, default=200,
                        help="posterior samples of the final metrics")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out-dir", default="results/quick_start")
    parser.add_argument("--quick", action="store_true", help="smoke run (seconds)")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.kl_warmup, args.eval_every = 60, min(args.kl_warmup, 20), 20
        args.eval_samples, args.num_samples = 8, 16
    return args


if __name__ == "__main__":
    main(parse_args())
