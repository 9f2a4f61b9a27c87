"""
What the reproduction scripts share: options, models, guides, the training
loop, predictions and the files they write.

Parameters are module-local (``pyro.settings.set(module_local_params=True)``,
set by :func:`setup`): every guide owns its parameters as an ``nn.Module``
does, so that many guides of one class live side by side without sharing
names in Pyro's global param store, and the training loop is PyTorch's
(``TraceMeanField_ELBO()(model, guide)`` is a module whose loss is
differentiated and stepped by ``torch.optim.Adam``), which lets the scripts
read each step's gradients.
"""

import argparse
import json
import math
import os
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import pyro
import pyro.poutine as poutine
import torch
import torch.nn.functional as F
from pyro.infer import Predictive, TraceMeanField_ELBO
from pyro.infer.autoguide import init_to_sample
from torch import nn
from tqdm import tqdm

from pyro_vinit import AutoKTiedNormal, AutoMeanFieldNormal, AutoRadialNormal
from pyro_vinit.nn import BayesianClassifier, bayesianize, mlp
from pyro_vinit.poutine import KLAnnealingMessenger

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_OUT = os.path.join(ROOT, "docs", "_static", "reproduce")


# ----------------------------------------------------------------------------- options


def make_parser(doc: str, name: str, seeds: int = 2) -> argparse.ArgumentParser:
    """The options every script has: ``--quick``, ``--out-dir``, ``--seeds``,
    ``--threads``."""
    parser = argparse.ArgumentParser(description=doc.strip().split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run of a few seconds")
    parser.add_argument("--out-dir", default=os.path.join(DEFAULT_OUT, name),
                        help="where the JSON, the PNGs and the reST tables go")
    parser.add_argument("--seeds", type=int, default=seeds, help="seeds per configuration")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    return parser


def setup(args: argparse.Namespace) -> None:
    """Threads, module-local parameters, no validation (it only slows the many
    gradient evaluations down; the library's tests run with it on)."""
    if args.seeds < 1:
        raise SystemExit(f"--seeds must be at least 1, got {args.seeds}")
    torch.set_num_threads(args.threads)
    pyro.settings.set(module_local_params=True)
    pyro.enable_validation(False)
    os.makedirs(args.out_dir, exist_ok=True)


# ----------------------------------------------------------------------------- models


def make_model(sizes: Sequence[int], num_data: int, prior_scale: Optional[float] = None):
    """A Bayesian ReLU MLP classifier with ``bayesianize``'s N(0, 1/D_in) priors
    (or N(0, prior_scale²))."""
    return BayesianClassifier(bayesianize(mlp(tuple(sizes)), prior_scale=prior_scale),
                              num_data=num_data)


class MeanFieldNormal(AutoMeanFieldNormal):
    """
    The mean-field guide of the papers: :class:`~pyro_vinit.AutoMeanFieldNormal`
    (AutoNormal's family with the Normal at the site, so that the KL is in
    closed form, as for :class:`~pyro_vinit.AutoKTiedNormal` and
    :class:`~pyro_vinit.AutoRadialNormal`: the comparisons measure the families,
    not the KL estimators), with the means drawn from the prior by default.
    """

    def __init__(self, model: Callable, *, init_loc_fn: Callable = init_to_sample,
                 init_scale: float = 0.1, create_plates: Optional[Callable] = None):
        # means from a prior draw by default: AutoSiteGuide's init_to_feasible sets every
        # weight mean to 0, where the hidden units of a ReLU net are interchangeable or dead
        super().__init__(model, init_loc_fn=init_loc_fn, init_scale=init_scale,
                         create_plates=create_plates)


GUIDE_FAMILIES = ("mean-field", "k-tied k=1", "k-tied k=2", "k-tied k=3", "radial")


def make_guide(family: str, model, *, init_scale: float, init_loc_fn=init_to_sample):
    """One guide of ``family`` (see :data:`GUIDE_FAMILIES`)."""
    kwargs = dict(init_scale=init_scale, init_loc_fn=init_loc_fn)
    if family == "mean-field":
        return MeanFieldNormal(model, **kwargs)
    if family.startswith("k-tied k="):
        return AutoKTiedNormal(model, rank=int(family.rpartition("=")[2]), **kwargs)
    if family == "radial":
        return AutoRadialNormal(model, **kwargs)
    raise ValueError(f"unknown guide family {family!r}; expected one of {GUIDE_FAMILIES}")


def count_parameters(guide) -> int:
    return sum(p.numel() for p in guide.parameters())


# ----------------------------------------------------------------------------- training


def minibatches(n: int, batch_size: int, generator: Optional[torch.Generator] = None):
    """Indices of minibatches, epoch after epoch, each epoch a new permutation."""
    while True:
        perm = torch.randperm(n, generator=generator)
        for start in range(0, n - batch_size + 1, batch_size):
            yield perm[start : start + batch_size]


def fit(model, guide, x: torch.Tensor, y: torch.Tensor, *, steps: int, lr: float,
        batch_size: int, kl_scale=1.0, handler=None, on_gradients=None,
        desc: Optional[str] = None) -> Dict[str, list]:
    """
    Fits ``guide`` with TraceMeanField_ELBO and Adam on minibatches.

    :param kl_scale: The KL weight, a number or a schedule ``step -> λ``
        (:class:`~pyro_vinit.poutine.KLAnnealingMessenger`).
    :param handler: An optional effect handler (instance) around each loss
        evaluation, e.g. ``LocalReparamMessenger()``.
    :param on_gradients: Optional ``on_gradients(step)``, called after each
        backward pass and before the optimizer step (gradients in ``.grad``).
    :return: ``{"loss": [per-step loss / N]}``.
    """
    loss_fn = TraceMeanField_ELBO()(model, guide)
    with torch.no_grad():
        guide(x[:batch_size], y[:batch_size])  # set up the guide's parameters
    optim = torch.optim.Adam(loss_fn.parameters(), lr=lr)
    annealing = KLAnnealingMessenger(kl_scale)
    batches = minibatches(len(x), batch_size)
    losses = []
    for step in tqdm(range(steps), desc=desc, leave=False, disable=desc is None,
                     mininterval=2):
        idx = next(batches)
        optim.zero_grad()
        with annealing:
            if handler is None:
                loss = loss_fn(x[idx], y[idx])
            else:
                with handler:
                    loss = loss_fn(x[idx], y[idx])
        loss.backward()
        if on_gradients is not None:
            on_gradients(step)
        optim.step()
        annealing.step()
        losses.append(loss.item() / len(x))
    return {"loss": losses}


def fit_deterministic(net: nn.Module, x: torch.Tensor, y: torch.Tensor, *, steps: int, lr: float,
                      batch_size: int, weight_decay: float = 0.0,
                      desc: Optional[str] = None) -> nn.Module:
    """A point estimate: cross-entropy, Adam (with L2 ``weight_decay``)."""
    optim = torch.optim.Adam(net.parameters(), lr=lr, weight_decay=weight_decay)
    batches = minibatches(len(x), batch_size)
    for _ in tqdm(range(steps), desc=desc, leave=False, disable=desc is None, mininterval=2):
        idx = next(batches)
        optim.zero_grad()
        F.cross_entropy(net(x[idx]), y[idx]).backward()
        optim.step()
    return net


@torch.no_grad()
def predict_logits(model, guide, x: torch.Tensor, num_samples: int) -> torch.Tensor:
    """Posterior predictive logits ``(num_samples, N, C)``."""
    predictive = Predictive(model, guide=guide, num_samples=num_samples,
                            return_sites=["_RETURN"])
    return predictive(x)["_RETURN"]


@torch.no_grad()
def kl_divergence(model, guide, x: torch.Tensor) -> float:
    """KL(q ‖ p) of the guide to the prior: the negative ELBO of the model with
    its likelihood hidden (closed form for the guides of :func:`make_guide`)."""
    return TraceMeanField_ELBO().loss(poutine.block(model, hide=["obs"]), guide, x[:1])


def negative_elbo(model, guide, logits: torch.Tensor, x: torch.Tensor, y: torch.Tensor,
                  num_train: int) -> float:
    """The negative ELBO per example as a Keras BNN reports it: the expected
    negative log-likelihood per example of ``y``, ``E_q[-log p(y_n | x_n, w)]``
    averaged over the posterior predictive ``logits`` ``(S, N, C)`` of ``x``, plus the
    KL's share per training example, ``KL / num_train``."""
    nll = -torch.distributions.Categorical(logits=logits).log_prob(y).mean().item()
    return nll + kl_divergence(model, guide, x) / num_train


# ----------------------------------------------------------------------------- statistics


def mean_sd(values: Sequence[float]) -> Tuple[float, float]:
    """Mean and sample standard deviation (0 for one value)."""
    values = [float(v) for v in values]
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, 0.0
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def fmt(values: Sequence[float], digits: int = 3) -> str:
    """``mean ± sd`` over seeds (just the mean for one seed)."""
    mean, sd = mean_sd(values)
    return f"{mean:.{digits}f}" if len(values) < 2 else f"{mean:.{digits}f} ± {sd:.{digits}f}"


# ----------------------------------------------------------------------------- outputs


def rst_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A reST simple table (also readable printed)."""
    cells = [list(map(str, header))] + [list(map(str, r)) for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    rule = "  ".join("=" * w for w in widths)
    lines = [rule, "  ".join(c.ljust(w) for c, w in zip(cells[0], widths)).rstrip(), rule]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells[1:]]
    return "\n".join(lines + [rule])


class Report:
    """Collects a script's tables (printed and written as reST), its JSON and
    its figures."""

    def __init__(self, args: argparse.Namespace, name: str):
        self.args, self.name = args, name
        self.sections: List[str] = []
        self.start = time.perf_counter()

    def table(self, title: str, header, rows, note: str = "") -> str:
        text = rst_table(header, rows)
        block = f"**{title}**" + (f" {note}" if note else "") + "\n\n" + text
        self.sections.append(block)
        print("\n" + title + (f" {note}" if note else ""))
        print(text)
        return text

    def save(self, results: dict, plot: Optional[Callable[[], List[str]]] = None) -> None:
        elapsed = time.perf_counter() - self.start
        results = {"config": vars(self.args), "seconds": elapsed, **results}
        out = self.args.out_dir
        with open(os.path.join(out, f"{self.name}.json"), "w") as f:
            json.dump(results, f, indent=1)
        mode = "--quick" if self.args.quick else "full"
        with open(os.path.join(out, f"{self.name}_tables.inc"), "w") as f:
            f.write(f".. generated by python -m benchmarks.reproduce.{self.name} ({mode} run, "
                    f"{elapsed:.0f} s); do not edit\n\n")
            f.write("\n\n".join(self.sections) + "\n")
        written = []
        if plot is not None:
            try:
                import matplotlib

                matplotlib.use("Agg")
            except ImportError:
                print("matplotlib is not installed: the figures are skipped")
            else:
                written = plot()
        print(f"\n{self.name}: {elapsed:.0f} s; wrote {self.name}.json, {self.name}_tables.inc"
              + "".join(f", {os.path.basename(p)}" for p in written) + f" to {out}")


def savefig(fig, args: argparse.Namespace, filename: str) -> str:
    path = os.path.join(args.out_dir, filename)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
