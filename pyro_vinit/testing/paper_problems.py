"""
The problems and the protocol of the I-BLM paper's initializer comparison
(Rossi et al. [1], Figures 7 and 8), shared by
``examples/initializer_comparison.py`` and ``benchmarks/bench_iblm_svi.py``:
a model per problem, SVI after each initialization, and the test metrics of
the Monte Carlo predictive along the way.

Problems (:data:`PROBLEMS`):

* ``digits_mlp``: scikit-learn digits, ReLU MLP 64-100×5-10;
* ``digits_cnn``: digits as 8×8 images, conv(8, 3×3) → ReLU → conv(16, 3×3,
  stride 2) → ReLU → linear(10);
* ``toy``: the 1-d regression of [1], tanh MLP 1-500×3-1, likelihood noise
  e⁻¹;
* ``diabetes``: scikit-learn diabetes (standardized), ReLU MLP 10-100×5-1,
  likelihood noise 0.7.

Every model has N(0, 1/D_in) priors and an AutoNormal guide; SVI is the
paper's: Adam at learning rate 1e-3, minibatches of 64, Trace_ELBO with one
sample.

Usage::

    data = PROBLEMS["digits_mlp"]["data"]()
    curves, seconds = compare("digits_mlp", data, methods=["iblm", "xavier"], repeats=1,
                              steps=10, eval_every=5, num_samples=2)

[1] Rossi, Michiardi, Filippone (2019) "Good Initializations of Variational
Bayes for Deep Models"
"""

import math
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import pyro
import pyro.poutine as poutine
import torch
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoNormal
from torch import nn

from pyro_vinit.data import load_diabetes, load_digits, toy_regression
from pyro_vinit.initialization.baselines import init_guide
from pyro_vinit.metrics import classification_metrics, regression_metrics
from pyro_vinit.nn import BayesianClassifier, BayesianRegressor, bayesianize, mlp
from pyro_vinit.poutine import KLAnnealingMessenger
from pyro_vinit.schedules import LinearWarmup

__all__ = [
    "INITIALIZERS",
    "PROBLEMS",
    "compare",
    "evaluate",
    "iblm_batch_size",
    "make",
    "mean_curves",
    "plot_curves",
    "run_svi",
]

#: The initializations compared, I-BLM first (MAP's budget is I-BLM's time).
INITIALIZERS = ["iblm", "uninformative", "heuristic", "xavier", "orthogonal", "lsuv", "map"]

Curve = Dict[str, List[float]]
Data = Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def _cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(),
        nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.ReLU(),
        nn.Flatten(), nn.Linear(16 * 4 * 4, 10),
    )


# ``batch`` is I-BLM's (and LSUV's) batch size: each unit's regression needs
# well more rows than the layer has inputs, and the CNN's last layer has 257.
PROBLEMS: Dict[str, Dict[str, Any]] = {
    "digits_mlp": dict(task="classification", data=lambda: load_digits(),
                       net=lambda: mlp((64,) + (100,) * 5 + (10,)), steps=400),
    "digits_cnn": dict(task="classification", data=lambda: load_digits(image=True),
                       net=_cnn, steps=400, batch=512),
    "toy": dict(task="regression", data=lambda: toy_regression(), noise=math.exp(-1),
                net=lambda: mlp((1, 500, 500, 500, 1), nn.Tanh), steps=300),
    "diabetes": dict(task="regression", data=lambda: load_diabetes(), noise=0.7,
                     net=lambda: mlp((10,) + (100,) * 5 + (1,)), steps=400),
}


def iblm_batch_size(problem: str) -> int:
    """I-BLM's rows per unit for ``problem``."""
    return int(PROBLEMS[problem].get("batch", 128))


def make(problem: str, data: Data, seed: int) -> Tuple[nn.Module, AutoNormal]:
    """
    A fresh model and AutoNormal guide for ``problem``, with the RNG seeded
    and the param store cleared.

    :param str problem: A key of :data:`PROBLEMS`.
    :param tuple data: ``(x_train, y_train, x_test, y_test)``.
    :param int seed: The seed.
    """
    pyro.set_rng_seed(seed)
    pyro.clear_param_store()
    spec = PROBLEMS[problem]
    net = bayesianize(spec["net"]())
    n = len(data[0])
    model: nn.Module
    if spec["task"] == "classification":
        model = BayesianClassifier(net, num_data=n)
    else:
        model = BayesianRegressor(net, noise_scale=spec["noise"], num_data=n)
    return model, AutoNormal(model)


@torch.no_grad()
def evaluate(
    problem: str, model: nn.Module, guide: AutoNormal, x: torch.Tensor, y: torch.Tensor,
    num_samples: int,
) -> Dict[str, float]:
    """Test ``error`` (error rate or RMSE) and ``mnll`` of the Monte Carlo predictive
    from ``num_samples`` guide draws."""
    outs = []
    for _ in range(num_samples):
        trace = poutine.trace(guide).get_trace(x)
        outs.append(poutine.replay(model, trace=trace)(x))
    stacked = torch.stack(outs)
    if PROBLEMS[problem]["task"] == "classification":
        m = classification_metrics(y, logits=stacked)
        return {"error": float(m["error_rate"]), "mnll": float(m["mnll"])}
    r = regression_metrics(y, loc=stacked, scale=PROBLEMS[problem]["noise"])
    return {"error": float(r["rmse"]), "mnll": float(r["mnll"])}


def run_svi(
    problem: str, method: str, data: Data, seed: int, *, steps: int, eval_every: int,
    num_samples: int, batch_size: int = 64, lr: float = 1e-3, kl_warmup: int = 0,
    kl_weight: float = 1.0, map_seconds: Optional[float] = None,
    iblm_options: Optional[Dict[str, Any]] = None,
) -> Tuple[Curve, float]:
    """
    Initializes a fresh guide with ``method`` and runs SVI on it.

    :param int kl_warmup: If positive, the KL weight grows linearly from 0 to
        ``kl_weight`` over this many steps.
    :param float kl_weight: The KL weight λ (after any warm-up); 1 is the ELBO.
    :param float map_seconds: Wall-clock budget of ``method="map"``.
    :param dict iblm_options: Extra options of ``method="iblm"`` (e.g.
        ``max_scale_ratio``).
    :return: The learning curve ``{"step", "error", "mnll"}`` and the seconds
        the initialization took.
    """
    x, y, x_test, y_test = data
    model, guide = make(problem, data, seed)
    options = dict(iblm_options or {}) if method == "iblm" else {}
    start = time.perf_counter()
    # map_steps is unbounded so that map_seconds alone limits MAP
    init_guide(guide, (x, y), method=method, batch_size=iblm_batch_size(problem),
               map_steps=10**6, map_seconds=map_seconds, **options)
    init_seconds = time.perf_counter() - start
    # pyro.optim wraps torch's optimizers at import time, which mypy cannot see
    optim = pyro.optim.Adam({"lr": lr})  # type: ignore[attr-defined]
    svi = SVI(model, guide, optim, Trace_ELBO())
    schedule = LinearWarmup(kl_warmup, end=kl_weight) if kl_warmup else None
    annealing = KLAnnealingMessenger(schedule or kl_weight)
    g = torch.Generator().manual_seed(seed)
    curve: Curve = {"step": [], "error": [], "mnll": []}
    for step in range(steps + 1):
        if step % eval_every == 0 or step == steps:
            m = evaluate(problem, model, guide, x_test, y_test, num_samples)
            curve["step"].append(step)
            curve["error"].append(m["error"])
            curve["mnll"].append(m["mnll"])
        if step < steps:
            idx = torch.randint(0, len(x), (batch_size,), generator=g)
            with annealing:
                svi.step(x[idx], y[idx])
            annealing.step()
    return curve, init_seconds


def mean_curves(runs: Sequence[Curve]) -> Curve:
    """The pointwise mean of learning curves with the same steps."""
    out: Curve = {"step": runs[0]["step"]}
    for k in ("error", "mnll"):
        out[k] = [sum(r[k][i] for r in runs) / len(runs) for i in range(len(out["step"]))]
    return out


def _warm_up(problem: str, data: Data) -> None:
    """Pays one-time costs (imports, first solves) outside the timed initializations."""
    _, guide = make(problem, data, 0)
    init_guide(guide, data[:2], method="iblm", batch_size=iblm_batch_size(problem))
    init_guide(guide, data[:2], method="map", map_steps=2)


def compare(
    problem: str, data: Data, *, methods: Sequence[str] = INITIALIZERS, repeats: int, steps: int,
    eval_every: int, num_samples: int, batch_size: int = 64, kl_warmup: int = 0,
    kl_weight: float = 1.0, iblm_options: Optional[Dict[str, Any]] = None,
    progress: Optional[Any] = None,
) -> Tuple[Dict[str, Curve], Dict[str, float]]:
    """
    SVI after each initialization in ``methods``, ``repeats`` seeds each; MAP
    gets the wall-clock time I-BLM took on the same seed (if I-BLM is among
    ``methods``), so the two data-driven starts cost the same.

    :param progress: A ``tqdm`` bar to advance once per run, or None.
    :return: The mean learning curve and the mean initialization time of
        each method, as two dicts keyed by method.
    """
    _warm_up(problem, data)
    curves: Dict[str, Curve] = {}
    init_seconds: Dict[str, float] = {}
    iblm_seconds: Dict[int, float] = {}
    for method in sorted(methods, key=lambda m: m != "iblm"):
        runs, secs = [], []
        for seed in range(repeats):
            budget = iblm_seconds.get(seed) if method == "map" else None
            curve, s = run_svi(problem, method, data, seed, steps=steps, eval_every=eval_every,
                               num_samples=num_samples, batch_size=batch_size,
                               kl_warmup=kl_warmup, kl_weight=kl_weight, map_seconds=budget,
                               iblm_options=iblm_options)
            if method == "iblm":
                iblm_seconds[seed] = s
            runs.append(curve)
            secs.append(s)
            if progress is not None:
                progress.update()
        curves[method] = mean_curves(runs)
        init_seconds[method] = sum(secs) / len(secs)
    return curves, init_seconds


def plot_curves(
    curves_by_problem: Dict[str, Dict[str, Curve]], path: str, title: Optional[str] = None,
    styles: Optional[Dict[str, Dict[str, Any]]] = None,
) -> str:
    """
    Test error (top) and test MNLL (bottom) versus SVI step, one column per
    problem; ``curves_by_problem`` maps a problem to ``{method: curve}``.
    I-BLM is the thick black line; ``styles`` gives matplotlib styles of
    other entries (e.g. an I-BLM variant). Needs matplotlib.

    :return: ``path``, where the PNG was written.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    problems = list(curves_by_problem)
    # tab10 is a ListedColormap, whose colors the Colormap base type does not declare
    colors = dict(zip(INITIALIZERS[1:], plt.get_cmap("tab10").colors))  # type: ignore[attr-defined]
    fig, axes = plt.subplots(2, len(problems), figsize=(4.6 * len(problems), 6.8), squeeze=False)
    extra: Dict[str, Dict[str, Any]] = styles or {}
    for j, problem in enumerate(problems):
        regression = PROBLEMS[problem]["task"] == "regression"
        for method, c in curves_by_problem[problem].items():
            if method == "iblm":
                style: Dict[str, Any] = dict(lw=2.5, color="k", zorder=3)
            elif method in extra:
                style = extra[method]
            else:
                style = dict(lw=1.3, color=colors.get(method))
            axes[0, j].plot(c["step"], c["error"], label=method, **style)
            axes[1, j].plot(c["step"], c["mnll"], label=method, **style)
        axes[0, j].set_title(problem)
        axes[0, j].set_ylabel("test RMSE" if regression else "test error")
        axes[1, j].set_ylabel("test MNLL")
        axes[1, j].set_xlabel("SVI step (Adam, lr 1e-3)")
        axes[1, j].set_yscale("log")
        if regression:  # the uninformative prior's outputs are huge
            axes[0, j].set_yscale("log")
        else:
            axes[0, j].set_ylim(0, 1)
            # an uninformative start has an MNLL in the thousands: keep the
            # scale readable around chance (log 10 = 2.3) and say what is cut
            axes[1, j].set_ylim(0.05, 10)
            cut = [m for m, c in curves_by_problem[problem].items() if min(c["mnll"]) > 10]
            if cut:
                axes[1, j].text(0.98, 0.97, f"off scale (> 10): {', '.join(cut)}", fontsize=8,
                                ha="right", va="top", transform=axes[1, j].transAxes)
    axes[0, 0].legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
