"""
Fig. 7/8 and Table 2 of Rossi, Michiardi, Filippone (2019) [1] on real MNIST
digits: test error and MNLL along SVI for a Bayesian network initialized by
I-BLM (:func:`pyro_vinit.init_guide_iblm`) and by the six baselines of
:func:`pyro_vinit.init_guide` (uninformative, heuristic, Xavier, orthogonal,
LSUV, MAP), each trained alike; plus a regression set (diabetes, RMSE and
MNLL) and a second classification set (MNIST-1D).

Tasks (``--tasks``):

- ``mnist-mlp``: [1]'s deep MLP, 784-100×5-10 with ReLU, on the 4,000/1,000
  digits of :func:`pyro_vinit.data.load_mnist` (Table 2, Fig. 7);
- ``mnist-cnn``: [1]'s Bayesian LeNet-5, conv 5×5 with 6 and 16 filters,
  each followed by ReLU and 2×2 max-pooling, then 256-120-84-10 with ReLU,
  on the same digits as 1×28×28 images (Fig. 8, Table E.6);
- ``mnist1d-mlp``: 40-100×5-10 on the 4,000/1,000 signals of
  :func:`pyro_vinit.data.load_mnist1d`;
- ``diabetes-mlp``: 10-100×5-1 with a Normal likelihood whose noise standard
  deviation is a latent site (prior HalfNormal(1)), on the 309/133
  standardized patients of :func:`pyro_vinit.data.load_diabetes` (as [1]'s
  deep regression, Fig. 6 / Table E.3, on the UCI-style data that ship
  locally).

Setup, the same for every method ([1], Sec. 5.1, scaled down):

- ``bayesianize``'s N(0, 1/D_in) priors on every weight and bias (the
  prior of [1]'s conference text, where the heuristic initialization is the
  prior; its supplement says N(0, 1) once, under which every sampled
  network here starts saturated); a fully factorized Normal guide
  (``common.MeanFieldNormal``, closed-form KL);
- SVI: TraceMeanField_ELBO with one weight sample per step ([1]: 16),
  Adam (lr 1e-3), minibatches of 64 ([1]'s), for 1,000 steps (MNIST MLP, 16
  epochs of our 4,000 digits) or 600 (the others); the test metrics at steps
  0, 10, 20, 50, 100, 200, 500 and at the end, from 16 posterior samples
  along training and 64 at the end ([1]: 128); 2 seeds (1 for the CNN,
  ``--cnn-seeds``);
- I-BLM: ``init_guide_iblm(guide, (x_train, y_train), batch_size=B)``,
  otherwise the library's defaults, with B = 1,024 rows per unit for the
  MNIST models (more rows than the first layer's 785 inputs, so that each
  unit's regression is determined: with 128 rows the posterior variances
  stay near the prior's and the sampled networks start at 15-20 % error),
  512 for MNIST-1D and 128 for diabetes (309 rows); MAP: ``init_guide(method="map")``, Adam on the
  means for as long (wall clock) as I-BLM took on the same task and seed,
  log-variance -5.5, as [1]; the others as ``init_guide`` defines them.

Two training protocols (``--protocols``), each applied to every method alike:

- ``paper``: the full ELBO from the first step, every guide as its
  initializer wrote it ([1]'s protocol);
- ``recipe``: the KL term weighted by 0.1 throughout
  (:class:`~pyro_vinit.poutine.KLAnnealingMessenger`), and I-BLM's standard
  deviations capped at 0.1 times the prior's
  (``init_guide_iblm(..., max_scale_ratio=0.1)``);
  the baselines keep the standard deviations that define them.

A run *did not converge* (NC, as [1]'s tables) when its final test error is
above 0.5 (chance: 0.9), or for regression its final RMSE is above 0.95
(the standardized targets' own: 1).

Usage::

    python -m benchmarks.reproduce.iblm            # about 13 CPU minutes
    python -m benchmarks.reproduce.iblm --quick    # seconds

[1] Rossi, Michiardi, Filippone (2019) "Good Initializations of Variational
Bayes for Deep Models"
"""

import time

import pyro
import pyro.distributions as dist
import torch
from pyro.infer import Predictive
from pyro.nn import PyroModule
from torch import nn
from tqdm import tqdm

from benchmarks.reproduce import common
from pyro_vinit import init_guide, init_guide_iblm
from pyro_vinit.data import load_diabetes, load_mnist, load_mnist1d
from pyro_vinit.metrics import error_rate, mnll, rmse
from pyro_vinit.nn import BayesianClassifier, bayesianize, mlp

METHODS = ("iblm", "uninformative", "heuristic", "xavier", "orthogonal", "lsuv", "map")
LABELS = {"iblm": "I-BLM", "uninformative": "uninformative", "heuristic": "heuristic",
          "xavier": "Xavier", "orthogonal": "orthogonal", "lsuv": "LSUV", "map": "MAP"}
PROTOCOLS = ("paper", "recipe")
TASKS = ("mnist-mlp", "mnist-cnn", "mnist1d-mlp", "diabetes-mlp")
PRIOR_SCALE = None  # bayesianize's N(0, 1/D_in)
IBLM_BATCH = {"mnist-mlp": 1024, "mnist-cnn": 1024, "mnist1d-mlp": 512, "diabetes-mlp": 128}
RECIPE_KL, RECIPE_CAP = 0.1, 0.1
NC_ERROR, NC_RMSE = 0.5, 0.95

# [1]'s final numbers (MNIST, 70,000 images, 100 epochs): Table E.5 (deep MLP)
# and Table E.6 (LeNet-5); None where a method did not converge ("NC") and
# absent where [1] does not report it (MAP is in Fig. 8 only).
PAPER = {
    "mnist-mlp": {
        "error": {"iblm": 0.0356, "uninformative": 0.0390, "heuristic": 0.0400,
                  "xavier": 0.0411, "orthogonal": 0.0396, "lsuv": 0.0373},
        "mnll": {"iblm": 0.1692, "uninformative": 0.1847, "heuristic": 0.1799,
                 "xavier": 0.1912, "orthogonal": 0.1822, "lsuv": 0.1723},
    },
    "mnist-cnn": {
        "error": {"iblm": 0.0087, "uninformative": None, "heuristic": None, "xavier": None,
                  "orthogonal": 0.0098, "lsuv": 0.0113},
        "mnll": {"iblm": 0.0345, "uninformative": None, "heuristic": None, "xavier": None,
                 "orthogonal": 0.0377, "lsuv": 0.0421},
    },
}


# ----------------------------------------------------------------------------- models


def lenet5() -> nn.Sequential:
    """[1]'s LeNet-5 for 1×28×28 images: ReLU after every layer but the last."""
    return nn.Sequential(
        nn.Conv2d(1, 6, 5), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(6, 16, 5), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
        nn.Linear(256, 120), nn.ReLU(), nn.Linear(120, 84), nn.ReLU(), nn.Linear(84, 10),
    )


class Regressor(PyroModule):
    """A Normal likelihood around a Bayesian network's output with a latent
    noise standard deviation ``sigma ~ HalfNormal(1)``; returns the mean."""

    def __init__(self, net: nn.Module, num_data: int):
        super().__init__()
        self.net = net
        self.num_data = num_data

    def forward(self, x, y=None):
        sigma = pyro.sample("sigma", dist.HalfNormal(x.new_tensor(1.0)))
        mean = self.net(x).squeeze(-1)
        # an explicit subsample scales the likelihood by num_data / batch, as
        # BayesianClassifier's (the test set may be larger than a training batch)
        n = max(self.num_data, x.shape[0])
        with pyro.plate("data", n, subsample=torch.arange(x.shape[0], device=x.device)):
            pyro.sample("obs", dist.Normal(mean, sigma), obs=y)
        return mean


def make_task(name: str, args):
    """``(data, make_model, kind)`` of a task."""
    depth = [args.width] * args.depth
    if name == "mnist-mlp":
        data, sizes, kind = load_mnist(), [784, *depth, 10], "classification"
    elif name == "mnist-cnn":
        data, sizes, kind = load_mnist(image=True), None, "classification"
    elif name == "mnist1d-mlp":
        data, sizes, kind = load_mnist1d(), [40, *depth, 10], "classification"
    elif name == "diabetes-mlp":
        data, sizes, kind = load_diabetes(), [10, *depth, 1], "regression"
    else:
        raise ValueError(f"unknown task {name!r}; expected one of {TASKS}")
    n = len(data[0])

    def make_model():
        net = lenet5() if sizes is None else mlp(tuple(sizes))
        net = bayesianize(net, prior_scale=PRIOR_SCALE)
        if kind == "regression":
            return Regressor(net, n)
        return BayesianClassifier(net, num_data=n)

    return data, make_model, kind


# ----------------------------------------------------------------------------- initialization


def initialize(method: str, guide, data, *, iblm_batch: int, recipe: bool,
               map_seconds=None) -> float:
    """Initializes ``guide``; returns the wall-clock seconds it took."""
    x, y = data[:2]
    start = time.perf_counter()
    if method == "iblm":
        init_guide_iblm(guide, (x, y), batch_size=iblm_batch,
                        max_scale_ratio=RECIPE_CAP if recipe else None)
    elif method == "map":
        init_guide(guide, (x, y), method="map", map_steps=10**6, map_seconds=map_seconds)
    else:
        init_guide(guide, (x, y), method=method)
    return time.perf_counter() - start


# ----------------------------------------------------------------------------- training


def checkpoints(steps: int):
    """0, then 10, 20, 50, 100, ... up to ``steps``."""
    out = {0, steps}
    for e in range(1, 7):
        for m in (1, 2, 5):
            if m * 10**e < steps:
                out.add(m * 10**e)
    return sorted(out)


@torch.no_grad()
def evaluate(model, guide, kind, x, y, num_samples):
    if kind == "classification":
        logits = common.predict_logits(model, guide, x, num_samples)
        return {"error": error_rate(y, logits=logits).item(), "mnll": mnll(y, logits=logits).item()}
    samples = Predictive(model, guide=guide, num_samples=num_samples,
                         return_sites=["_RETURN", "sigma"])(x)
    loc, sigma = samples["_RETURN"], samples["sigma"].reshape(-1, 1)
    return {"rmse": rmse(y, loc=loc).item(), "mnll": mnll(y, loc=loc, scale=sigma).item()}


def run(task, method, protocol, seed, setup, args, map_seconds=None):
    data, make_model, kind = setup
    x, y, x_test, y_test = data
    recipe = protocol == "recipe"
    pyro.set_rng_seed(seed)
    model = make_model()
    guide = common.MeanFieldNormal(model)
    with torch.no_grad():
        guide(x[:2], y[:2])  # set up the guide's parameters
    seconds = initialize(method, guide, data, iblm_batch=min(args.iblm_batch[task], len(x)),
                         recipe=recipe, map_seconds=map_seconds)
    steps = args.steps[task]
    marks = set(checkpoints(steps))
    curve = {"step": [], "metrics": []}

    def record(step, num_samples):
        curve["step"].append(step)
        curve["metrics"].append(evaluate(model, guide, kind, x_test, y_test, num_samples))

    def on_gradients(step):
        # called after the backward pass of step ``step``, before its update
        if step in marks:
            record(step, args.num_samples)

    common.fit(model, guide, x, y, steps=steps, lr=args.lr, batch_size=args.batch_size,
               kl_scale=RECIPE_KL if recipe else 1.0, on_gradients=on_gradients,
               desc=f"{task}, {protocol}, {method}, seed {seed}")
    record(steps, args.final_samples)
    return {"seconds": seconds, **curve}


# ----------------------------------------------------------------------------- report


def converged(kind, metrics) -> bool:
    if kind == "classification":
        return metrics["error"] <= NC_ERROR
    return metrics["rmse"] <= NC_RMSE


def main(args):
    common.setup(args)
    report = common.Report(args, "iblm")
    results = {}
    kinds = {}
    total = len(args.protocols) * len(METHODS) * sum(args.task_seeds[t] for t in args.tasks)
    bar = tqdm(total=total, desc="runs", mininterval=2)
    for task in args.tasks:
        setup = make_task(task, args)
        kinds[task] = setup[2]
        results[task] = {}
        for protocol in args.protocols:
            runs = {m: [] for m in METHODS}
            for seed in range(args.task_seeds[task]):
                for method in METHODS:  # I-BLM first: MAP gets its time
                    map_seconds = runs["iblm"][seed]["seconds"] if method == "map" else None
                    runs[method].append(run(task, method, protocol, seed, setup, args,
                                            map_seconds))
                    bar.update()
            results[task][protocol] = runs
    bar.close()
    tables(report, args, results, kinds)
    report.save({"results": results, "kinds": kinds, "paper": PAPER,
                 "steps": args.steps},
                lambda: plot(args, results, kinds))


def _final(runs, key):
    return [r["metrics"][-1][key] for r in runs]


def _fmt(values):
    """``common.fmt``, with three significant digits for the huge values of the
    uninformative start."""
    mean, sd = common.mean_sd(values)
    if abs(mean) < 1000:
        return common.fmt(values)
    return f"{mean:.3g}" if len(values) < 2 else f"{mean:.3g} ± {sd:.2g}"


def _cell(kind, runs, key):
    """``mean ± sd``, marked NC when no seed converged, or with the number that did not."""
    failed = sum(not converged(kind, r["metrics"][-1]) for r in runs)
    text = _fmt(_final(runs, key))
    if failed == len(runs):
        return f"NC ({text})"
    return text if failed == 0 else f"{text} ({failed} NC)"


def _paper_cell(task, key, method):
    table = PAPER.get(task, {}).get(key, {})
    if method not in table:
        return "–"
    return "NC" if table[method] is None else f"{table[method]:.4f}"


def tables(report, args, results, kinds):
    for task, by_protocol in results.items():
        kind = kinds[task]
        keys = ("error", "mnll") if kind == "classification" else ("rmse", "mnll")
        steps = args.steps[task]
        for protocol, runs in by_protocol.items():
            rows = []
            for method in METHODS:
                rs = runs[method]
                row = [LABELS[method]]
                for key in keys:
                    row.append(_fmt([r["metrics"][0][key] for r in rs]))
                    row.append(_cell(kind, rs, key))
                    if task in PAPER:
                        row.append(_paper_cell(task, key, method))
                row.append(f"{sum(r['seconds'] for r in rs) / len(rs):.1f}")
                rows.append(row)
            header = ["init"]
            for key in keys:
                header += [f"{key} @0", f"{key} @{steps}"] + (["[1]"] if task in PAPER else [])
            header.append("init s")
            what = ("full ELBO" if protocol == "paper" else
                    f"KL × {RECIPE_KL}, I-BLM std ≤ {RECIPE_CAP} × prior")
            report.table(
                f"{task}, {protocol} protocol ({what}): test metrics right after "
                f"initialization and after {steps} steps", header, rows,
                note=f"(mean ± sd over {len(runs['iblm'])} seed(s); NC: did not converge"
                + ("; [1]: the paper's final numbers on all of MNIST)" if task in PAPER else ")"))


def plot(args, results, kinds):
    import matplotlib.pyplot as plt

    written = []
    for protocol in args.protocols:
        tasks = [t for t in results if protocol in results[t]]
        fig, axes = plt.subplots(len(tasks), 2, figsize=(10, 3.2 * len(tasks)), squeeze=False)
        for row, task in zip(axes, tasks):
            kind = kinds[task]
            keys = ("error", "mnll") if kind == "classification" else ("rmse", "mnll")
            runs = results[task][protocol]
            for ax, key in zip(row, keys):
                for i, method in enumerate(METHODS):
                    rs = runs[method]
                    steps = rs[0]["step"]
                    mean = [sum(r["metrics"][j][key] for r in rs) / len(rs)
                            for j in range(len(steps))]
                    ax.plot([max(s, 1) for s in steps], mean, "o-" if method == "iblm" else ".-",
                            color=f"C{i}", lw=2 if method == "iblm" else 1, ms=3,
                            label=LABELS[method])
                paper = PAPER.get(task, {}).get(key, {}).get("iblm")
                if paper is not None:
                    ax.axhline(paper, color="C0", ls=":", lw=1, label="[1] I-BLM, final")
                ax.set(xscale="log", yscale="log", xlabel="SVI step (0 plotted at 1)",
                       ylabel=f"test {key}", title=f"{task} ({protocol})")
            row[0].legend(fontsize=7)
        fig.tight_layout()
        written.append(common.savefig(fig, args, f"iblm_{protocol}.png"))
    return written


DEFAULT_STEPS = {"mnist-mlp": 1000, "mnist-cnn": 600, "mnist1d-mlp": 600, "diabetes-mlp": 600}


def parse_args(argv=None):
    parser = common.make_parser(__doc__, "iblm", seeds=2)
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS)
    parser.add_argument("--protocols", nargs="+", default=list(PROTOCOLS), choices=PROTOCOLS)
    parser.add_argument("--steps", type=int, default=None,
                        help=f"SVI steps of every task (default: {DEFAULT_STEPS})")
    parser.add_argument("--width", type=int, default=100, help="hidden units per MLP layer")
    parser.add_argument("--depth", type=int, default=5, help="hidden layers of the MLPs")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--cnn-seeds", type=int, default=1,
                        help="at most this many seeds for mnist-cnn (its runs are the slowest)")
    parser.add_argument("--num-samples", type=int, default=16,
                        help="posterior samples of each test evaluation along training")
    parser.add_argument("--final-samples", type=int, default=64,
                        help="posterior samples of the final test evaluation")
    args = parser.parse_args(argv)
    args.steps = ({t: args.steps for t in TASKS} if args.steps is not None
                  else dict(DEFAULT_STEPS))
    if args.quick:
        args.steps = {t: 5 for t in TASKS}
        args.width, args.depth, args.seeds = 16, 2, 1
        args.num_samples = args.final_samples = 2
        args.iblm_batch = {t: 64 for t in TASKS}
    else:
        args.iblm_batch = dict(IBLM_BATCH)
    args.task_seeds = {t: args.seeds for t in TASKS}
    args.task_seeds["mnist-cnn"] = max(1, min(args.seeds, args.cnn_seeds))
    return args


if __name__ == "__main__":
    main(parse_args())
