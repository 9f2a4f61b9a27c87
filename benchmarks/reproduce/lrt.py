"""
Table 1 of Kingma, Salimans, Welling (2015) [1] on real MNIST digits: the
variance of the minibatch gradient of the ELBO with respect to the means of
the bottom and the top weight matrix, with the local reparameterization
trick (LRT) against one weight sample per minibatch, at initialization and
after training, for minibatches of 1,000.

The method is the one of ``examples/gradient_variance.py`` (rewritten here on
the public API):

- a ReLU MLP 784-400-400-400-10 (three hidden layers as in [1]; ``--sizes``)
  with ``bayesianize``'s N(0, 1/D_in) priors and a fully factorized Normal
  guide at each site (closed-form KL, so the gradient noise is the
  likelihood's), means from a prior draw, standard deviations 0.1;
- the KL weighted by N / 60,000, the per-example KL weight of [1]'s runs on
  the 60,000 MNIST images (:class:`~pyro_vinit.poutine.KLAnnealingMessenger`
  with a constant weight), in training and in the measurement;
- trained with LRT (Adam, lr 1e-3, minibatches of 128) on the 4,000 training
  digits of :func:`pyro_vinit.data.load_mnist`;
- at 0, 10 and 50 epochs, for each estimator, 100 gradients of the loss on a
  new minibatch of 1,000 (drawn without replacement) with new weight noise,
  at the fixed parameters; the variance over the draws, averaged over the
  elements of the weight matrix.

Estimators: *ordinary* (one weight sample shared by the minibatch, [1]'s
"weight sample per minibatch"), *LRT*
(:class:`~pyro_vinit.poutine.LocalReparamMessenger`), *Flipout*
(:class:`~pyro_vinit.poutine.FlipoutMessenger`), and *no weight noise* (every
weight at its posterior mean: the variance due to the minibatch alone, [1]'s
"no dropout noise" row). [1] measures variational dropout (multiplicative
noise, one variance per weight) on 50,000 images: the absolute variances
depend on the model, the noise and the scaling of the objective, so the
comparison is between the ratios.

Usage::

    python -m benchmarks.reproduce.lrt            # about 2.5 CPU minutes
    python -m benchmarks.reproduce.lrt --quick    # seconds

[1] Kingma, Salimans, Welling (2015) "Variational Dropout and the Local
Reparameterization Trick"
"""


import pyro
import torch
from pyro.infer import TraceMeanField_ELBO
from tqdm import tqdm

from benchmarks.gradient_variance import ESTIMATORS, gradient_variance
from benchmarks.reproduce import common
from pyro_vinit.data import load_mnist
from pyro_vinit.poutine import KLAnnealingMessenger, LocalReparamMessenger

MNIST_SIZE = 60000
LAYERS = ("bottom", "top")
# [1], Table 1: average variance of the gradient, batch 1000 (variational dropout, independent
# weight noise), after 10 and 100 epochs
PAPER = {
    "LRT": {"top": (7.8e3, 1.2e3), "bottom": (1.9e2, 1.1e2)},
    "ordinary": {"top": (4.9e4, 4.3e3), "bottom": (8.5e2, 3.3e2)},
    "no weight noise": {"top": (2.8e3, 5.9e1), "bottom": (1.3e2, 9.0e0)},
}


def accuracy(model, guide, x, y, num_samples):
    logits = common.predict_logits(model, guide, x, num_samples)
    return (logits.softmax(-1).mean(0).argmax(-1) == y).float().mean().item()


def measure(args, loss_fn, kl, params, x, y):
    return gradient_variance(loss_fn, {k: params[k] for k in LAYERS}, x, y, batch=args.batch,
                             draws=args.draws, context=lambda: kl)


def run_seed(args, seed, data):
    x, y, x_test, y_test = data
    pyro.set_rng_seed(seed)
    model = common.make_model(args.sizes, len(x))
    guide = common.make_guide("mean-field", model, init_scale=args.init_scale)
    loss_fn = TraceMeanField_ELBO()(model, guide)
    with torch.no_grad():
        guide(x[:2], y[:2])
    last = f"net.{2 * (len(args.sizes) - 2)}.weight"
    named = dict(guide.named_parameters())
    params = {"bottom": named["locs.net.0.weight_unconstrained"],
              "top": named[f"locs.{last}_unconstrained"]}
    kl_weight = len(x) / MNIST_SIZE
    kl = KLAnnealingMessenger(kl_weight)
    steps_per_epoch = len(x) // args.train_batch
    rows, done = [], 0
    for epoch in args.epochs:
        if epoch > done:
            common.fit(model, guide, x, y, steps=(epoch - done) * steps_per_epoch, lr=args.lr,
                       batch_size=args.train_batch, kl_scale=kl_weight,
                       handler=LocalReparamMessenger(), desc=f"seed {seed}: to epoch {epoch}")
            done = epoch
        row = {"epochs": epoch, "test_accuracy": accuracy(model, guide, x_test, y_test,
                                                          args.num_samples)}
        row.update(measure(args, loss_fn, kl, params, x, y))
        rows.append(row)
    return rows


def main(args):
    common.setup(args)
    report = common.Report(args, "lrt")
    data = load_mnist()
    if args.batch > len(data[0]):
        raise SystemExit(f"--batch {args.batch} exceeds the {len(data[0])} training digits")
    seeds = []
    for seed in tqdm(range(args.seeds), desc="seeds", disable=args.seeds == 1):
        seeds.append(run_seed(args, seed, data))

    rows = []
    for i, epoch in enumerate(args.epochs):
        per_seed = [s[i] for s in seeds]
        for layer in LAYERS:
            cells = [str(epoch), common.fmt([r["test_accuracy"] for r in per_seed]), layer]
            for name in ESTIMATORS:
                cells.append(f"{statistics_mean(r[name][layer] for r in per_seed):.3g}")
            for name in ("LRT", "Flipout", "no weight noise"):
                cells.append(common.fmt([r[name][layer] / r["ordinary"][layer] for r in per_seed],
                                        2))
            rows.append(cells)
    report.table(
        f"Table 1: gradient variance of the weight means, MLP {'-'.join(map(str, args.sizes))}, "
        f"batch {args.batch}",
        ["epochs", "test acc.", "layer", *ESTIMATORS, "LRT / ord.", "Flipout / ord.",
         "no noise / ord."],
        rows, note=f"(variance over {args.draws} draws, mean over the matrix; ratios mean ± sd "
        f"over {args.seeds} seeds)",
    )
    paper_rows = []
    for layer in LAYERS:
        for j, epoch in enumerate((10, 100)):
            o, lrt, nn_ = (PAPER[k][layer][j] for k in ("ordinary", "LRT", "no weight noise"))
            paper_rows.append([str(epoch), layer, f"{o:.2g}", f"{lrt:.2g}", f"{nn_:.2g}",
                               f"{lrt / o:.2f}", f"{nn_ / o:.2f}"])
    report.table("[1], Table 1, for comparison (variational dropout, 50,000 images)",
                 ["epochs", "layer", "ordinary", "LRT", "no noise", "LRT / ord.",
                  "no noise / ord."], paper_rows)
    times = [[name, f"{statistics_mean(s[-1][name]['ms_per_draw'] for s in seeds):.0f}"]
             for name in ESTIMATORS]
    report.table(f"ms per gradient draw (batch {args.batch})", ["estimator", "ms"], times)
    report.save({"rows": seeds, "paper": PAPER, "kl_weight": len(data[0]) / MNIST_SIZE},
                lambda: plot(args, seeds))


def statistics_mean(values):
    values = list(values)
    return sum(values) / len(values)


def plot(args, seeds):
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    colors = dict(zip(ESTIMATORS, ("C0", "C1", "C2", "C7")))
    width = 0.8 / len(ESTIMATORS)
    for ax, layer in zip(axes, LAYERS):
        for i in range(len(args.epochs)):
            for k, name in enumerate(ESTIMATORS):
                value = statistics_mean(s[i][name][layer] for s in seeds)
                ax.bar(i + (k - 1.5) * width, value, width, color=colors[name],
                       label=name if i == 0 else None)
        ax.set_xticks(range(len(args.epochs)), [f"{e} epochs" for e in args.epochs])
        ax.set(yscale="log", ylabel="gradient variance of the means",
               title=f"{layer} layer, batch {args.batch}")
    axes[0].legend(fontsize=8)
    return [common.savefig(fig, args, "lrt.png")]


def parse_args(argv=None):
    # one seed: each variance is already an average over a whole weight matrix
    parser = common.make_parser(__doc__, "lrt", seeds=1)
    parser.add_argument("--sizes", type=int, nargs="+", default=[784, 400, 400, 400, 10])
    parser.add_argument("--epochs", type=int, nargs="+", default=[0, 10, 50],
                        help="cumulative training epochs at which to measure")
    parser.add_argument("--batch", type=int, default=1000, help="minibatch of the measurement")
    parser.add_argument("--train-batch", type=int, default=128)
    parser.add_argument("--draws", type=int, default=100)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--init-scale", type=float, default=0.1)
    parser.add_argument("--num-samples", type=int, default=32,
                        help="posterior samples of the test accuracy")
    args = parser.parse_args(argv)
    if args.quick:
        args.sizes, args.epochs, args.batch, args.draws = [784, 32, 32, 32, 10], [0, 1], 200, 4
        args.num_samples, args.seeds = 4, 1
    return args


if __name__ == "__main__":
    main(parse_args())
