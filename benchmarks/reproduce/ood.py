"""
Beyond the papers: out-of-distribution (OOD) detection and calibration of
Bayesian MLPs on real MNIST digits, for the mean-field, 2-tied and radial
guides, each with its default initialization and with I-BLM
(:func:`pyro_vinit.init_guide_iblm`), against a deterministic network.

Setup:

- training data: the digits 0-4 among the 4,000 training digits of
  :func:`pyro_vinit.data.load_mnist` (about 2,000 images, 5 classes);
- in-distribution test set: the digits 0-4 of the 1,000 test digits;
- OOD test sets, built offline from the test digits: the held-out digits
  5-9; the in-distribution test digits rotated by 90°; the same digits with
  inverted grey levels (1 - x); images of uniform noise U(0, 1), as many as
  the in-distribution test digits;
- a ReLU MLP 784-100-100-5 (``--sizes``) with ``bayesianize``'s N(0, 1/D_in)
  priors, TraceMeanField_ELBO (closed-form KL for all three guides; the
  mean-field guide is ``common.MeanFieldNormal``), Adam (lr 1e-3),
  minibatches of 128, 1,000 steps (64 epochs), the full KL;
- default initialization: means from a prior draw, standard deviations
  0.01; I-BLM: ``init_guide_iblm(guide, (x_train, y_train))`` with the
  library's defaults;
- the deterministic baseline: the same MLP trained by Adam on the
  cross-entropy (lr 1e-3, 1,000 steps, no weight decay); its score is the
  entropy of its softmax;
- Bayesian scores from 100 posterior samples
  (:func:`pyro_vinit.metrics.uncertainty_decomposition`): the predictive
  entropy (total uncertainty) and the mutual information between the label
  and the weights (epistemic); AUROC by
  :func:`pyro_vinit.metrics.ood_auroc` (1: perfect, 0.5: chance);
- calibration on the in-distribution test set
  (:func:`pyro_vinit.metrics.calibration`, 10 equal-width bins): ECE table
  and reliability diagrams.

Usage::

    python -m benchmarks.reproduce.ood            # about 2.5 CPU minutes
    python -m benchmarks.reproduce.ood --quick    # seconds
"""

import pyro
import torch
from tqdm import tqdm

from benchmarks.reproduce import common
from pyro_vinit import init_guide_iblm
from pyro_vinit.data import load_mnist
from pyro_vinit.metrics import calibration, mnll, ood_auroc, uncertainty_decomposition
from pyro_vinit.nn import mlp

FAMILIES = ("mean-field", "k-tied k=2", "radial")
INITS = ("default", "I-BLM")
OOD_SETS = ("digits 5-9", "rotated 90°", "inverted", "uniform noise")
SCORES = {"entropy": "total", "MI": "epistemic"}
DETERMINISTIC = "deterministic"


def make_sets(data, in_classes, seed):
    """In-distribution train and test sets and the OOD test sets (offline, seeded)."""
    x, y, x_test, y_test = data
    inside = torch.isin(y, in_classes)
    inside_test = torch.isin(y_test, in_classes)
    x_in = x_test[inside_test]
    generator = torch.Generator().manual_seed(seed)
    ood = {
        "digits 5-9": x_test[~inside_test],
        "rotated 90°": torch.rot90(x_in.reshape(-1, 28, 28), 1, (1, 2)).reshape(len(x_in), -1),
        "inverted": 1.0 - x_in,
        "uniform noise": torch.rand(x_in.shape, generator=generator, dtype=x_in.dtype),
    }
    return (x[inside], y[inside]), (x_in, y_test[inside_test]), ood


def scores(logits):
    u = uncertainty_decomposition(logits=logits)
    return {"entropy": u.total, "MI": u.epistemic}


def evaluate(logits_in, y_in, logits_ood, num_bins):
    s_in = scores(logits_in)
    cal = calibration(y_in, logits=logits_in, num_bins=num_bins)
    out = {
        "accuracy": (logits_in.softmax(-1).mean(0).argmax(-1) == y_in).float().mean().item(),
        "mnll": mnll(y_in, logits=logits_in).item(),
        "ece": cal.ece.item(),
        "reliability": {"confidence": cal.confidence.tolist(), "accuracy": cal.accuracy.tolist(),
                        "count": cal.count.tolist()},
        "auroc": {},
    }
    for name, logits in logits_ood.items():
        s_out = scores(logits)
        out["auroc"][name] = {k: ood_auroc(s_in[k], s_out[k]).item() for k in SCORES}
    return out


def run_bayesian(args, family, init, seed, train, test, ood):
    x, y = train
    pyro.set_rng_seed(seed)
    model = common.make_model(args.sizes, len(x))
    guide = common.make_guide(family, model, init_scale=args.init_scale)
    if init == "I-BLM":
        init_guide_iblm(guide, (x, y))
    common.fit(model, guide, x, y, steps=args.steps, lr=args.lr, batch_size=args.batch_size,
               desc=f"{family}, {init}, seed {seed}")
    logits_in = common.predict_logits(model, guide, test[0], args.num_samples)
    logits_ood = {k: common.predict_logits(model, guide, v, args.num_samples)
                  for k, v in ood.items()}
    return evaluate(logits_in, test[1], logits_ood, args.num_bins)


def run_deterministic(args, seed, train, test, ood):
    pyro.set_rng_seed(seed)
    net = mlp(tuple(args.sizes))
    common.fit_deterministic(net, *train, steps=args.steps, lr=args.lr,
                             batch_size=args.batch_size, desc=f"deterministic, seed {seed}")
    with torch.no_grad():
        logits_in = net(test[0]).unsqueeze(0)
        logits_ood = {k: net(v).unsqueeze(0) for k, v in ood.items()}
    return evaluate(logits_in, test[1], logits_ood, args.num_bins)


def main(args):
    common.setup(args)
    report = common.Report(args, "ood")
    data = load_mnist()
    in_classes = torch.arange(args.sizes[-1])
    train, test, ood = make_sets(data, in_classes, seed=0)
    configs = [(DETERMINISTIC, "")] + [(f, i) for f in FAMILIES for i in INITS]
    runs = {}
    bar = tqdm(total=len(configs) * args.seeds, desc="runs", mininterval=2)
    for family, init in configs:
        key = family if family == DETERMINISTIC else f"{family}, {init}"
        runs[key] = []
        for seed in range(args.seeds):
            if family == DETERMINISTIC:
                runs[key].append(run_deterministic(args, seed, train, test, ood))
            else:
                runs[key].append(run_bayesian(args, family, init, seed, train, test, ood))
            bar.update()
    bar.close()

    rows = []
    for key, rs in runs.items():
        row = [key]
        for name in OOD_SETS:
            for score in SCORES:
                if key == DETERMINISTIC and score == "MI":
                    row.append("–")
                else:
                    row.append(common.fmt([r["auroc"][name][score] for r in rs]))
        rows.append(row)
    header = ["model"] + [f"{name}: {score}" for name in OOD_SETS for score in SCORES]
    report.table("OOD detection: AUROC of in-distribution test digits (0-4) against each set",
                 header, rows,
                 note=f"(score: predictive entropy or mutual information; mean ± sd over "
                 f"{args.seeds} seeds; deterministic: softmax entropy)")
    rows = [[key, common.fmt([r["accuracy"] for r in rs]), common.fmt([r["mnll"] for r in rs]),
             common.fmt([r["ece"] for r in rs])] for key, rs in runs.items()]
    report.table("Calibration on the in-distribution test digits",
                 ["model", "accuracy", "MNLL", f"ECE ({args.num_bins} bins)"], rows,
                 note=f"(mean ± sd over {args.seeds} seeds)")
    report.save({"runs": runs, "sizes": {"train": len(train[0]), "test_in": len(test[0]),
                                         **{k: len(v) for k, v in ood.items()}}},
                lambda: plot(args, runs))


def plot(args, runs):
    import matplotlib.pyplot as plt

    written = []
    # AUROC bars, entropy score, per OOD set
    fig, axes = plt.subplots(1, len(OOD_SETS), figsize=(4 * len(OOD_SETS), 3.8), sharey=True)
    keys = list(runs)
    for ax, name in zip(axes, OOD_SETS):
        for i, key in enumerate(keys):
            for j, score in enumerate(SCORES):
                if key == DETERMINISTIC and score == "MI":
                    continue
                vals = torch.tensor([r["auroc"][name][score] for r in runs[key]])
                ax.bar(i + (j - 0.5) * 0.4, vals.mean(), 0.4, color=f"C{j}",
                       label=score if i == 1 else None)
        ax.axhline(0.5, color="gray", lw=0.8, ls=":")
        ax.set_xticks(range(len(keys)), keys, rotation=60, ha="right", fontsize=7)
        ax.set(title=name, ylim=(0.3, 1.0))
    axes[0].set_ylabel("AUROC (in vs OOD)")
    axes[0].legend(fontsize=8)
    written.append(common.savefig(fig, args, "ood_auroc.png"))

    # reliability diagrams, one panel per guide family, first seed
    panels = [DETERMINISTIC] + list(FAMILIES)
    fig, axes = plt.subplots(1, len(panels), figsize=(3.3 * len(panels), 3.4), sharey=True)
    for ax, family in zip(axes, panels):
        ax.plot([0, 1], [0, 1], color="gray", lw=0.8, ls=":")
        keys = [family] if family == DETERMINISTIC else [f"{family}, {i}" for i in INITS]
        for k, key in enumerate(keys):
            rel = runs[key][0]["reliability"]
            acc, conf = torch.tensor(rel["accuracy"]), torch.tensor(rel["confidence"])
            ok = ~torch.isnan(acc)
            ece = sum(r["ece"] for r in runs[key]) / len(runs[key])
            ax.plot(conf[ok], acc[ok], "o-", color=f"C{k}",
                    label=f"{key.split(', ')[-1]} (ECE {ece:.3f})")
        ax.set(title=family, xlabel="mean confidence in the bin", xlim=(0, 1), ylim=(0, 1))
        ax.legend(fontsize=7, loc="upper left")
    axes[0].set_ylabel("accuracy")
    written.append(common.savefig(fig, args, "ood_reliability.png"))
    return written


def parse_args(argv=None):
    parser = common.make_parser(__doc__, "ood")
    parser.add_argument("--sizes", type=int, nargs="+", default=[784, 100, 100, 5],
                        help="layer sizes; the last is the number of in-distribution digits "
                        "(0 to sizes[-1] - 1)")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--init-scale", type=float, default=1e-2)
    parser.add_argument("--num-samples", type=int, default=100)
    parser.add_argument("--num-bins", type=int, default=10)
    args = parser.parse_args(argv)
    if not 2 <= args.sizes[-1] <= 9:
        parser.error("the last layer size (in-distribution digits) must be in 2..9")
    if args.quick:
        args.sizes, args.steps, args.seeds, args.num_samples = [784, 16, 16, 5], 10, 1, 4
    return args


if __name__ == "__main__":
    main(parse_args())
