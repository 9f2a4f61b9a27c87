"""
The race: training time from a fresh network to test-quality targets, ours
against the peers, side by side in one run on one thread.

Problems (``--problems``): ``digits_mlp`` (scikit-learn digits, ReLU MLP
64-100×5-10), ``digits_cnn`` (digits as 8×8 images, conv(8, 3×3) → ReLU →
conv(16, 3×3, stride 2) → ReLU → linear(10)) and ``mnist_mlp`` (the 5,000
MNIST digits of :func:`pyro_vinit.data.load_mnist`, ReLU MLP 784-200-200-10;
needs the ``[mnist]`` extra). Minibatches of 128 drawn at random, every
method.

Methods:

* ``ours (I-BLM)``: ``pyro_vinit.fit`` with its defaults when the package has
  it: one call of ``fit`` for I-BLM and the first step, then the steps of a
  long ``fit`` call one at a time, as a user's own loop takes them with
  ``fit_config``: fit's ELBO, handlers and optimizer (``GroupedAdam`` at
  fit's learning rate) through :class:`~pyro_vinit.CapturedSVI` (which a
  long ``fit`` call uses; its tracing step on the clock), each step followed
  by the update of fit's moving average of the parameters
  (:meth:`~pyro_vinit.FitConfig.averager`, on the clock), which is what is
  evaluated; otherwise the
  README's recipe: ``AutoKTiedNormal(rank=2)``,
  ``init_guide_iblm(batch_size=512, max_scale_ratio=0.1)`` (on the clock),
  then ``TraceMeanField_ELBO`` under ``KLAnnealingMessenger(0.1)`` and
  ``local_reparam()``, Adam 1e-3;
* ``ours (trained net)``: the same guide and training, started by
  ``init_guide_pretrained`` from a deterministically pre-trained network (its
  weights as the means, I-BLM's per-layer regressions for the standard
  deviations; the pre-training on the clock);
* ``Pyro AutoNormal``: Pyro's ``AutoNormal`` with its default init on the same
  model, ``Trace_ELBO``, Adam 1e-3;
* the peers of ``_peers.py``: bayesian-torch from random init and from its
  MOPED start (the same pre-training, on the clock), IVON, and NumPyro's
  ``AutoNormal`` (default init, ``jit``) in its own process (``--numpyro-python``;
  jax's compilation is done first, off the clock, unless ``--numpyro-cold``).

The training clock runs during set-up (initialization, pre-training) and the
steps only: every method is evaluated (test MNLL and error of the Monte Carlo
predictive from ``--num-samples`` posterior draws) at the same checkpoints of
training time, with the clock stopped. From each curve: the training time to
each target (the first checkpoint at or under it) and the best test MNLL and
error within ``--budget``; medians over ``--seeds``. Targets of issue 22:
ours ≤ 0.5× the best peer's time to each target, and ours' best MNLL within
the budget ≤ the best peer's, on every problem.

Pyro's validation is off for both Pyro methods (``--validation`` turns it on).

Usage::

    python -m benchmarks.bench_time_to_quality                 # full race (~35 min idle)
    python -m benchmarks.bench_time_to_quality --problems mnist_mlp --seeds 1 --budget 10
    python -m benchmarks.bench_time_to_quality --quick         # smoke run (seconds)
"""

import argparse
import json
import math
import os
import platform
import statistics
import tempfile
import time

import pyro
import torch
from pyro.infer import SVI, Predictive, Trace_ELBO, TraceMeanField_ELBO
from pyro.infer.autoguide import AutoNormal
from torch import nn

import pyro_vinit
from benchmarks import _peers, harness
from pyro_vinit import AutoKTiedNormal, init_guide_iblm, init_guide_pretrained
from pyro_vinit.data import load_digits, load_mnist
from pyro_vinit.metrics import error_rate, mnll
from pyro_vinit.nn import BayesianClassifier, bayesianize, mlp
from pyro_vinit.poutine import KLAnnealingMessenger, local_reparam

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
BATCH_SIZE = 128


def cnn():
    """The digits CNN (the I-BLM paper's, as in pyro_vinit.testing.paper_problems)."""
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(),
        nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.ReLU(),
        nn.Flatten(), nn.Linear(16 * 4 * 4, 10),
    )


# targets: (looser, tighter) per metric; the digits pairs are the MNIST pairs'
# analogues (about 2× and 1.5× the best figures there, as 0.4 / 0.3 are on MNIST-5k)
PROBLEMS = {
    "digits_mlp": dict(data=lambda: load_digits(), net=lambda: mlp((64,) + (100,) * 5 + (10,)),
                       arch={"kind": "mlp", "sizes": [64] + [100] * 5 + [10]},
                       targets={"mnll": (0.3, 0.2), "error": (0.08, 0.05)}, pretrain_epochs=20),
    "digits_cnn": dict(data=lambda: load_digits(image=True), net=cnn, arch={"kind": "cnn"},
                       targets={"mnll": (0.3, 0.2), "error": (0.08, 0.05)}, pretrain_epochs=20),
    "mnist_mlp": dict(data=lambda: load_mnist(), net=lambda: mlp((784, 200, 200, 10)),
                      arch={"kind": "mlp", "sizes": [784, 200, 200, 10]},
                      targets={"mnll": (0.4, 0.3), "error": (0.10, 0.08)}, pretrain_epochs=5),
}

OURS = "ours (I-BLM)"
OURS_TRAINED = "ours (trained net)"
METHODS = [OURS, OURS_TRAINED, "Pyro AutoNormal", "bayesian-torch", "bayesian-torch MOPED",
           "IVON", "NumPyro AutoNormal"]
PEERS = METHODS[2:]


def checkpoints(budget):
    """Training times (s) at which every method is evaluated: every 0.25 s up to
    4 s, every 0.5 s up to 10 s, then every second, and the budget."""
    grid = [0.25 * i for i in range(1, 17)] + [4 + 0.5 * i for i in range(1, 13)]
    grid += [float(t) for t in range(11, math.ceil(budget))]
    return [t for t in grid if t < budget] + [float(budget)]


def race(runner, evaluate, points, clock=time.perf_counter):
    """Runs ``runner`` (``setup()``, then ``step()``s) with a training clock that
    counts only those calls, and calls ``evaluate(runner)`` (off the clock) right
    after set-up and at each of ``points`` past it. Returns the curve, a list of
    ``{"seconds", **evaluate(runner)}``, and the number of steps."""
    start = clock()
    runner.setup()
    elapsed = clock() - start
    curve = [{"seconds": elapsed, **evaluate(runner)}]
    steps = 0
    for point in points:
        if point <= elapsed:
            continue
        while elapsed < point:
            start = clock()
            runner.step()
            elapsed += clock() - start
            steps += 1
        curve.append({"seconds": elapsed, **evaluate(runner)})
    return curve, steps


def time_to(curve, metric, target):
    """The training time of the first point of ``curve`` at or under ``target``
    (None if it never gets there)."""
    return next((p["seconds"] for p in curve if p[metric] <= target), None)


def median(values):
    """The median, None standing for "never" (after every number); None if that
    is where the median falls."""
    value = statistics.median([math.inf if v is None else v for v in values])
    return None if math.isinf(value) else value


class _PyroRunner:
    """A Pyro model of ``make_net()`` with N(0, 1/D_in) priors and its guide,
    trained by ``SVI``; ``logits`` from guide draws through ``Predictive``."""

    def __init__(self, make_net, x, y, batch_size):
        self.make_net, self.x, self.y, self.batch_size = make_net, x, y, batch_size

    def _model(self, net, keep_weights=False):
        pyro.clear_param_store()
        return BayesianClassifier(bayesianize(net, keep_weights=keep_weights),
                                  num_data=len(self.x))

    def _batch(self):
        batch = torch.randint(len(self.x), (self.batch_size,))
        return self.x[batch], self.y[batch]

    @torch.no_grad()
    def logits(self, x, num_samples):
        predictive = Predictive(self.model, guide=self.guide, num_samples=num_samples,
                                return_sites=["_RETURN"])
        return predictive(x)["_RETURN"]


class PyroAutoNormal(_PyroRunner):
    """Pyro's ``AutoNormal`` with its default init, ``Trace_ELBO``, Adam 1e-3."""

    def setup(self):
        self.model = self._model(self.make_net())
        self.guide = AutoNormal(self.model)
        self.guide(self.x[:2], self.y[:2])  # its parameters (the first step would make them)
        self.svi = SVI(self.model, self.guide, pyro.optim.Adam({"lr": 1e-3}), Trace_ELBO())

    def step(self):
        self.svi.step(*self._batch())


class Ours(_PyroRunner):
    """Our recipe from I-BLM (``start="iblm"``) or from a deterministically
    pre-trained network (``start="trained"``): ``pyro_vinit.fit`` if the
    package has it (``use_fit``), else the README's loop."""

    def __init__(self, make_net, x, y, batch_size, start="iblm", pretrain_epochs=0,
                 use_fit=False, overrides=None, make_guide=None, init_options=None):
        super().__init__(make_net, x, y, batch_size)
        # the race's guide; another for the benchmarks that reuse this runner
        self.make_guide = make_guide or (lambda model: AutoKTiedNormal(model, rank=2))
        self.start, self.pretrain_epochs = start, pretrain_epochs
        self.use_fit = use_fit
        self.overrides = overrides or {}  # fit_config's lr / kl_weight, where given
        self.init_options = init_options  # init_guide_iblm's, over fit's

    def setup(self):
        net = self.make_net()
        if self.start == "trained":
            _peers.pretrain(net, self.x, self.y, self.pretrain_epochs, self.batch_size)
        self.model = self._model(net, keep_weights=self.start == "trained")
        self.guide = self.make_guide(self.model)
        if self.start == "trained":
            init_guide_pretrained(self.guide, (self.x, self.y))
        # fit's own optimizer (GroupedAdam at fit's learning rate), for every step
        self.optim = pyro_vinit.fit_config(self.guide, **self.overrides).optimizer()
        if self.use_fit:
            # one call with the chosen init, then fit's configuration step by step,
            # captured as a long fit call takes its steps
            init = "iblm" if self.start == "iblm" else None
            pyro_vinit.fit(self.model, self.guide, (self.x, self.y), steps=1,
                           batch_size=self.batch_size, optim=self.optim, init=init,
                           init_options=self.init_options, progress=False)
            self.config = pyro_vinit.fit_config(self.guide, **self.overrides)
            captured = getattr(pyro_vinit, "CapturedSVI", SVI)  # an older package: eager
            self.svi = captured(self.model, self.guide, self.optim, self.config.elbo())
            # fit's moving average of the parameters, which it evaluates (older packages: none)
            self.average = (self.config.averager() if hasattr(self.config, "averager")
                            else None)
            return
        if self.start == "iblm":
            init_guide_iblm(self.guide, (self.x, self.y), batch_size=512, max_scale_ratio=0.1)
        self.svi = SVI(self.model, self.guide, self.optim, TraceMeanField_ELBO())

    def step(self):
        if self.use_fit:
            with self.config.handlers():
                self.svi.step(*self._batch())
            if self.average is not None:
                self.average.update()
            return
        with KLAnnealingMessenger(0.1), local_reparam():
            self.svi.step(*self._batch())

    def logits(self, x, num_samples):
        if getattr(self, "average", None) is None:
            return super().logits(x, num_samples)
        with self.average.swapped():
            return super().logits(x, num_samples)


def ours_overrides(args):
    """fit_config's settings that ``--lr`` and ``--kl-weight`` override for ours."""
    return {k: v for k, v in (("lr", getattr(args, "lr", None)),
                              ("kl_weight", getattr(args, "kl_weight", None)),
                              ("average", getattr(args, "average", None))) if v is not None}


def make_runner(method, spec, data, args):
    x, y = data[0], data[1]
    if method == OURS:
        return Ours(spec["net"], x, y, BATCH_SIZE, use_fit=args.use_fit,
                    overrides=ours_overrides(args),
                    init_options=harness.iblm_options(getattr(args, "iblm_kl_weight", None),
                                                      getattr(args, "iblm_options", None)))
    if method == OURS_TRAINED:
        return Ours(spec["net"], x, y, BATCH_SIZE, start="trained",
                    pretrain_epochs=spec["pretrain_epochs"], use_fit=args.use_fit,
                    overrides=ours_overrides(args))
    if method == "Pyro AutoNormal":
        return PyroAutoNormal(spec["net"], x, y, BATCH_SIZE)
    if method == "bayesian-torch":
        return _peers.BayesianTorch(spec["net"], x, y, BATCH_SIZE)
    if method == "bayesian-torch MOPED":
        return _peers.BayesianTorch(spec["net"], x, y, BATCH_SIZE, moped=True,
                                    pretrain_epochs=spec["pretrain_epochs"])
    if method == "IVON":
        return _peers.IVONRunner(spec["net"], x, y, BATCH_SIZE)
    raise ValueError(f"unknown method {method!r}")


def missing(method, args):
    """Why ``method`` cannot run here (None if it can)."""
    if method.startswith("bayesian-torch") and _peers.BAYESIAN_TORCH is None:
        return _peers.MISSING["bayesian-torch"]
    if method == "IVON" and _peers.IVON is None:
        return _peers.MISSING["ivon"]
    if method == "NumPyro AutoNormal":
        return _peers.numpyro_missing(args.numpyro_python)
    return None


def run_one(method, problem, data, seed, args):
    spec = PROBLEMS[problem]
    points = checkpoints(args.budget)
    if method == "NumPyro AutoNormal":
        out = _peers.run_numpyro(args.numpyro_python, spec["arch"], data, seed, args.budget,
                                 points, args.num_samples, BATCH_SIZE, threads=args.threads,
                                 init=args.numpyro_init, warm=not args.numpyro_cold)
        return out["curve"], {k: v for k, v in out.items() if k != "curve"}
    x_test, y_test = data[2], data[3]

    def evaluate(runner):
        logits = runner.logits(x_test, args.num_samples)
        return {"mnll": mnll(y_test, logits=logits).item(),
                "error": error_rate(y_test, logits=logits).item()}

    pyro.set_rng_seed(seed)
    with pyro.validation_enabled(args.validation):
        curve, steps = race(make_runner(method, spec, data, args), evaluate, points)
    return curve, {"steps": steps}


def summarize(runs, targets):
    """Per method: each seed's times to the targets and best figures, and their
    medians; then ours ÷ the best peer per target."""
    out = {}
    for method, seeds in runs.items():
        row = {"time_to": {}, "best": {}}
        for metric, pair in targets.items():
            for target in pair:
                times = [time_to(run["curve"], metric, target) for run in seeds]
                row["time_to"][f"{metric} <= {target}"] = {"seeds": times, "median": median(times)}
        for metric in ("mnll", "error"):
            bests = [min(p[metric] for p in run["curve"]) for run in seeds]
            row["best"][metric] = {"seeds": bests, "median": statistics.median(bests)}
        out[method] = row
    return out


def ratios(summary, ours, peers=PEERS):
    """``ours``'s median time to each target ÷ the best of ``peers``' (``met``:
    ≤ 0.5), and its median best MNLL against the best peer's (``met``: ≤)."""
    peers = [m for m in summary if m in peers]
    if ours not in summary or not peers:
        return {}
    rows = {}
    for key, mine in summary[ours]["time_to"].items():
        theirs = [(summary[m]["time_to"][key]["median"], m) for m in peers]
        reached = [t for t in theirs if t[0] is not None]
        best = min(reached) if reached else (None, None)
        if mine["median"] is None or best[0] is None:
            # met when ours gets there and no peer does within the budget
            ratio, met = None, mine["median"] is not None
        else:
            ratio = mine["median"] / best[0]
            met = ratio <= 0.5
        rows[key] = {"ours": mine["median"], "best_peer": best[1], "best_peer_seconds": best[0],
                     "ratio": ratio, "target": 0.5, "met": met}
    mine = summary[ours]["best"]["mnll"]["median"]
    best_peer = min(peers, key=lambda m: summary[m]["best"]["mnll"]["median"])
    theirs = summary[best_peer]["best"]["mnll"]["median"]
    rows["best mnll"] = {"ours": mine, "best_peer": best_peer, "best_peer_value": theirs,
                         "met": mine <= theirs}
    return rows


def _s(value, digits=2):
    return "—" if value is None else f"{value:.{digits}f}"


def markdown_table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def rst_table(header, rows):
    lines = [".. list-table::", "   :header-rows: 1", ""]
    for row in [header] + rows:
        lines += [f"   * - {row[0]}"] + [f"     - {c}" for c in row[1:]]
    return "\n".join(lines)


def table_rows(res):
    """The header and one row per method of a problem's table."""
    keys = [f"{m} <= {t}" for m, pair in res["targets"].items() for t in pair]
    header = (["method"] + [f"s to {k.replace('<=', '≤')}" for k in keys]
              + ["best MNLL", "best error"])
    rows = [[method] + [_s(row["time_to"][k]["median"]) for k in keys]
            + [_s(row["best"]["mnll"]["median"], 3), _s(row["best"]["error"]["median"], 3)]
            for method, row in res["summary"].items()]
    return header, rows


def rst_report(results):
    """The tables of docs/benchmarks.rst's race section, one per problem."""
    parts = []
    for problem, res in results["problems"].items():
        parts += [f"{problem}:", "", rst_table(*table_rows(res)), ""]
    return "\n".join(parts)


def report(results):
    lines = []
    for problem, res in results["problems"].items():
        keys = [f"{m} <= {t}" for m, pair in res["targets"].items() for t in pair]
        lines += [f"## {problem}: training seconds to each target, best within "
                  f"{results['config']['budget']:g} s (medians of "
                  f"{len(results['config']['seeds'])} seed(s); — never)", ""]
        lines.append(markdown_table(*table_rows(res)))
        for name, r in res["ratios"].items():
            if not r:
                continue
            cells = []
            for k in keys:
                v = r[k]
                if v["ratio"] is not None:
                    text = f"{v['ratio']:.2f}× {v['best_peer']}"
                else:
                    text = ("ours never" if v["ours"] is None else "ours only") + (
                        "" if v["best_peer"] is None else f", {v['best_peer']} does")
                cells.append(f"{k.replace('<=', '≤')}: {text} ({'met' if v['met'] else 'not met'})")
            b = r["best mnll"]
            cells.append(f"best MNLL {b['ours']:.3f} vs {b['best_peer']} "
                         f"{b['best_peer_value']:.3f} ({'met' if b['met'] else 'not met'})")
            lines += ["", f"{name} (target ≤ 0.5×; best MNLL ≤): " + "; ".join(cells)]
        for method, note in res["skipped"].items():
            lines += ["", f"{method}: {note}"]
        lines.append("")
    h = results["host"]
    lines.append(f"Batch {BATCH_SIZE}, {results['config']['num_samples']} posterior draws per "
                 f"evaluation, {results['config']['threads']} thread(s); torch {h['torch']}, Pyro "
                 f"{h['pyro']}, bayesian-torch {_peers.BAYESIAN_TORCH or 'not installed'}, "
                 f"ivon-opt {_peers.IVON or 'not installed'}; ours through "
                 f"{'pyro_vinit.fit' if results['config']['use_fit'] else 'the README loop'}"
                 f"{_overrides_text(results['config'])}; "
                 f"load average at the start {h['load_average']}, at the end "
                 f"{results['load_average_end']}, on {h['cpu_count']} cores.")
    return "\n".join(lines)


def _overrides_text(config):
    given = [f"{k} {config[k]}" for k in ("lr", "kl_weight") if config.get(k) is not None]
    return f" with {', '.join(given)}" if given else ""


def plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    problems = list(results["problems"])
    fig, axes = plt.subplots(2, len(problems), figsize=(5 * len(problems), 7), squeeze=False)
    colors = dict(zip(METHODS, plt.get_cmap("tab10").colors))
    for j, problem in enumerate(problems):
        res = results["problems"][problem]
        for i, metric in enumerate(("mnll", "error")):
            ax = axes[i][j]
            for method, seeds in res["runs"].items():
                for k, run in enumerate(seeds):
                    ax.plot([p["seconds"] for p in run["curve"]], [p[metric] for p in run["curve"]],
                            color=colors[method], lw=1.2, alpha=0.8,
                            label=method if k == 0 else None)
            for target in res["targets"][metric]:
                ax.axhline(target, color="grey", ls=":", lw=0.8)
            ax.set_xscale("log")
            ax.set_yscale("log")
            # from 0.1 s to the budget; MNLL up to chance's (ln 10) and a little above
            ax.set_xlim(0.1, results["config"]["budget"])
            ax.set_ylim(top=3.0 if metric == "mnll" else 1.0)
            ax.set_xlabel("training seconds (one thread)")
            ax.set_ylabel(f"test {'MNLL' if metric == 'mnll' else 'error'}")
            ax.set_title(problem)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def host_info():
    import numpy

    return {"python": platform.python_version(), "torch": torch.__version__,
            "pyro": pyro.__version__, "numpy": numpy.__version__, "cpu_count": os.cpu_count(),
            "load_average": [round(v, 2) for v in os.getloadavg()]}


def main(args):
    torch.set_num_threads(args.threads)
    if args.use_fit is None:
        args.use_fit = hasattr(pyro_vinit, "fit")
    host = host_info()
    results = {"config": dict(vars(args)), "host": host, "problems": {}}
    for problem in args.problems:
        spec = PROBLEMS[problem]
        try:
            data = spec["data"]()
        except ImportError as e:
            print(f"{problem}: skipped ({e})", flush=True)
            continue
        skipped = {m: why for m in args.methods if (why := missing(m, args))}
        runs = {}
        for seed in args.seeds:
            for method in args.methods:
                if method in skipped:
                    continue
                curve, extra = run_one(method, problem, data, seed, args)
                runs.setdefault(method, []).append({"seed": seed, "curve": curve, **extra})
                print(f"  {problem}, seed {seed}, {method}: best MNLL "
                      f"{min(p['mnll'] for p in curve):.3f} at {curve[-1]['seconds']:.1f} s",
                      flush=True)
        results["problems"][problem] = {"targets": spec["targets"], "runs": runs,
                                        "skipped": skipped}
    results["load_average_end"] = [round(v, 2) for v in os.getloadavg()]
    results["versions"] = {"bayesian-torch": _peers.BAYESIAN_TORCH, "ivon-opt": _peers.IVON}
    write(results, args)
    return results


def analyze(results):
    """Adds each problem's summary and ratios (from its runs) to ``results``."""
    for res in results["problems"].values():
        summary = res["summary"] = summarize(res["runs"], res["targets"])
        res["ratios"] = {}
        if OURS in summary:
            res["ratios"][f"{OURS} ÷ best peer"] = ratios(summary, OURS)
        if OURS_TRAINED in summary:
            res["ratios"][f"{OURS_TRAINED} ÷ best peer"] = ratios(summary, OURS_TRAINED)
            # issue 22, item 7: the trained-network starts, pre-training counted for both
            res["ratios"][f"{OURS_TRAINED} ÷ MOPED"] = ratios(summary, OURS_TRAINED,
                                                             ["bayesian-torch MOPED"])
    return results


def write(results, args):
    analyze(results)
    text = report(results)
    print(text)
    os.makedirs(args.out, exist_ok=True)
    stem = harness.result_stem(args, "bench_time_to_quality")
    suffix = stem[len(os.path.join(args.out, "bench_time_to_quality")):]  # "_<tag>" or ""
    with open(stem + ".json", "w") as f:
        json.dump(results, f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(text + "\n")
    with open(stem + ".rst", "w") as f:
        f.write(rst_report(results))
    try:
        plot(results, os.path.join(args.figures, f"race{suffix}.png"))
    except ImportError:
        print("matplotlib is not installed: no figure")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 1 seed, a 0.5 s budget, 4 draws, files under /tmp")
    parser.add_argument("--problems", nargs="+", choices=list(PROBLEMS), default=list(PROBLEMS))
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=METHODS)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--budget", type=float, default=25.0, help="training seconds per run")
    parser.add_argument("--num-samples", type=int, default=32,
                        help="posterior draws per evaluation")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--lr", type=float, default=None,
                        help="ours: fit_config's learning rate instead of its default")
    parser.add_argument("--kl-weight", type=float, default=None,
                        help="ours: fit_config's KL weight instead of its default")
    parser.add_argument("--average", type=float, default=None,
                        help="ours: fit_config's decay of the parameters' moving average "
                             "(0: none)")
    parser.add_argument("--iblm-kl-weight", type=float, default=None,
                        help="ours (I-BLM): init_guide_iblm's kl_weight, e.g. 0.01 for the "
                             "output layer at the tempered objective")
    parser.add_argument("--iblm-options", default=None, metavar="JSON",
                        help="ours (I-BLM): further init_guide_iblm options over fit's, e.g. "
                             "'{\"standardize_hidden\": false}'")
    parser.add_argument("--validation", action="store_true", help="Pyro's validation on")
    parser.add_argument("--use-fit", dest="use_fit", action="store_true", default=None,
                        help="ours through pyro_vinit.fit (the default when the package has it)")
    parser.add_argument("--no-fit", dest="use_fit", action="store_false",
                        help="ours through the README loop")
    parser.add_argument("--numpyro-python", default=os.environ.get(
        "NUMPYRO_PYTHON", os.path.join(ROOT, ".venv-numpyro", "bin", "python")),
        help="the Python of an environment with jax and NumPyro")
    parser.add_argument("--numpyro-init", choices=["uniform", "median"], default="uniform",
                        help="NumPyro AutoNormal's init: its default (init_to_uniform) or "
                             "init_to_median")
    parser.add_argument("--numpyro-cold", action="store_true",
                        help="NumPyro's jit compilation on the clock (by default it is done "
                             "first, off the clock, and reported apart)")
    parser.add_argument("--from-json", metavar="PATH",
                        help="no race: the tables, ratios and figure again from a results JSON")
    parser.add_argument("--tag", default="", help="suffix of the result files")
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    parser.add_argument("--figures", default=os.path.join(ROOT, "docs", "_static", "race"))
    args = parser.parse_args(argv)
    if args.quick:
        args.seeds, args.budget, args.num_samples = args.seeds[:1], 0.5, 4
        quick_dir = os.path.join(tempfile.gettempdir(), "bench_time_to_quality_quick")
        if args.out == parser.get_default("out"):
            args.out = quick_dir
        if args.figures == parser.get_default("figures"):
            args.figures = quick_dir
    os.makedirs(args.figures, exist_ok=True)
    return args


if __name__ == "__main__":
    arguments = parse_args()
    if arguments.from_json:
        with open(arguments.from_json) as f:
            write(json.load(f), arguments)
    else:
        main(arguments)
