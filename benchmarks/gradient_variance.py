"""
The gradient-variance measurement of Kingma et al. [1] (Table 1): the
variance, over minibatches and weight noise, of the gradient of an ELBO with
respect to chosen parameters, for each estimator of the weight noise. Shared
by ``benchmarks/bench_gradient_variance.py`` and ``benchmarks/reproduce/lrt.py``
(``examples/gradient_variance.py`` writes the same measurement out).

Usage::

    loss = lambda x, y: TraceMeanField_ELBO().differentiable_loss(model, guide, x, y)
    params = {"w": next(p for p in guide.parameters() if p.dim() == 2)}
    variances = gradient_variance(loss, params, x_train, y_train, batch=32, draws=4)
    variances["LRT"]["w"]  # the variance over draws, averaged over w's elements

[1] Kingma, Salimans, Welling (2015) "Variational Dropout and the Local
Reparameterization Trick"
"""

import time
from contextlib import ExitStack
from typing import (
    TYPE_CHECKING,
    Any,
    Callable,
    ContextManager,
    Dict,
    List,
    Mapping,
    Optional,
    Sequence,
    Type,
)

import torch
from pyro.infer import SVI, TraceMeanField_ELBO
from pyro.optim import Adam  # type: ignore[attr-defined]  # wrapped from torch at import
from pyro.poutine.messenger import Messenger
from pyro.poutine.util import site_is_subsample

from pyro_vinit.guides import AutoMeanFieldNormal
from pyro_vinit.nn import BayesianClassifier, bayesianize, mlp
from pyro_vinit.poutine import FlipoutMessenger, KLAnnealingMessenger, LocalReparamMessenger

if TYPE_CHECKING:
    from pyro.poutine.runtime import Message

__all__ = ["ESTIMATORS", "PosteriorMeanMessenger", "gradient_variance", "train_and_measure"]


class PosteriorMeanMessenger(Messenger):
    """
    Sets every latent site the guide samples to the mean of its distribution;
    the model then replays those values. The gradient keeps the closed-form KL
    and loses all weight noise: what varies is the minibatch only (the
    noise-free reference of [1]'s Table 1).
    """

    def _pyro_sample(self, msg: "Message[..., Any]") -> None:
        # ``done``: a value is already set (e.g. the ELBO replaying the guide into
        # the model); a plate's subsample site has no mean
        if msg["is_observed"] or msg["done"] or site_is_subsample(msg):
            return
        msg["value"] = msg["fn"].mean  # type: ignore[attr-defined]  # a sample site's fn is a distribution
        msg["done"] = True


#: The estimators of the weight noise, by name (None: one weight sample per
#: minibatch, Pyro's ordinary sampling), and the noise-free floor.
ESTIMATORS: Dict[str, Optional[Type[Messenger]]] = {
    "ordinary": None,
    "LRT": LocalReparamMessenger,
    "Flipout": FlipoutMessenger,
    "no weight noise": PosteriorMeanMessenger,
}


def gradient_variance(
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    params: Mapping[str, torch.Tensor],
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    batch: int,
    draws: int,
    estimators: Optional[Mapping[str, Optional[Type[Messenger]]]] = None,
    context: Optional[Callable[[], ContextManager[object]]] = None,
) -> Dict[str, Dict[str, float]]:
    """
    Draws ``draws`` gradients of ``loss_fn(x[idx], y[idx])`` with respect to
    each of ``params``, each with a new minibatch of ``batch`` rows (without
    replacement) and new weight noise, under each estimator's handler.

    :param callable loss_fn: The differentiable loss of a minibatch.
    :param dict params: The tensors to differentiate, by name.
    :param int batch: Rows of each minibatch.
    :param int draws: Gradients per estimator.
    :param dict estimators: Handler classes by name (None: no handler);
        default :data:`ESTIMATORS`.
    :param callable context: Makes a context entered around each loss (e.g.
        a :class:`~pyro_vinit.poutine.KLAnnealingMessenger`), or None.
    :return: ``{estimator: {name: variance, ..., "ms_per_draw": ms}}``: the
        variance over draws averaged over each tensor's elements, and the
        mean wall time of one draw.
    """
    out: Dict[str, Dict[str, float]] = {}
    names = list(params)
    for estimator, handler_cls in (ESTIMATORS if estimators is None else estimators).items():
        grads: Dict[str, List[torch.Tensor]] = {name: [] for name in names}
        start = time.perf_counter()
        for _ in range(draws):
            idx = torch.randperm(len(x))[:batch]
            with ExitStack() as stack:
                if context is not None:
                    stack.enter_context(context())
                if handler_cls is not None:
                    stack.enter_context(handler_cls())
                loss = loss_fn(x[idx], y[idx])
            for name, g in zip(names, torch.autograd.grad(loss, [params[n] for n in names])):
                grads[name].append(g)
        row = {name: torch.stack(g).var(0).mean().item() for name, g in grads.items()}
        row["ms_per_draw"] = (time.perf_counter() - start) / draws * 1e3
        out[estimator] = row
    return out


def train_and_measure(
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    sizes: Sequence[int],
    epochs: Sequence[int] = (10, 100),
    batch_sizes: Sequence[int] = (128, 1000),
    draws: int = 100,
    train_batch_size: int = 128,
    lr: float = 1e-3,
    prior_scale: Optional[float] = None,
    kl_weight: float = 1.0,
    guide_kwargs: Optional[Dict[str, Any]] = None,
    estimators: Optional[Mapping[str, Optional[Type[Messenger]]]] = None,
    evaluate: Optional[Callable[[Any, Any], Dict[str, float]]] = None,
    log: Optional[Callable[[str], None]] = None,
) -> List[Dict[str, Any]]:
    """
    [1]'s protocol: fits an :class:`~pyro_vinit.AutoMeanFieldNormal` guide of
    the Bayesian classifier ``mlp(sizes)`` (``bayesianize``'s N(0, 1/D_in)
    priors, or N(0, ``prior_scale``²)) with LRT, SVI and Adam on minibatches
    of ``train_batch_size``; at each checkpoint in ``epochs`` (cumulative)
    measures :func:`gradient_variance` of the TraceMeanField_ELBO loss with
    respect to the means of the bottom and the top weight matrix, for every
    batch size in ``batch_sizes``, at the fixed parameters.

    :param float kl_weight: A factor on the KL term, in training and in the
        gradient draws (:class:`~pyro_vinit.poutine.KLAnnealingMessenger`).
    :param dict guide_kwargs: Keyword arguments of the guide (e.g.
        ``init_loc_fn``, ``init_scale``).
    :param callable evaluate: Optional ``evaluate(model, guide) -> dict``,
        called at each checkpoint; its result is stored as ``"metrics"``.
    :param callable log: Progress messages, or None.
    :return: Rows ``{"epochs", "batch", ["metrics",] <estimator>: {"bottom",
        "top", "ms_per_draw"}}``.
    """
    model = BayesianClassifier(bayesianize(mlp(tuple(sizes)), prior_scale=prior_scale),
                               num_data=len(x))
    guide = AutoMeanFieldNormal(model, **(guide_kwargs or {}))
    svi = SVI(model, guide, Adam({"lr": lr}), TraceMeanField_ELBO())
    svi.step(x[:train_batch_size], y[:train_batch_size])
    params = dict(guide.named_parameters())
    bottom = params["locs.net.0.weight_unconstrained"]
    top = params[f"locs.net.{2 * (len(sizes) - 2)}.weight_unconstrained"]
    elbo = TraceMeanField_ELBO()
    kl = KLAnnealingMessenger(kl_weight)
    step = kl(LocalReparamMessenger()(svi.step))
    steps_per_epoch = max(1, len(x) // train_batch_size)
    rows: List[Dict[str, Any]] = []
    done = 0
    for epoch in epochs:
        for _ in range((epoch - done) * steps_per_epoch):
            idx = torch.randint(0, len(x), (train_batch_size,))
            step(x[idx], y[idx])
        done = epoch
        metrics = None if evaluate is None else evaluate(model, guide)
        for batch in batch_sizes:
            row: Dict[str, Any] = {"epochs": epoch, "batch": batch}
            if metrics is not None:
                row["metrics"] = metrics
            row.update(gradient_variance(
                lambda xb, yb: elbo.differentiable_loss(model, guide, xb, yb),
                {"bottom": bottom, "top": top}, x, y, batch=batch, draws=draws,
                estimators=estimators, context=lambda: kl))
            rows.append(row)
            if log is not None:
                log(f"{epoch} epochs, batch {batch} done")
    return rows
