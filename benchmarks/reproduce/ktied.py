"""
The k-tied Normal of Swiatkowski et al. (2020) [1] on real MNIST digits:
accuracy, MNLL and parameter counts of mean-field against k = 1, 2, 3
(Fig. 6 left, Table 1), post-hoc rank-k truncation of a trained mean-field
posterior's standard deviations (Table 2, Fig. 3), the gradient SNR of the
standard-deviation parameters during training (Fig. 6 top right) and the
training step time (Table 4).

Setup, scaled down from the paper's (784-400-400-10 on 50,000 MNIST images,
about 300 epochs):

- data: the 4,000 training and 1,000 test digits of
  :func:`pyro_vinit.data.load_mnist`;
- a ReLU MLP 784-200-200-10 (``--sizes``) with ``bayesianize``'s N(0, 1/D_in)
  priors; the guide means start at a prior draw, the standard deviations at
  ``--init-scale``;
- mean-field is a fully factorized Normal placed at each site (closed-form KL,
  as the paper's and as the k-tied guide's; see ``common.MeanFieldNormal``);
  k-tied is :class:`pyro_vinit.AutoKTiedNormal` on every weight matrix;
- TraceMeanField_ELBO, Adam (lr 1e-3), minibatches of 128, 1,500 steps
  (48 epochs), the KL weight annealed linearly from 0 over training as in
  the paper (:class:`~pyro_vinit.poutine.KLAnnealingMessenger`), up to
  N / 50,000: the KL per training example of the paper's 50,000 images
  (``--kl-examples``). With the full KL, 4,000 images hold 200,000 weights
  so close to their prior that the test accuracy stays near 82 %, a regime
  the paper is not in;
- test metrics from 100 posterior samples; the negative ELBO reported, as
  the paper's Keras models report it, is the test NLL per example (under
  the posterior, not the predictive mixture) plus KL / 50,000.

The parameter counts are exact, for the trained shape and for the paper's
784-400-400-10 (guides set up, not trained).

*SNR*, measured the paper's way: for each standard-deviation parameter of the
middle weight matrix (the paper's "Dense 2"; mean-field: its per-weight
scales, k-tied: its factors U and V), E[g²] / Var[g] of its gradient over
the training minibatches of the last 10 steps, then the mean over the
parameters (the median too), at 10 %, 50 % and 90 % of training (the
paper's steps 1000, 5000, 9000). The paper's parameters are log-scales and
ours softplus-scales; over 10 steps the two differ by a nearly constant
factor per parameter, to which the ratio is blind.

*Truncation*: each weight's standard-deviation matrix A of the trained
mean-field posterior is replaced by its best rank-k approximation (SVD),
floored at 1e-6 (it can have non-positive entries), and the test metrics
recomputed; the fraction of variance explained per singular value
(γ_i² / Σγ²) of A and of the means as in Fig. 3. The library's
``AutoKTiedNormal.from_guide`` (the positive rank-k fit of the same
posterior, exact at rank ≤ 2 for a rank-2 matrix) is evaluated too.

*Step time* (Table 4): a 784-128-10 network, minibatches of 32 (the paper's
Keras tutorial architecture and Keras' default batch), a point estimate
(cross-entropy, Adam), mean-field and 2-tied, timed in interleaved rounds in
one run; medians and ratios.

Usage::

    python -m benchmarks.reproduce.ktied            # about 3 CPU minutes
    python -m benchmarks.reproduce.ktied --quick    # seconds

[1] Swiatkowski, Roth, Veeling, Tran, Dillon, Snoek, Mandt, Salimans,
Jenatton, Nowozin (2020) "The k-tied Normal Distribution: A Compact
Parameterization of Gaussian Mean Field Posteriors in Bayesian Neural Networks"
"""

import statistics
import time

import pyro
import torch
import torch.nn.functional as F
from pyro.infer import TraceMeanField_ELBO
from tqdm import tqdm

from benchmarks.reproduce import common
from pyro_vinit import AutoKTiedNormal
from pyro_vinit.data import load_mnist
from pyro_vinit.guides import site_params
from pyro_vinit.metrics import mnll
from pyro_vinit.nn import mlp
from pyro_vinit.schedules import LinearWarmup

FAMILIES = ("mean-field", "k-tied k=1", "k-tied k=2", "k-tied k=3")
RANKS = (1, 2, 3)
# Fig. 6 (left) and Table 2 of [1]: MNIST MLP, mean ± SEM over 100 weight samples
PAPER_FIG6 = {
    "mean-field": {"neg_elbo": 0.501, "nll": 0.133, "accuracy": 0.968, "params_k": 957},
    "k-tied k=1": {"neg_elbo": 0.539, "nll": 0.155, "accuracy": 0.961, "params_k": 482},
    "k-tied k=2": {"neg_elbo": 0.520, "nll": 0.129, "accuracy": 0.968, "params_k": 484},
    "k-tied k=3": {"neg_elbo": 0.497, "nll": 0.120, "accuracy": 0.969, "params_k": 486},
}
PAPER_TABLE2 = {
    "none": {"neg_elbo": 0.431, "nll": 0.100, "accuracy": 0.976},
    1: {"neg_elbo": 3.41, "nll": 0.677, "accuracy": 0.936},
    2: {"neg_elbo": 0.456, "nll": 0.107, "accuracy": 0.976},
    3: {"neg_elbo": 0.450, "nll": 0.106, "accuracy": 0.976},
}
# Fig. 6 (top right): mean SNR of Dense 2 at steps 1000, 5000, 9000
PAPER_SNR = {
    "mean-field": (4.13, 4.45, 3.21),
    "k-tied k=1": (5840, 158, 5.3),
    "k-tied k=2": (7500, 140, 4.3),
    "k-tied k=3": (7000, 117, 4.1),
}
# Table 4: ms per training step
PAPER_STEP_MS = {"point estimate": 2.00, "mean-field": 7.17, "k-tied k=2": 6.14}


def weight_sites(sizes):
    return [f"net.{2 * i}.weight" for i in range(len(sizes) - 1)]


def std_parameters(guide, site):
    """The standard-deviation parameters of one weight site: the per-weight
    unconstrained scales of mean-field, the factors U, V of k-tied."""
    return [p for name, p in guide.named_parameters()
            if name.split(".")[0] in ("scales", "scale_u", "scale_v")
            and name.split(".", 1)[1] == site + "_unconstrained"]


class SNRRecorder:
    """Keeps the gradients of ``params`` at the ``window`` steps ending at each
    checkpoint and reduces them to E[g²] / Var[g] per parameter."""

    def __init__(self, params, checkpoints, window):
        self.params, self.window = params, window
        self.record = {t: t - window + 1 for t in checkpoints}
        self.grads = {t: [] for t in checkpoints}

    def __call__(self, step):
        for t, first in self.record.items():
            if first <= step <= t:
                self.grads[t].append(torch.cat([p.grad.reshape(-1) for p in self.params]).clone())

    def summary(self):
        out = {}
        for t, grads in self.grads.items():
            g = torch.stack(grads)
            snr = g.pow(2).mean(0) / g.var(0, correction=0)
            snr = snr[torch.isfinite(snr)]
            out[t] = {"mean": snr.mean().item(), "median": snr.median().item(),
                      "num_parameters": snr.numel()}
        return out


def evaluate(args, model, guide, data):
    _, _, x_test, y_test = data
    logits = common.predict_logits(model, guide, x_test, args.num_samples)
    return {
        "accuracy": (logits.softmax(-1).mean(0).argmax(-1) == y_test).float().mean().item(),
        "nll": mnll(y_test, logits=logits).item(),
        "neg_elbo": common.negative_elbo(model, guide, logits, x_test, y_test, args.kl_examples),
    }


def train_family(args, family, seed, data):
    x, y = data[0], data[1]
    pyro.set_rng_seed(seed)
    model = common.make_model(args.sizes, len(x))
    guide = common.make_guide(family, model, init_scale=args.init_scale)
    with torch.no_grad():
        guide(x[:2], y[:2])
    site = weight_sites(args.sizes)[1]
    checkpoints = [max(args.snr_window - 1, int(f * args.steps)) for f in args.snr_at]
    recorder = SNRRecorder(std_parameters(guide, site), checkpoints, args.snr_window)
    fit = common.fit(model, guide, x, y, steps=args.steps, lr=args.lr,
                     batch_size=args.batch_size,
                     kl_scale=LinearWarmup(args.steps, end=len(x) / args.kl_examples),
                     on_gradients=recorder, desc=f"{family} seed {seed}")
    run = evaluate(args, model, guide, data)
    run["num_parameters"] = common.count_parameters(guide)
    run["snr"] = recorder.summary()
    run["loss_curve"] = smooth(fit["loss"], args.steps // 30 or 1)
    return model, guide, run


def smooth(values, every):
    return [(i + every, sum(values[i : i + every]) / len(values[i : i + every]))
            for i in range(0, len(values), every)]


def truncate(args, model, guide, data, seed):
    """Table 2: the trained mean-field posterior with each weight's std matrix
    replaced by its rank-k SVD truncation; also the spectra of Fig. 3."""
    x = data[0]
    rows, spectra = {}, {}
    for site in weight_sites(args.sizes):
        loc, scale = guide.get_loc_and_scale(site)
        scale = scale.detach()
        spectra[site] = {
            "std": explained(scale),
            "mean": explained(loc.detach()),
            # how far the stds moved from their common initial value (itself rank 1)
            "std_cv": (scale.std() / scale.mean()).item(),
            "std_mean_over_init": (scale.mean() / args.init_scale).item(),
        }
    for k in RANKS:
        pyro.set_rng_seed(seed)
        trunc = common.MeanFieldNormal(model, init_scale=args.init_scale)
        with torch.no_grad():
            trunc(x[:2], data[1][:2])
        for name in site_params.latent_sites(guide):
            loc, scale = (t.detach() for t in guide.get_loc_and_scale(name))
            if name in spectra:
                u, s, vh = torch.linalg.svd(scale, full_matrices=False)
                scale = ((u[:, :k] * s[:k]) @ vh[:k]).clamp(min=1e-6)
            trunc.set_loc_and_scale(name, loc, scale)
        rows[k] = evaluate(args, model, trunc, data)
    # the library's positive rank-k fit of the same posterior
    library = {k: evaluate(args, model, AutoKTiedNormal.from_guide(guide, rank=k), data)
               for k in RANKS}
    return rows, spectra, library


def explained(matrix):
    s = torch.linalg.svdvals(matrix)
    return (s.pow(2) / s.pow(2).sum()).tolist()


def paper_counts(args):
    """Exact guide parameter counts of the paper's shape, without training."""
    x = torch.zeros(2, args.paper_sizes[0])
    y = torch.zeros(2, dtype=torch.long)
    counts = {}
    for family in FAMILIES:
        model = common.make_model(args.paper_sizes, 50000)
        guide = common.make_guide(family, model, init_scale=0.1)
        with torch.no_grad():
            guide(x, y)
        counts[family] = common.count_parameters(guide)
    return counts


def step_times(args, data):
    """Table 4: one run, interleaved rounds, median ms per step."""
    x, y = data[0], data[1]
    sizes = args.timing_sizes
    xb, yb = x[: args.timing_batch], y[: args.timing_batch]
    configs = {}
    net = mlp(tuple(sizes))
    optim = torch.optim.Adam(net.parameters(), lr=1e-3)

    def point():
        optim.zero_grad()
        F.cross_entropy(net(xb), yb).backward()
        optim.step()

    configs["point estimate"] = point
    for family in ("mean-field", "k-tied k=2"):
        model = common.make_model(sizes, len(x))
        guide = common.make_guide(family, model, init_scale=args.init_scale)
        loss_fn = TraceMeanField_ELBO()(model, guide)
        with torch.no_grad():
            guide(xb, yb)
        opt = torch.optim.Adam(loss_fn.parameters(), lr=1e-3)

        def step(loss_fn=loss_fn, opt=opt):
            opt.zero_grad()
            loss_fn(xb, yb).backward()
            opt.step()

        configs[family] = step
    for fn in configs.values():
        for _ in range(args.timing_block):
            fn()
    times = {name: [] for name in configs}
    for _ in tqdm(range(args.timing_rounds), desc="step times", leave=False, mininterval=2):
        for name, fn in configs.items():
            start = time.perf_counter()
            for _ in range(args.timing_block):
                fn()
            times[name].append((time.perf_counter() - start) / args.timing_block * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def main(args):
    common.setup(args)
    report = common.Report(args, "ktied")
    data = load_mnist()
    runs = {family: [] for family in FAMILIES}
    truncation, spectra, library = [], [], []
    for seed in range(args.seeds):
        for family in FAMILIES:
            model, guide, run = train_family(args, family, seed, data)
            runs[family].append(run)
            if family == "mean-field":
                rows, spec, lib = truncate(args, model, guide, data, seed)
                truncation.append({"none": {k: run[k] for k in ("accuracy", "nll", "neg_elbo")},
                                   **rows})
                spectra.append(spec)
                library.append(lib)
    counts = paper_counts(args)
    times = step_times(args, data)

    shape = "-".join(map(str, args.sizes))
    paper_shape = "-".join(map(str, args.paper_sizes))
    rows = []
    for family in FAMILIES:
        r, p = runs[family], PAPER_FIG6[family]
        rows.append([
            family, f"{r[0]['num_parameters']:,}", f"{counts[family]:,}", f"{p['params_k']}k",
            common.fmt([x["accuracy"] for x in r]), f"{p['accuracy']:.3f}",
            common.fmt([x["nll"] for x in r]), f"{p['nll']:.3f}",
            common.fmt([x["neg_elbo"] for x in r]), f"{p['neg_elbo']:.3f}",
        ])
    report.table(
        f"Fig. 6 / Table 1: k-tied vs mean-field, MLP {shape}",
        ["guide", f"params {shape}", f"params {paper_shape}", "paper", "accuracy", "paper",
         "MNLL", "paper", "-ELBO/N", "paper"],
        rows, note=f"(test set; mean ± sd over {args.seeds} seeds; paper: {paper_shape} on "
        "50,000 images)",
    )

    trunc_rows = []
    for key in ("none",) + RANKS:
        vals = [t[key] for t in truncation]
        p = PAPER_TABLE2[key]
        label = "mean-field (no truncation)" if key == "none" else f"rank-{key} SVD truncation"
        trunc_rows.append([
            label, common.fmt([v["accuracy"] for v in vals]), f"{p['accuracy']:.3f}",
            common.fmt([v["nll"] for v in vals]), f"{p['nll']:.3f}",
            common.fmt([v["neg_elbo"] for v in vals]), f"{p['neg_elbo']:.3f}",
        ])
    for k in RANKS:
        if all(k in lib for lib in library):
            vals = [lib[k] for lib in library]
            trunc_rows.append([f"AutoKTiedNormal.from_guide(rank={k})",
                               common.fmt([v["accuracy"] for v in vals]), "",
                               common.fmt([v["nll"] for v in vals]), "",
                               common.fmt([v["neg_elbo"] for v in vals]), ""])
    report.table(
        "Table 2: post-hoc low-rank truncation of the trained mean-field stds",
        ["posterior", "accuracy", "paper", "MNLL", "paper", "-ELBO/N", "paper"], trunc_rows,
    )
    report.table(
        "Fig. 3: the trained mean-field std matrices",
        ["weight", "variance in rank 1", "in rank 2", "sd/mean of the stds",
         "mean std / initial std", "means: variance in rank 2"],
        [[site, common.fmt([s[site]["std"][0] for s in spectra]),
          common.fmt([sum(s[site]["std"][:2]) for s in spectra]),
          common.fmt([s[site]["std_cv"] for s in spectra]),
          common.fmt([s[site]["std_mean_over_init"] for s in spectra], 2),
          common.fmt([sum(s[site]["mean"][:2]) for s in spectra])]
         for site in spectra[0]],
        note="(fraction of variance γ²/Σγ² in the first singular values)",
    )

    snr_rows = []
    checkpoints = sorted(runs[FAMILIES[0]][0]["snr"])
    for family in FAMILIES:
        for stat in ("mean", "median"):
            cells = [family, stat]  # a blank first cell would continue the row above in reST
            for i, t in enumerate(checkpoints):
                cells.append(common.fmt([r["snr"][t][stat] for r in runs[family]], 2))
                cells.append(f"{PAPER_SNR[family][i]:g}" if stat == "mean" else "")
            snr_rows.append(cells)
    header = ["guide", "over parameters"]
    for t, paper_step in zip(checkpoints, (1000, 5000, 9000)):
        header += [f"step {t}", f"paper @{paper_step}"]
    report.table("Fig. 6 (top right): gradient SNR of the middle layer's std parameters",
                 header, snr_rows,
                 note=f"(E[g²]/Var[g] of each parameter over {args.snr_window} steps; its mean "
                 "and median over the parameters; the paper gives the mean)")

    ref = times["point estimate"]
    report.table(
        "Table 4: training step time, " + "-".join(map(str, args.timing_sizes))
        + f", batch {args.timing_batch}",
        ["method", "ms", "ratio to point estimate", "paper ratio"],
        [[name, f"{ms:.2f}", f"{ms / ref:.2f}", f"{PAPER_STEP_MS[name] / 2.0:.2f}"]
         for name, ms in times.items()],
        note=f"(2-tied / mean-field: {times['k-tied k=2'] / times['mean-field']:.2f}, "
        f"paper {PAPER_STEP_MS['k-tied k=2'] / PAPER_STEP_MS['mean-field']:.2f})",
    )

    results = {"runs": runs, "paper_shape_counts": counts, "truncation": truncation,
               "spectra": spectra, "from_guide": library, "step_ms": times,
               "paper": {"fig6": PAPER_FIG6, "table2": {str(k): v for k, v in PAPER_TABLE2.items()},
                         "snr": PAPER_SNR, "step_ms": PAPER_STEP_MS}}
    report.save(results, lambda: plot(args, runs, spectra, checkpoints))


def plot(args, runs, spectra, checkpoints):
    import matplotlib.pyplot as plt

    colors = dict(zip(FAMILIES, ("C0", "C1", "C2", "C3")))
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.6))
    for family in FAMILIES:
        curve = runs[family][0]["loss_curve"]
        axes[0].plot(*zip(*curve), color=colors[family], label=family)
        for stat, style in (("mean", "o-"), ("median", "x--")):
            values = [statistics.mean(r["snr"][t][stat] for r in runs[family])
                      for t in checkpoints]
            axes[1].plot(checkpoints, values, style, color=colors[family],
                         label=f"{family}, {stat}")
    axes[0].set(xlabel="step", ylabel="training loss / N (annealed KL)", yscale="log",
                title="training")
    axes[0].legend()
    axes[1].set(xlabel="step", ylabel="E[g²]/Var[g] over parameters", yscale="log",
                title="gradient SNR, middle layer's std parameters")
    axes[1].legend(fontsize=6, ncol=2)
    spec = spectra[0]
    for i, (site, s) in enumerate(spec.items()):
        n = min(10, len(s["std"]))
        axes[2].plot(range(1, n + 1), s["std"][:n], "o-", color=f"C{i}", label=f"{site} std")
        axes[2].plot(range(1, n + 1), s["mean"][:n], "x--", color=f"C{i}", label=f"{site} mean")
    axes[2].set(xlabel="singular value", ylabel="fraction of variance explained", yscale="log",
                title="mean-field posterior spectra (Fig. 3)")
    axes[2].legend(fontsize=7)
    return [common.savefig(fig, args, "ktied.png")]


def parse_args(argv=None):
    parser = common.make_parser(__doc__, "ktied")
    parser.add_argument("--sizes", type=int, nargs="+", default=[784, 200, 200, 10])
    parser.add_argument("--paper-sizes", type=int, nargs="+", default=[784, 400, 400, 10])
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--init-scale", type=float, default=1e-2)
    parser.add_argument("--kl-examples", type=int, default=50000,
                        help="the KL is weighted by N / kl_examples at the end of annealing")
    parser.add_argument("--num-samples", type=int, default=100)
    parser.add_argument("--snr-at", type=float, nargs=3, default=[0.1, 0.5, 0.9],
                        help="fractions of training at which the SNR is measured")
    parser.add_argument("--snr-window", type=int, default=10)
    parser.add_argument("--timing-sizes", type=int, nargs="+", default=[784, 128, 10])
    parser.add_argument("--timing-batch", type=int, default=32)
    parser.add_argument("--timing-rounds", type=int, default=15)
    parser.add_argument("--timing-block", type=int, default=20)
    args = parser.parse_args(argv)
    if args.quick:
        args.sizes, args.steps, args.seeds, args.num_samples = [784, 16, 16, 10], 40, 1, 4
        args.snr_window, args.timing_rounds, args.timing_block = 4, 2, 2
    return args


if __name__ == "__main__":
    main(parse_args())
