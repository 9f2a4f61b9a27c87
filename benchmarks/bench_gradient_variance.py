"""
Gradient variance of local reparameterization (LRT) and Flipout against
ordinary weight sampling (Kingma et al. 2015, Table 1, in spirit).

A Bayesian MLP 64→400→400→400→10 (N(0, 1/D_in) priors) on scikit-learn
digits, with a fully factorized Normal guide at each site (closed-form KL,
so the noise is the likelihood's; means initialized by a prior draw), is
trained with LRT for 10 and for 100 epochs, with the KL weighted by
N/60 000 (the per-example KL weight of [1]'s MNIST runs; with the full KL,
1437 images cannot pull 370k weights off their prior and the network stays
at chance). Then, for minibatches of 128 and 1000 drawn at random from the
training set, the gradient of the same loss with respect to the means of
the bottom (64→400) and top (400→10) weights is drawn many times for each
estimator: ordinary (one weight sample per minibatch), LRT, Flipout, and
the weights at their posterior mean (no weight noise: the floor set by the
choice of minibatch). The table gives the variance over draws averaged over
the weight's elements, and each estimator's ratio to the ordinary one
(target for LRT ≤ 1/3). ``examples/gradient_variance.py`` makes the same
measurement on a smaller network.

Usage::

    python -m benchmarks.bench_gradient_variance --threads 1   # full run (a few minutes)
    python -m benchmarks.bench_gradient_variance --quick       # smoke run, no files

[1] Kingma, Salimans, Welling (2015) "Variational Dropout and the Local
Reparameterization Trick"
"""

import pyro
import torch
from pyro.infer.autoguide import init_to_sample

from benchmarks.gradient_variance import ESTIMATORS, train_and_measure
from benchmarks.harness import (
    host_info,
    make_parser,
    markdown_table,
    parse_args,
    result_stem,
    set_threads,
    write_report,
)
from pyro_vinit.data import load_digits

SIZES = (64, 400, 400, 400, 10)

# The KL weight per training example of [1]'s MNIST runs (KL / 60 000 per
# datum): on 1437 digits the full KL of 370k weights keeps the posterior at
# the prior and the network at chance accuracy, which is no regime to
# compare gradient estimators in.
MNIST_SIZE = 60000


def train_accuracy(x, y, num_samples=16):
    """The ``evaluate`` of :func:`gradient_variance`: accuracy of the posterior
    predictive on the training set, to show that the network is not at its
    prior."""

    @torch.no_grad()
    def evaluate(model, guide):
        logits = pyro.infer.Predictive(model, guide=guide, num_samples=num_samples,
                                       return_sites=["_RETURN"])(x)["_RETURN"]
        return {"accuracy": (logits.softmax(-1).mean(0).argmax(-1) == y).float().mean().item()}

    return evaluate


def report(rows):
    lines = ["## Gradient variance (mean over elements of the variance over draws)", ""]
    headers = ["epochs", "train acc.", "batch", "layer", *ESTIMATORS,
               "LRT / ordinary", "Flipout / ordinary", "no noise / ordinary"]
    table = []
    for row in rows:
        acc = row["metrics"]["accuracy"]
        for layer in ("bottom", "top"):
            o, lr_, fl, nn_ = (row[k][layer] for k in ESTIMATORS)
            table.append([row["epochs"], f"{acc:.3f}", row["batch"], layer, f"{o:.3g}",
                          f"{lr_:.3g}", f"{fl:.3g}", f"{nn_:.3g}", f"{lr_ / o:.2g}",
                          f"{fl / o:.2g}", f"{nn_ / o:.2g}"])
    lines.append(markdown_table(headers, table))
    return "\n".join(lines)


def main(args):
    set_threads(args.threads)
    pyro.settings.set(module_local_params=True)
    pyro.set_rng_seed(0)
    host = host_info()
    x, y, _, _ = load_digits()
    kl_weight = len(x) / MNIST_SIZE
    with pyro.validation_enabled(False):
        rows = train_and_measure(
            x, y, sizes=SIZES, epochs=args.epochs, draws=args.draws, kl_weight=kl_weight,
            guide_kwargs=dict(init_loc_fn=init_to_sample), evaluate=train_accuracy(x, y),
            log=lambda m: print(m, flush=True),
        )
    text = report(rows)
    print(text)
    if args.quick:
        return
    path = result_stem(args, "bench_gradient_variance")
    write_report(path, {"config": vars(args), "sizes": SIZES, "kl_weight": kl_weight,
                        "variance": rows}, text, host_start=host)


if __name__ == "__main__":
    parser = make_parser(__doc__)
    parser.add_argument("--epochs", type=int, nargs="+", default=[10, 100],
                        help="the checkpoints (cumulative epochs of training)")
    parser.add_argument("--draws", type=int, default=100, help="gradients per cell")
    main(parse_args(parser, quick={"epochs": [1], "draws": 3}))
