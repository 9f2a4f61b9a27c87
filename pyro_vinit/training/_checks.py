"""
The checks of :func:`~pyro_vinit.training.fit` that run the model (and a
hand-written guide) on the first batch without changing anything: the
likelihood's scaling, targets and shapes, the guide's set-up, the
weight-noise handler, and whether the model learns its noise scale.
"""

import contextlib
import warnings
from typing import Any, Callable, ContextManager, Dict, Iterator, List, Optional, Tuple, cast

import pyro
import pyro.distributions as dist
import pyro.poutine as poutine
import torch
from pyro.infer.autoguide import AutoGuide
from pyro.nn import PyroModule
from torch import nn

from pyro_vinit._pyro_compat import (
    conditioned_sites,
    is_deterministic_site,
    unwrap_init_messenger,
)
from pyro_vinit.initialization._observed import (
    check_latent_shapes,
    check_log_density_shape,
    check_targets,
    error_text,
    per_example_sites,
    warn_unscaled_targets,
)
from pyro_vinit.initialization._rollback import GuideRollback, rng_state, set_rng_state
from pyro_vinit.poutine.layer_call_messenger import base_distribution
from pyro_vinit.training._support import (
    Batch,
    _likelihoods,
    describe_batch,
)

__all__: List[str] = []


@contextlib.contextmanager
def _sandbox(model: Callable[..., Any]) -> Iterator[None]:
    """Runs the block with the param store, the model's buffers and the RNG restored
    afterwards (the model inside a guide's wrapper too)."""
    model = unwrap_init_messenger(model)
    store = pyro.get_param_store()
    names = set(store.keys())
    buffers = ({k: b.clone() for k, b in model.named_buffers()}
               if isinstance(model, nn.Module) else {})
    rng = rng_state()
    # what BayesianClassifier / BayesianRegressor note of the batch sizes they see
    notes = {k: v for k, v in vars(model).items() if k in ("_observed_rows", "_warned_num_data")}
    try:
        with torch.no_grad():
            yield
    finally:
        vars(model).update(notes)
        for name in set(store.keys()) - names:
            del store[name]
        if isinstance(model, nn.Module):
            for k, b in model.named_buffers():
                if k in buffers:
                    b.copy_(buffers[k])
        set_rng_state(rng)


def _trial_trace(model: Callable[..., Any], x: torch.Tensor, y: torch.Tensor,
                 what: str, role: str = "model") -> Any:
    """The trace of ``model(x, y)`` (the user's ``role``: model or guide) run in
    :func:`_sandbox`; any error of it is raised again, saying that it failed on
    ``what``."""
    with _sandbox(model):
        try:
            return poutine.trace(model).get_trace(x, y)
        except Exception as e:  # the user's code: any error, said with context
            raise ValueError(
                f"fit: the {role} fails on {what} ({describe_batch((x, y))}): "
                f"{error_text(e)}"
            ) from e


def _check_weight_noise(model: Callable[..., Any], guide: Callable[..., Any], batch: Batch,
                        handler: Optional[Callable[[], ContextManager[Any]]]) -> None:
    """Runs ``guide`` and ``model`` (replayed on the guide's draws, as fit's ELBO
    runs them) on the first batch under a fresh ``handler()``, fit's weight-noise
    handler, in :func:`_sandbox`, the guide left as it was (not set up, if it was
    not): a handler that cannot be entered (another layer-call handler around fit)
    or that refuses the model or the guide's distributions (a shared weight given
    per-example noise; ``strict=True`` against a guide that is not a factorized
    Normal) is refused before anything changes."""
    if handler is None:
        return
    x, y = batch
    with _sandbox(model), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # its fall-backs: the first step warns of them
        name = getattr(handler, "__name__", None) or getattr(
            getattr(handler, "func", None), "__name__", type(handler).__name__)
        made = handler()
        if not (hasattr(made, "__enter__") and hasattr(made, "__exit__")):
            raise TypeError(f"fit: weight_noise ({name}) returned a {type(made).__name__}, "
                            "not a handler (a context manager)")
        rollback = GuideRollback(guide) if isinstance(guide, nn.Module) else None
        if rollback is not None:
            rollback.__enter__()
        try:
            guide(x, y)  # set up (an autoguide), as fit does, outside the handler
            with made:
                drawn = poutine.trace(guide).get_trace(x, y)
                poutine.trace(poutine.replay(model, trace=drawn)).get_trace(x, y)
        except Exception as e:  # the model ran without it (_check_model): the handler's
            raise ValueError(
                f"fit: under its weight-noise handler ({name}) the model and guide fail on "
                "the first batch; choose fit's handler with fit(..., weight_noise=...): a "
                "callable that returns a fresh one (e.g. lambda: weight_noise(config=...)), "
                "or contextlib.nullcontext for none (a handler around fit then applies). "
                f"{type(e).__name__}: {e}") from e
        finally:
            if rollback is not None:
                rollback.restore()


def _check_param_sites(trace: poutine.Trace, role: str) -> None:
    """Every param site of ``trace`` (of the user's ``role``: model or guide) has
    the unconstrained tensor on which Pyro's SVI steps, which the param store's
    have: under ``module_local_params=True`` a plain ``nn.Parameter`` of a
    ``PyroModule`` (e.g. BatchNorm's weight) has none, nor a value that
    ``poutine.substitute`` gives a param."""
    plain = sorted(name for name, site in trace.nodes.items()
                   if site["type"] == "param" and not hasattr(site["value"], "unconstrained"))
    if plain:
        raise ValueError(
            f"fit: the {role}'s parameters {plain[:5]} are not the param store's, and Pyro's "
            "SVI (fit's step) trains only those (it steps on each param's .unconstrained()): "
            "under pyro.settings.set(module_local_params=True) they are plain nn.Parameters "
            "of a PyroModule (train with module_local_params=False, or in a PyTorch-native "
            "loop: pyro_vinit.poutine.HandledELBO and a torch optimizer, the Scaling-out "
            "page); a value that poutine.substitute gives a param: make it a constant of "
            "the model"
        )


def _check_guide(guide: Callable[..., Any], batch: Batch, likelihoods: List[str]) -> None:
    """An autoguide set up already does not draw a likelihood site of the model's
    (``likelihoods``: set up without ``y``). A hand-written guide (a function, not an
    autoguide or a ``PyroModule``) runs on the first batch and draws every latent site
    reparameterized, as fit's ELBO needs: checked in :func:`_sandbox`, before set-up
    writes the param store. Under ``module_local_params=True`` a hand-written
    ``PyroModule`` runs too, for :func:`_check_param_sites`."""
    prototype = getattr(guide, "prototype_trace", None)
    if isinstance(guide, AutoGuide) and prototype is not None:
        drawn_here = [name for name in likelihoods if name in prototype.nodes
                      and not prototype.nodes[name]["is_observed"]]
        if drawn_here:
            raise ValueError(
                f"fit: the {type(guide).__name__} was set up without y: its prototype trace "
                f"drew the model's likelihood sites {drawn_here} as latent. Make a fresh guide "
                "(after pyro.clear_param_store()) and let fit set it up, or set it up with "
                "guide(x, y)")
    if isinstance(guide, AutoGuide) or (isinstance(guide, PyroModule) and not pyro.settings.get(
            "module_local_params")):
        return  # (an autoguide refuses what it cannot draw at its own set-up)
    trace = _trial_trace(guide, *batch, "the first batch", role="guide")
    _check_param_sites(trace, "guide")
    if isinstance(guide, PyroModule):
        return
    drawn = {name: type(base_distribution(site["fn"])).__name__
             for name, site in trace.nodes.items()
             if site["type"] == "sample" and not site["is_observed"]
             and not getattr(site["fn"], "has_rsample", False)}
    if drawn:
        raise ValueError(
            f"fit: the guide draws the sites {sorted(drawn)} "
            f"({', '.join(sorted(set(drawn.values())))}) without reparameterization, and "
            "fit's ELBO (TraceMeanField_ELBO) needs every guide draw reparameterized: "
            "marginalize discrete latents in the model (config_enumerate and TraceEnum_ELBO "
            "in your own SVI loop), or train with SVI(model, guide, optim, Trace_ELBO())"
        )


def _check_guide_model(model: Callable[..., Any], guide: Callable[..., Any],
                       batch: Batch) -> None:
    """An autoguide built on another model than fit's (e.g. another instance of
    other widths, its notebook cell not re-run) is refused where a latent site
    of its model has another shape than the model's, before I-BLM writes it
    (SVI would refuse it only at the first step)."""
    if not isinstance(guide, AutoGuide) or guide.model is model:
        return
    kind = type(guide).__name__
    theirs = guide.prototype_trace
    if theirs is None:
        try:
            theirs = _trial_trace(guide.model, *batch, "the first batch", role="guide's model")
        except ValueError as e:  # (fit's model ran on it: the guide's is another)
            raise ValueError(
                f"fit: the {kind} was built on another model than the one passed to fit "
                f"(build the guide on this model, e.g. {kind}(model), after "
                f"pyro.clear_param_store()): {str(e).removeprefix('fit: ')}") from e
    ours = _trial_trace(model, *batch, "the first batch")
    for name, site in theirs.nodes.items():
        mine = ours.nodes.get(name)
        if (site["type"] != "sample" or site["is_observed"] or mine is None
                or mine["type"] != "sample" or mine["is_observed"]
                or any(f.size != f.full_size for f in site["cond_indep_stack"])):
            continue  # (a subsampled plate's latents take the batch's size)
        if mine["value"].shape != site["value"].shape:
            raise ValueError(
                f"fit: the {kind} was built on another model than the one passed to fit: "
                f"the latent site {name!r} has shape {tuple(site['value'].shape)} in the "
                f"guide's model and {tuple(mine['value'].shape)} in fit's. Build the guide "
                f"on this model, e.g. {kind}(model), after pyro.clear_param_store()")


def _check_one_row_batches(model: Callable[..., Any], one_row: Optional[int]) -> None:
    """Refuses a batch of one row (its index ``one_row``) for a model with a
    BatchNorm layer in train mode, which cannot train on one row."""
    if one_row is None or not isinstance(model, nn.Module):
        return
    norms = [name for name, m in model.named_modules()
             if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training]
    if norms:
        raise ValueError(
            f"fit: batch {one_row} of data has a single row, on which the model's BatchNorm "
            f"({norms[0]!r}) cannot train (in train mode it needs more than one value per "
            "channel); leave such a batch out (DataLoader(..., drop_last=True)) or choose a "
            "batch size that leaves none")


def _check_validation(model: Callable[..., Any], batch: Batch, chunk: int) -> None:
    """The model runs on the validation data and gives one log-density a row."""
    x, y = batch[0][:chunk], batch[1][:chunk]
    trace = _trial_trace(model, x, y, "the validation data")
    with torch.no_grad():
        for site in _likelihoods(trace, model):
            check_targets(site, y, prefix="fit: ", what_y="the validation y")
            check_log_density_shape(site, "the validation y", prefix="fit: ")
            fn: Any = site["fn"]
            log_prob = cast(torch.Tensor, fn.log_prob(site["value"]))
            if x.shape[0] > 1 and not (log_prob.dim() and log_prob.shape[0] == x.shape[0]):
                raise ValueError(
                    f"fit: validation needs one log-density per row, but the likelihood "
                    f"{site['name']!r} gives {tuple(log_prob.shape)} for {x.shape[0]} rows "
                    "(its rows are an event dimension, e.g. .to_event(1) over the data): put "
                    "the rows in a pyro.plate('data', len(x)), or train without validation"
                )


def _check_batch_norm_particles(model: Callable[..., Any]) -> None:
    """Refuses vectorized particles for a model with a BatchNorm after a Bayesian layer
    (in the modules' order) that normalizes with its batch's statistics in training,
    which the particles would share (the handler refuses those it meets anyway)."""
    norms, bayesian = [], False
    for name, m in (model.named_modules() if isinstance(model, nn.Module) else ()):
        bayesian = bayesian or bool(getattr(m, "_pyro_samples", None))
        if bayesian and isinstance(m, nn.modules.batchnorm._BatchNorm) and (
                m.training or m.running_mean is None):
            norms.append(name)
    if norms:
        raise ValueError(
            f"fit: num_particles > 1 runs the particles vectorized, and the BatchNorm "
            f"{norms[0]!r} normalizes with the statistics of its batch, which they would "
            "share: train with num_particles=1 (fit's default)")


def _check_model(model: Callable[..., Any], batch: Batch, num_data: int,
                 all_y: Optional[torch.Tensor] = None,
                 dataset_rows: Optional[int] = None) -> Tuple[bool, List[str]]:
    """Checks the model on the first batch (and class labels on ``all_y``, the data's
    targets where given; its num_data against the data's rows, or against
    ``dataset_rows``, those of a loader's data set that drops its last batch);
    returns whether it learns its likelihood's noise scale (:func:`_learns_noise`),
    and the names of its likelihood sites."""
    x, y = batch
    declared = getattr(model, "num_data", None)
    if isinstance(declared, int) and declared not in (num_data, dataset_rows):
        data_set = (f" (of a data set of {dataset_rows} rows, whose last partial batch the "
                    f"loader drops)" if dataset_rows is not None else "")
        raise ValueError(
            f"fit: the model was built with num_data={declared} but the data has {num_data} "
            f"rows{data_set}; build it with num_data="
            f"{num_data if dataset_rows is None else dataset_rows}"
        )
    trace = _trial_trace(model, x, y, "the first batch")
    _check_param_sites(trace, "model")
    check_latent_shapes(trace, prefix="fit: ")
    observed = _likelihoods(trace, model)
    if not observed:
        raise ValueError(
            "fit: the model has no observed sample site when called as model(x, y); it must "
            "condition on y, e.g. pyro.sample('obs', dist.Categorical(logits=...), obs=y)"
        )
    fixed = sorted(site["name"] for site in observed if site["name"] in conditioned_sites(model))
    if fixed:
        raise ValueError(
            f"fit: the likelihood {fixed[0]!r} is set by pyro.condition(model, data="
            f"{{{fixed[0]!r}: ...}}), and fit draws minibatches of the rows of x and y (in a "
            "new order each epoch), which a conditioned value does not follow: x would be "
            "paired with other rows' targets. Train the unconditioned model, "
            "fit(model, guide, (x, y)); the guide then serves the conditioned model too"
        )
    rows = x.shape[0]
    if rows < num_data:
        _check_no_batch_latents(trace, rows, model, x, y)

    def rerun(values: Dict[str, torch.Tensor]) -> poutine.Trace:
        with _sandbox(model):
            return poutine.trace(poutine.condition(model, data=values)).get_trace(x, y)

    for site in observed:
        check_targets(site, y, all_y, prefix="fit: ")
        check_log_density_shape(site, prefix="fit: ")
        warn_unscaled_targets(trace, site, rerun)
        scale = float(site["scale"]) if not isinstance(site["scale"], torch.Tensor) else float(
            site["scale"].max())
        if rows < num_data and abs(scale - 1.0) < 1e-6:
            raise ValueError(
                f"fit: the likelihood {site['name']!r} is not scaled to the data set: on a "
                f"batch of {rows} of {num_data} rows its scale is 1, so the KL term would "
                f"weigh {num_data / rows:.3g} times too much. Build the model with "
                f"num_data={num_data} (BayesianClassifier / BayesianRegressor), or use "
                f"pyro.plate('data', {num_data}, subsample=...) in your model"
            )
        _check_batch_plate(site, rows, num_data)
    return _learns_noise(model, x, y, trace, observed), [site["name"] for site in observed]


def _check_batch_plate(site: Any, rows: int, num_data: int) -> None:
    """Refuses a likelihood under a plate over the batch's ``rows`` that subsamples
    them (``pyro.plate('data', len(x), subsample_size=B)``, the model indexing its
    own data): its scale ``rows / B`` scales the likelihood to the batch, not to the
    ``num_data`` rows of the data set."""
    if rows >= num_data:
        return
    for frame in site["cond_indep_stack"]:
        if frame.full_size == rows and frame.size != rows:
            raise ValueError(
                f"fit: the likelihood {site['name']!r} is in pyro.plate({frame.name!r}, "
                f"{rows}, subsample_size={frame.size}), a plate over the batch's {rows} rows, "
                f"not the data set's {num_data}: its scale scales the likelihood to the "
                f"batch, so the KL term would weigh {num_data / rows:.3g} times too much. "
                f"fit draws the minibatches itself: use pyro.plate({frame.name!r}, "
                f"{num_data}, subsample_size=len(x)) on the batch as it comes"
            )


def _learns_noise(model: Callable[..., Any], x: torch.Tensor, y: torch.Tensor,
                  trace: poutine.Trace, observed: List[Any]) -> bool:
    """Whether a likelihood of continuous support has a parameter other than its
    location that depends on a param or a latent site: the model run again with its
    latent values as tensors that require gradients. ``observed``: the likelihoods
    of ``trace``."""
    if all(base_distribution(site["fn"]).support.is_discrete for site in observed):
        return False  # a classifier: no second run
    with torch.enable_grad():
        # not leaves: a model may change its sample in place (w.clamp_), as it may the
        # guide's in training, where no leaf may be
        values = {name: cast(torch.Tensor, site["value"]).detach().requires_grad_().clone()
                  for name, site in trace.nodes.items()
                  if site["type"] == "sample" and not site["is_observed"]
                  and not is_deterministic_site(site)
                  and cast(torch.Tensor, site["value"]).is_floating_point()}
    with _sandbox(model), torch.enable_grad():
        again = poutine.trace(poutine.condition(model, data=values)).get_trace(x, y)
    # (the conditioned latent sites are observed in this run: a prior is no likelihood)
    for site in _likelihoods(again, model):
        if site["name"] in values:
            continue
        fn = base_distribution(site["fn"])
        if fn.support.is_discrete:
            continue
        while isinstance(fn, dist.TransformedDistribution) and not fn.arg_constraints:
            fn = base_distribution(fn.base_dist)  # e.g. a Normal under an affine transform
        for name in fn.arg_constraints:
            value = getattr(fn, name, None) if name != "loc" else None
            if isinstance(value, torch.Tensor) and value.requires_grad:
                return True
    return False


def _check_no_batch_latents(trace: poutine.Trace, rows: int, model: Callable[..., Any],
                            x: torch.Tensor, y: torch.Tensor) -> None:
    """No latent site lies in a plate over the batch's own rows (a per-example
    latent: its guide would take the shape of one batch and fail on the next): a
    plate of the likelihood's, not one over as many weights."""
    def fewer() -> poutine.Trace:
        return cast(poutine.Trace, _trial_trace(model, x[: rows - 1], y[: rows - 1],
                                                "the first batch"))

    for name, plate in per_example_sites(trace, rows, model, fewer if rows > 1 else None)[:1]:
        raise ValueError(
            f"fit: the latent sample site {name!r} lies in plate {plate!r} over the batch's "
            f"{rows} rows: a per-example latent, whose guide would take the shape of one "
            "minibatch. Observe it (fit calls model(x, y): pass every target through y), "
            "move it out of the plate, or declare the plate with the data set's size and a "
            "subsample (pyro.plate(name, num_data, subsample=...))"
        )
