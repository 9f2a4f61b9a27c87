"""
Radial BNNs of Farquhar, Osborne, Gal (2020) [1] on real MNIST digits:
robustness to hyperparameters (Section 4.1.3, Fig. 4) and the posterior of
one task as the prior of the next in continual learning (Section 4.2,
Fig. 5), mean-field against radial.

*Robustness.* A ReLU MLP 784-100-100-10 with a unit Normal prior N(0, 1) on
every weight (the prior of [1]'s analysis, under which the KL pulls every
standard deviation towards 1), trained on the 4,000 training digits of
:func:`pyro_vinit.data.load_mnist` with TraceMeanField_ELBO (closed-form KL
for both guides) and Adam, minibatches of 128, 300 steps (10 epochs), over
the grid initial σ₀ ∈ {0.01, 0.1, 0.3, 1} × learning rate ∈ {0.001, 0.01}
× 2 seeds. [1]'s radial posterior is w = μ + σ ⊙ (ε/‖ε‖) r, with the same
σ as mean-field's w = μ + σ ⊙ ε, so one initial σ₀ gives radial weights
√D times less noise per element (D: the layer's size) than mean-field
weights. :class:`~pyro_vinit.AutoRadialNormal` instead parameterizes the
per-element marginal standard deviation s = σ/√D (its ``init_scale``). The
grid therefore has three guides: *mean-field* (σ = σ₀), *radial* (σ = σ₀
per element of every layer, as in [1]; set through the guide's ``scales``
to σ₀/√D) and *radial, marginal σ₀* (``init_scale=σ₀``: the same
per-element noise as mean-field). Each run's test accuracy (100 posterior
samples) is counted as *near chance* (< 0.2; chance is 0.1), *failed*
(< 0.5) or *good* (≥ 0.8, about the best any guide reaches in 300 steps).
[1] sampled 86 configurations of a VGG-like network on retinopathy images
(optimizer, learning rate and its decay, batch size, samples, initial
variance): 82 % of the mean-field runs and 39 % of the
radial ones ended near chance, 11 % and 44 % reached a good AUC.

*Continual learning.* Split MNIST: five tasks (digits 0/1, 2/3, 4/5, 6/7,
8/9), learnt in sequence by a multi-headed network (a shared body
784-100-100 and one two-way head per task) as in [1]'s split
FashionMNIST; the data of a task is discarded once learnt. Task t's
posterior over the body becomes task t + 1's prior, and its means the
initial means of task t + 1's guide (variational continual learning). Each
task: 200 steps of Adam (lr 1e-2), minibatches of 128, initial standard
deviation 1e-2, first task's prior N(0, 1/D_in), the full KL. (With an
initial standard deviation of 1e-3 and lr 1e-3 the first task's posterior
is still far narrower than its equilibrium after 200 steps, and as the next
prior it freezes the body: the later tasks are not learnt at all.) After
the last task, each task is scored with the final body and its own head.
The prior made from a posterior is :func:`pyro_vinit.posterior_as_prior`'s
(set by :func:`pyro_vinit.set_priors`): for mean-field the factorized
Normal of the posterior (closed-form KL), for radial the radial posterior
itself, as in [1], whose KL to the next radial posterior
TraceMeanField_ELBO estimates by Monte Carlo (no closed form is known).

Usage::

    python -m benchmarks.reproduce.radial            # about 4 CPU minutes
    python -m benchmarks.reproduce.radial --quick    # seconds

[1] Farquhar, Osborne, Gal (2020) "Radial Bayesian Neural Networks: Beyond
Discrete Support in Large-Scale Bayesian Deep Learning"
"""

import itertools

import pyro
import pyro.poutine as poutine
import torch
import torch.nn.functional as F
from pyro.infer.autoguide import init_to_sample
from torch import nn
from tqdm import tqdm

import pyro_vinit
from benchmarks.reproduce import common
from pyro_vinit.data import load_mnist
from pyro_vinit.guides import site_params
from pyro_vinit.nn import BayesianClassifier, bayesianize, mlp

FAMILIES = ("mean-field", "radial")
GRID_GUIDES = ("mean-field", "radial", "radial, marginal σ₀")
TASKS = ((0, 1), (2, 3), (4, 5), (6, 7), (8, 9))
# [1], Section 4.1.3: fraction of the 86 sampled configurations
PAPER_ROBUSTNESS = {"mean-field": {"near_chance": 0.82, "good": 0.11},
                    "radial": {"near_chance": 0.39, "good": 0.44},
                    "radial, marginal σ₀": {"near_chance": None, "good": None}}


# ----------------------------------------------------------------------------- robustness


def set_radial_sigma(guide, sigma):
    """Sets the radial scale σ of every site of an AutoRadialNormal to ``sigma``,
    as [1] parameterizes it: its per-element marginal standard deviations to
    sigma / √D."""
    for name in site_params.latent_sites(guide):
        loc, scale = guide.get_loc_and_scale(name)
        guide.set_loc_and_scale(name, loc, torch.full_like(scale, sigma / loc.numel() ** 0.5))


def robustness(args, data):
    x, y, x_test, y_test = data
    grid = list(itertools.product(args.init_scales, args.lrs, range(args.seeds)))
    runs = {name: [] for name in GRID_GUIDES}
    bar = tqdm(total=len(GRID_GUIDES) * len(grid), desc="robustness grid", mininterval=2)
    for name in GRID_GUIDES:
        for init_scale, lr, seed in grid:
            pyro.set_rng_seed(seed)
            model = common.make_model(args.sizes, len(x), prior_scale=args.prior_scale)
            family = "radial" if name.startswith("radial") else name
            guide = common.make_guide(family, model, init_scale=init_scale)
            if name == "radial":
                with torch.no_grad():
                    guide(x[:2], y[:2])
                set_radial_sigma(guide, init_scale)
            fit = common.fit(model, guide, x, y, steps=args.steps, lr=lr,
                             batch_size=args.batch_size)
            logits = common.predict_logits(model, guide, x_test, args.num_samples)
            acc = (logits.softmax(-1).mean(0).argmax(-1) == y_test).float().mean().item()
            runs[name].append({"init_scale": init_scale, "lr": lr, "seed": seed,
                               "accuracy": acc, "final_loss": fit["loss"][-1]})
            bar.update()
    bar.close()
    return runs


# ----------------------------------------------------------------------------- continual


class MultiHead(nn.Module):
    """A shared ReLU body and one linear head per task; ``task`` selects the head."""

    def __init__(self, sizes, num_tasks, num_classes=2):
        super().__init__()
        self.body = mlp(tuple(sizes))
        self.heads = nn.ModuleList(nn.Linear(sizes[-1], num_classes) for _ in range(num_tasks))
        self.task = 0

    def forward(self, x):
        return self.heads[self.task](F.relu(self.body(x)))


def bayesian_multi_head(sizes, num_tasks):
    """A Bayesian :class:`MultiHead` and the names of its body's sample sites
    inside a ``BayesianClassifier`` (read before ``bayesianize`` turns the
    parameters into sample sites)."""
    net = MultiHead(sizes, num_tasks)
    body_sites = [f"net.body.{name}" for name, _ in net.body.named_parameters()]
    return bayesianize(net), body_sites


def task_data(x, y, task):
    mask = (y == task[0]) | (y == task[1])
    return x[mask], (y[mask] == task[1]).long()


def body_priors(guide, names):
    """The next task's prior of each body site: this task's posterior
    (:func:`pyro_vinit.posterior_as_prior`)."""
    priors = pyro_vinit.posterior_as_prior(guide)
    return {name: priors[name] for name in names}


@torch.no_grad()
def task_accuracy(model, body_guide, head_guide, task, x, y, num_samples):
    """Accuracy on ``task`` with the body from ``body_guide`` and the head from
    ``head_guide`` (each a dict of samples per draw)."""
    model.net.task = task
    probs = 0.0
    for _ in range(num_samples):
        body = {k: v for k, v in body_guide(x[:1]).items() if ".body." in k}
        head = {k: v for k, v in head_guide(x[:1]).items() if f".heads.{task}." in k}
        logits = poutine.condition(model, data={**body, **head})(x)
        probs = probs + logits.softmax(-1)
    return (probs.argmax(-1) == y).float().mean().item()


def continual(args, family, seed, data):
    x, y, x_test, y_test = data
    pyro.set_rng_seed(seed)
    net, body_sites = bayesian_multi_head(args.cl_sizes, len(TASKS))
    model = BayesianClassifier(net)
    guides, init_locs = [], {}
    accuracy = []  # accuracy[t][s]: after task t, on task s <= t
    for t, task in enumerate(TASKS):
        xt, yt = task_data(x, y, task)
        model.num_data, net.task = len(xt), t

        def init_loc_fn(site, init_locs=init_locs):
            if site["name"] in init_locs:
                return init_locs[site["name"]]
            return init_to_sample(site)

        guide = common.make_guide(family, model, init_scale=args.cl_init_scale,
                                  init_loc_fn=init_loc_fn)
        common.fit(model, guide, xt, yt, steps=args.cl_steps, lr=args.cl_lr,
                   batch_size=args.batch_size)
        guides.append(guide)
        pyro_vinit.set_priors(model, body_priors(guide, body_sites))
        init_locs = {name: guide.get_loc_and_scale(name)[0].detach().clone()
                     for name in body_sites}
        accuracy.append([
            task_accuracy(model, guide, guides[s], s, *task_data(x_test, y_test, TASKS[s]),
                          args.num_samples)
            for s in range(t + 1)
        ])
    return {"accuracy": accuracy}


# ----------------------------------------------------------------------------- report


def main(args):
    common.setup(args)
    report = common.Report(args, "radial")
    data = load_mnist()
    grid = robustness(args, data)

    rows = []
    summary = {}
    for family in GRID_GUIDES:
        accs = [r["accuracy"] for r in grid[family]]
        near = sum(a < args.chance for a in accs) / len(accs)
        failed = sum(a < args.failed for a in accs) / len(accs)
        good = sum(a >= args.good for a in accs) / len(accs)
        summary[family] = {"near_chance": near, "failed": failed, "good": good,
                           "runs": len(accs)}
        p = {k: "–" if v is None else f"{v:.0%}" for k, v in PAPER_ROBUSTNESS[family].items()}
        rows.append([family, str(len(accs)), f"{near:.0%}", p["near_chance"], f"{failed:.0%}",
                     f"{good:.0%}", p["good"],
                     f"{sum(accs) / len(accs):.3f}", f"{sorted(accs)[len(accs) // 2]:.3f}"])
    report.table(
        "Robustness: fraction of runs near chance, failed and good",
        ["guide", "runs", f"acc. < {args.chance:g}", "paper", f"acc. < {args.failed:g}",
         f"acc. ≥ {args.good:g}", "paper (good AUC)", "mean acc.", "median acc."],
        rows, note=f"(MLP {'-'.join(map(str, args.sizes))}, prior N(0, {args.prior_scale:g}²), "
        f"{args.steps} steps; grid σ₀ {args.init_scales} × lr {args.lrs} × {args.seeds} seeds)",
    )
    cells = []
    for init_scale in args.init_scales:
        for lr in args.lrs:
            row = [f"{init_scale:g}", f"{lr:g}"]
            for family in GRID_GUIDES:
                accs = [r["accuracy"] for r in grid[family]
                        if r["init_scale"] == init_scale and r["lr"] == lr]
                row.append(common.fmt(accs))
            cells.append(row)
    report.table("Robustness: test accuracy per configuration",
                 ["initial σ₀", "lr", *GRID_GUIDES], cells,
                 note=f"(mean ± sd over {args.seeds} seeds)")

    cl = {family: [continual(args, family, seed, data) for seed in
                   tqdm(range(args.seeds), desc=f"continual {family}", leave=False)]
          for family in FAMILIES}
    rows = []
    for family in FAMILIES:
        final = [run["accuracy"][-1] for run in cl[family]]
        row = [family]
        for s in range(len(TASKS)):
            row.append(common.fmt([f[s] for f in final]))
        row.append(common.fmt([sum(f) / len(f) for f in final]))
        first = [run["accuracy"][0][0] for run in cl[family]]
        row.append(common.fmt(first))
        rows.append(row)
    report.table(
        "Continual learning on split MNIST: accuracy of the final model on each task",
        ["guide", *(f"task {a}/{b}" for a, b in TASKS), "average", "task 0/1 when learnt"],
        rows, note=f"(multi-head, body {'-'.join(map(str, args.cl_sizes))}; mean ± sd over "
        f"{args.seeds} seeds; each task's prior: the last posterior, posterior_as_prior)",
    )
    report.save({"robustness": grid, "robustness_summary": summary, "continual": cl,
                 "paper": PAPER_ROBUSTNESS},
                lambda: plot(args, grid, cl))


def plot(args, grid, cl):
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(18, 3.8),
                             gridspec_kw={"width_ratios": [1, 1, 1, 1.5]})
    for ax, family in zip(axes, GRID_GUIDES):
        acc = torch.tensor([
            [sum(r["accuracy"] for r in grid[family] if r["init_scale"] == s and r["lr"] == lr)
             / args.seeds for lr in args.lrs]
            for s in args.init_scales
        ])
        image = ax.imshow(acc, vmin=0, vmax=1, cmap="viridis", origin="lower")
        for i in range(len(args.init_scales)):
            for j in range(len(args.lrs)):
                ax.text(j, i, f"{acc[i, j]:.2f}", ha="center", va="center", fontsize=8,
                        color="white" if acc[i, j] < 0.6 else "black")
        ax.set_xticks(range(len(args.lrs)), [f"{lr:g}" for lr in args.lrs])
        ax.set_yticks(range(len(args.init_scales)), [f"{s:g}" for s in args.init_scales])
        ax.set(xlabel="learning rate", ylabel="initial σ₀", title=f"{family}: test accuracy")
    fig.colorbar(image, ax=axes[:3], shrink=0.8)
    ax = axes[3]
    width = 0.38
    for k, family in enumerate(FAMILIES):
        final = torch.tensor([run["accuracy"][-1] for run in cl[family]])
        ax.bar(torch.arange(len(TASKS)) + (k - 0.5) * width, final.mean(0), width,
               yerr=final.std(0) if len(final) > 1 else None, label=family)
    ax.set_xticks(range(len(TASKS)), [f"{a}/{b}" for a, b in TASKS])
    ax.set(xlabel="task", ylabel="accuracy after all five tasks", ylim=(0.5, 1.0),
           title="split MNIST, multi-head (cf. [1] Fig. 5)")
    ax.legend(loc="lower right")
    return [common.savefig(fig, args, "radial.png")]


def parse_args(argv=None):
    parser = common.make_parser(__doc__, "radial")
    parser.add_argument("--sizes", type=int, nargs="+", default=[784, 100, 100, 10])
    parser.add_argument("--prior-scale", type=float, default=1.0)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--init-scales", type=float, nargs="+", default=[1e-2, 0.1, 0.3, 1.0],
                        help="initial σ₀ of the grid")
    parser.add_argument("--lrs", type=float, nargs="+", default=[1e-3, 1e-2])
    parser.add_argument("--chance", type=float, default=0.2, help="accuracy counted near chance")
    parser.add_argument("--failed", type=float, default=0.5, help="accuracy counted failed")
    parser.add_argument("--good", type=float, default=0.8, help="accuracy counted good")
    parser.add_argument("--num-samples", type=int, default=100)
    parser.add_argument("--cl-sizes", type=int, nargs="+", default=[784, 100, 100])
    parser.add_argument("--cl-steps", type=int, default=200)
    parser.add_argument("--cl-lr", type=float, default=1e-2)
    parser.add_argument("--cl-init-scale", type=float, default=1e-2)
    args = parser.parse_args(argv)
    if args.quick:
        args.sizes, args.steps, args.seeds, args.num_samples = [784, 16, 16, 10], 10, 1, 4
        args.init_scales, args.lrs = [1e-2, 0.3], [1e-2]
        args.cl_sizes, args.cl_steps = [784, 16, 16], 10
    return args


if __name__ == "__main__":
    main(parse_args())
