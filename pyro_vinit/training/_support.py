"""
The parts of :func:`~pyro_vinit.training.fit`'s loop: minibatches, the checks
that run the model without changing anything, validation metrics and
checkpoints.
"""

import contextlib
import math
import os
import warnings
from typing import (
    Any,
    Callable,
    ContextManager,
    Dict,
    Iterable,
    Iterator,
    List,
    Optional,
    Tuple,
    Union,
    cast,
)

import pyro
import pyro.distributions as dist
import pyro.poutine as poutine
import torch
from pyro.infer.autoguide import AutoGuide
from pyro.nn import PyroModule
from pyro.optim import PyroOptim
from pyro.poutine.util import site_is_subsample
from torch import nn

from pyro_vinit._pyro_compat import is_deterministic_site, likelihood_sites
from pyro_vinit.initialization._data import all_finite
from pyro_vinit.training.averaging import ParamAverage
from pyro_vinit.training.config import FitHistory

__all__: List[str] = []

Batch = Tuple[torch.Tensor, torch.Tensor]
Data = Union[Batch, Iterable[Batch]]

_CHECKPOINT_FORMAT = "pyro_vinit.fit/1"


# ---- the data -------------------------------------------------------------------------


def _is_pair(data: Any) -> bool:
    return (isinstance(data, (tuple, list)) and len(data) == 2
            and all(isinstance(t, torch.Tensor) for t in data))


def _check_batch(batch: Any, what: str) -> Batch:
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2
            and all(isinstance(t, torch.Tensor) for t in batch)):
        raise TypeError(
            f"fit: {what} must be a pair (x, y) of tensors, got "
            f"{type(batch).__name__}" + (f" of length {len(batch)}"
                                         if isinstance(batch, (tuple, list)) else "")
        )
    x, y = batch
    if x.dim() == 0 or y.dim() == 0 or x.shape[0] != y.shape[0]:
        raise ValueError(
            f"fit: x and y of {what} must have the same number of rows, got shapes "
            f"{tuple(x.shape)} and {tuple(y.shape)}"
        )
    if x.shape[0] == 0:
        raise ValueError(f"fit: {what} has no rows")
    for name, t in (("x", x), ("y", y)):
        # (a meta tensor has no values to check: refused later, for its device)
        if t.is_floating_point() and t.device.type != "meta" and not all_finite(t):
            row = int(torch.nonzero(~torch.isfinite(t.reshape(len(t), -1)).all(-1))[0])
            raise ValueError(
                f"fit: {name} of {what} contains NaN or inf (row {row} first); clean or "
                "impute the data before training"
            )
    return x, y


class _Batches:
    """An endless stream of minibatches: shuffled epochs of an (x, y) pair, or the
    batches of a re-iterable loader, pass after pass."""

    def __init__(self, data: Data, batch_size: int) -> None:
        self.pair: Optional[Batch] = None
        self.loader: Optional[Iterable[Batch]] = None
        self.batch_size = batch_size
        if _is_pair(data):
            self.pair = _check_batch(data, "data")
            self.num_data = self.pair[0].shape[0]
            self.first = (self.pair[0][:batch_size], self.pair[1][:batch_size])
            self.batches_per_epoch = math.ceil(self.num_data / batch_size)
            #: An epoch's batches of the first batch's shapes (the others, an epoch's
            #: partial last batch, take fit's eager step).
            self.full_batches = max(1, self.num_data // batch_size)
        else:
            if isinstance(data, torch.Tensor) or not isinstance(data, Iterable):
                raise TypeError(
                    "fit: data must be an (x, y) pair of tensors or an iterable of (x, y) "
                    f"batches (e.g. a DataLoader), got {type(data).__name__}"
                )
            if iter(data) is data:
                raise TypeError(
                    "fit: data is an iterator, which can be read only once; pass a "
                    "re-iterable such as a DataLoader or a list of batches"
                )
            self.loader = cast(Iterable[Batch], data)
            count, first, batches, same = 0, None, 0, 0
            for i, batch in enumerate(self.loader):
                xb, yb = _check_batch(batch, f"batch {i} of data")
                first = (xb, yb) if first is None else first
                same += (xb.shape, yb.shape) == (first[0].shape, first[1].shape)
                count += xb.shape[0]
                batches += 1
            if first is None:
                raise ValueError("fit: data (the loader) yields no batches")
            self.first, self.num_data, self.batches_per_epoch = first, count, batches
            self.full_batches = same
        self.generator = torch.Generator(device="cpu")
        self.order: Optional[torch.Tensor] = None
        self.position = 0
        self._iter: Optional[Iterator[Batch]] = None

    def start(self) -> None:
        """Seeds the shuffling from the global RNG (after every check has passed)."""
        self.generator.manual_seed(int(torch.randint(2**62, ()).item()))

    def __next__(self) -> Batch:
        if self.pair is not None:
            x, y = self.pair
            if self.order is None or self.position >= self.num_data:
                self.order = torch.randperm(self.num_data, generator=self.generator)
                self.position = 0
            idx = self.order[self.position:self.position + self.batch_size].to(x.device)
            self.position += self.batch_size
            return x[idx], y[idx]
        assert self.loader is not None
        for _ in range(2):
            if self._iter is None:
                self._iter = iter(self.loader)
            try:
                return cast(Batch, tuple(next(self._iter)))
            except StopIteration:
                self._iter = None
        raise ValueError("fit: data (the loader) yields no batches on a second pass")

    def state(self) -> Dict[str, Any]:
        return {"generator": self.generator.get_state(), "order": self.order,
                "position": self.position}

    def set_state(self, state: Dict[str, Any]) -> None:
        self.generator.set_state(state["generator"])
        self.order, self.position = state["order"], state["position"]


# ---- checks that run the model without changing anything -------------------------------


def _base(fn: Any) -> Any:
    while isinstance(fn, (dist.Independent, dist.MaskedDistribution)):
        fn = fn.base_dist
    return fn


def _rng_state() -> Dict[str, Any]:
    """The CPU generator's state, and every CUDA device's where CUDA is in use."""
    state: Dict[str, Any] = {"cpu": torch.get_rng_state()}
    # (is_initialized: not annotated in torch)
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: Any) -> None:
    if isinstance(state, torch.Tensor):  # a checkpoint of the CPU generator alone
        torch.set_rng_state(state)
        return
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


@contextlib.contextmanager
def _sandbox(model: Callable[..., Any]) -> Iterator[None]:
    """Runs the block with the param store, the model's buffers and the RNG restored
    afterwards."""
    store = pyro.get_param_store()
    names = set(store.keys())
    buffers = ({k: b.clone() for k, b in model.named_buffers()}
               if isinstance(model, nn.Module) else {})
    rng = _rng_state()
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
        _set_rng_state(rng)


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
                f"fit: the {role} fails on {what} (x {tuple(x.shape)} {x.dtype}, "
                f"y {tuple(y.shape)} {y.dtype}): {type(e).__name__}: {e}"
            ) from e


def _check_weight_noise(model: Callable[..., Any], batch: Batch,
                        handler: Optional[Callable[[], ContextManager[Any]]]) -> None:
    """Runs ``model`` on the first batch under a fresh ``handler()``, fit's weight-noise
    handler, in :func:`_sandbox`: a handler that cannot be entered (another layer-call
    handler around fit) or that refuses the model (a shared weight given per-example
    noise) is refused before anything changes. The guide does not run: a refusal that
    depends on its distributions (``strict=True`` against a guide that is not a
    factorized Normal) comes at the first step."""
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
        try:
            with made:
                poutine.trace(model).get_trace(x, y)
        except Exception as e:  # the model ran without it (_check_model): the handler's
            raise ValueError(
                f"fit: under its weight-noise handler ({name}) the model fails on the first "
                f"batch: {type(e).__name__}: {str(e).rstrip('.')}. Choose fit's handler with "
                "fit(..., weight_noise=...): a callable that returns a fresh one (e.g. "
                "lambda: weight_noise(config=...)), or contextlib.nullcontext for none (a "
                "handler around fit then applies)") from e


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
    drawn = {name: type(_base(site["fn"])).__name__ for name, site in trace.nodes.items()
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


def _check_targets(site: Any, y: torch.Tensor) -> None:
    """The targets' dtype fits the likelihood of the observed ``site``."""
    fn = _base(site["fn"])
    if isinstance(fn, dist.Categorical) and (y.is_floating_point() or y.dtype == torch.bool):
        raise TypeError(
            f"fit: the likelihood {site['name']!r} is Categorical, so y must hold integer "
            f"class labels (y.long()), got {y.dtype}"
        )
    if not fn.support.is_discrete and not y.is_floating_point():
        raise TypeError(
            f"fit: the likelihood {site['name']!r} is {type(fn).__name__}, continuous, "
            f"so y must be floating point (y.float()), got {y.dtype}"
        )


def _check_log_density_shape(site: Any) -> None:
    """The distribution of the observed ``site`` does not broadcast its value: it may be
    broadcast up to the value (replicates along a dim it leaves free), but a value
    broadcast up by it (a column of labels against a batch of logits) would score each
    row against every row's prediction."""
    fn: Any = site["fn"]
    value = tuple(site["value"].shape)
    full = tuple(fn.batch_shape) + tuple(fn.event_shape)
    try:
        broadcast: Any = tuple(torch.broadcast_shapes(value, full))  # type: ignore[no-untyped-call]
    except RuntimeError:
        broadcast = None
    if broadcast != value:
        what = (f"broadcasts y to {broadcast}" if broadcast is not None
                else "does not broadcast with y")
        raise ValueError(
            f"fit: y of shape {value} does not fit the likelihood {site['name']!r}: its "
            f"distribution, of batch shape {tuple(fn.batch_shape)} and event shape "
            f"{tuple(fn.event_shape)}, {what}, which would score each row against other "
            "rows' predictions; give y the batch shape followed by the event shape"
            + (" (y.squeeze(-1) for a column)" if value[-1:] == (1,) else ""))


def _likelihoods(trace: poutine.Trace, model: Callable[..., Any]) -> List[Any]:
    """The observed sample sites of a trace of ``model``, less ``pyro.deterministic``'s
    records (observed ``Delta`` sites) and, where the model observes sites of its own
    (``obs=``), the sites ``pyro.condition`` fixes (a hyperparameter held at a value)."""
    return likelihood_sites([site for site in trace.nodes.values() if site["type"] == "sample"
                             and site["is_observed"] and not is_deterministic_site(site)],
                            model)


def _check_validation(model: Callable[..., Any], batch: Batch, chunk: int) -> None:
    """The model runs on the validation data and gives one log-density a row."""
    x, y = batch[0][:chunk], batch[1][:chunk]
    trace = _trial_trace(model, x, y, "the validation data")
    with torch.no_grad():
        for site in _likelihoods(trace, model):
            _check_targets(site, y)
            fn: Any = site["fn"]
            log_prob = cast(torch.Tensor, fn.log_prob(site["value"]))
            if x.shape[0] > 1 and not (log_prob.dim() and log_prob.shape[0] == x.shape[0]):
                raise ValueError(
                    f"fit: validation needs one log-density per row, but the likelihood "
                    f"{site['name']!r} gives {tuple(log_prob.shape)} for {x.shape[0]} rows "
                    "(its rows are an event dimension, e.g. .to_event(1) over the data): put "
                    "the rows in a pyro.plate('data', len(x)), or train without validation"
                )


def _check_model(model: Callable[..., Any], batch: Batch,
                 num_data: int) -> Tuple[bool, List[str]]:
    """Checks the model on the first batch; returns whether it learns its
    likelihood's noise scale (:func:`_learns_noise`), and the names of its
    likelihood sites."""
    x, y = batch
    declared = getattr(model, "num_data", None)
    if isinstance(declared, int) and declared != num_data:
        raise ValueError(
            f"fit: the model was built with num_data={declared} but the data has {num_data} "
            f"rows; build it with num_data={num_data}"
        )
    trace = _trial_trace(model, x, y, "the first batch")
    _check_param_sites(trace, "model")
    observed = _likelihoods(trace, model)
    if not observed:
        raise ValueError(
            "fit: the model has no observed sample site when called as model(x, y); it must "
            "condition on y, e.g. pyro.sample('obs', dist.Categorical(logits=...), obs=y)"
        )
    rows = x.shape[0]
    if rows < num_data:
        _check_no_batch_latents(trace, rows, observed)
    for site in observed:
        _check_targets(site, y)
        _check_log_density_shape(site)
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
    if all(_base(site["fn"]).support.is_discrete for site in observed):
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
        fn = _base(site["fn"])
        if fn.support.is_discrete:
            continue
        while isinstance(fn, dist.TransformedDistribution) and not fn.arg_constraints:
            fn = _base(fn.base_dist)  # e.g. a Normal under an affine transform
        for name in fn.arg_constraints:
            value = getattr(fn, name, None) if name != "loc" else None
            if isinstance(value, torch.Tensor) and value.requires_grad:
                return True
    return False


def _check_no_batch_latents(trace: poutine.Trace, rows: int,
                            observed: List[Any]) -> None:
    """No latent site lies in a plate over the batch's own rows (a per-example
    latent: its guide would take the shape of one batch and fail on the next): a
    plate of the likelihood's, not one over as many weights."""
    data_plates = {frame.name for site in observed for frame in site["cond_indep_stack"]}
    for site in trace.nodes.values():
        if (site["type"] != "sample" or site["is_observed"] or is_deterministic_site(site)
                or site_is_subsample(site)):
            continue
        for frame in site["cond_indep_stack"]:
            if (frame.vectorized and frame.size == rows and frame.full_size in (None, rows)
                    and frame.name in data_plates):
                raise ValueError(
                    f"fit: the latent sample site {site['name']!r} lies in plate "
                    f"{frame.name!r} over the batch's {rows} rows: a per-example latent, "
                    "whose guide would take the shape of one minibatch. Observe it (fit "
                    "calls model(x, y): pass every target through y), move it out of the "
                    "plate, or declare the plate with the data set's size and a subsample "
                    "(pyro.plate(name, num_data, subsample=...))"
                )


def _set_up(guide: Callable[..., Any], batch: Batch) -> None:
    """Sets an autoguide up (its parameters take the param store's values where it
    has them), leaving the RNG as it was."""
    if isinstance(guide, AutoGuide) and guide.prototype_trace is None:
        rng = _rng_state()
        with torch.no_grad():
            poutine.block(guide)(*batch)
        _set_rng_state(rng)


# ---- evaluation ----------------------------------------------------------------------


@torch.no_grad()
def _evaluate(model: Callable[..., Any], guide: Callable[..., Any], x: torch.Tensor,
              y: torch.Tensor, num_samples: int, chunk: int) -> Dict[str, float]:
    """Monte Carlo predictive MNLL (and error rate or RMSE) of ``num_samples`` guide
    draws, the model in eval mode, on chunks of at most ``chunk`` rows (a model built
    with ``num_data`` takes no larger batch)."""
    modules = [m for m in (model, guide) if isinstance(m, nn.Module)]
    modes = [m.training for m in modules]
    for m in modules:
        m.eval()
    try:
        log_probs, means, kind = [], [], ""
        for _ in range(num_samples):
            guide_trace = poutine.trace(guide).get_trace(x[:chunk], y[:chunk])
            sample_lp, sample_means = [], []
            for start in range(0, x.shape[0], chunk):
                xc, yc = x[start:start + chunk], y[start:start + chunk]
                trace = poutine.trace(poutine.replay(model, trace=guide_trace)).get_trace(xc, yc)
                lp = xc.new_zeros(xc.shape[0])
                observed = _likelihoods(trace, model)
                for site in observed:
                    fn: Any = site["fn"]
                    site_lp = cast(torch.Tensor, fn.log_prob(site["value"]))
                    site_lp = site_lp.reshape(site_lp.shape[:1] + (-1,)).sum(-1) if (
                        site_lp.dim() and site_lp.shape[0] == xc.shape[0]) else site_lp.sum()
                    lp = lp + site_lp
                sample_lp.append(lp)
                if len(observed) == 1:
                    base = _base(observed[0]["fn"])
                    if isinstance(base, dist.Categorical):
                        kind = "error_rate"
                        sample_means.append(base.probs)
                    elif isinstance(base, dist.Bernoulli):
                        kind = "bernoulli"
                        value = cast(torch.Tensor, observed[0]["value"])
                        sample_means.append(base.probs.expand(value.shape))
                    elif isinstance(base, (dist.Normal, dist.StudentT)):
                        kind = "rmse"
                        value = cast(torch.Tensor, observed[0]["value"])
                        sample_means.append(base.loc.expand(value.shape))
            log_probs.append(torch.cat(sample_lp))
            if sample_means:
                means.append(torch.cat(sample_means))
        stacked = torch.stack(log_probs)
        result = {"mnll": float(-(stacked.logsumexp(0) - math.log(num_samples)).mean())}
        if kind == "error_rate":
            pred = torch.stack(means).mean(0).argmax(-1)
            result[kind] = float((pred != y).float().mean())
        elif kind == "bernoulli":  # a label wrong where its probability is across 0.5
            wrong = (torch.stack(means).mean(0) > 0.5) != (y.reshape(means[0].shape) > 0.5)
            result["error_rate"] = float(wrong.float().mean())
        elif kind == "rmse":
            mean = torch.stack(means).mean(0)
            result[kind] = float((mean - y.reshape(mean.shape)).pow(2).mean().sqrt())
        return result
    finally:
        for m, mode in zip(modules, modes):
            m.train(mode)


# ---- checkpoints ---------------------------------------------------------------------


def _save(path: str, step: int, optim: PyroOptim, model: Callable[..., Any],
          batches: _Batches, history: FitHistory, averager: ParamAverage) -> None:
    state = {
        "format": _CHECKPOINT_FORMAT,
        "step": step,
        "param_store": pyro.get_param_store().get_state(),
        "optim": optim.get_state(),
        "average": averager.get_state(),
        "model": model.state_dict() if isinstance(model, nn.Module) else None,
        "rng": _rng_state(),
        "batches": batches.state(),
        "loss": list(history.loss),
        "validation": list(history.validation),
    }
    tmp = f"{path}.tmp"
    torch.save(state, tmp)
    os.replace(tmp, path)


def _check_checkpoint(path: Optional[str], resumed: Dict[str, Any],
                      model: Callable[..., Any]) -> None:
    """The checkpoint's parameters (and model state) have the names and shapes of
    the set-up guide's (and the model's)."""
    current = {name: tuple(p.shape) for name, p in pyro.get_param_store().named_parameters()}
    saved = {name: tuple(v.shape) for name, v in resumed["param_store"]["params"].items()}
    wrong = sorted(n for n, shape in saved.items() if current.get(n, shape) != shape)
    missing = sorted(set(saved) - set(current))
    if isinstance(model, nn.Module) and resumed.get("model") is not None:
        state = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        wrong += sorted(f"model {k}" for k, v in resumed["model"].items()
                        if k not in state or state[k] != tuple(v.shape))
    if wrong or missing:
        raise ValueError(
            f"fit: the checkpoint {path!r} does not fit this model and guide (shapes differ: "
            f"{wrong[:5]}; not in the guide: {missing[:5]}); pass another checkpoint path to "
            "start afresh"
        )


def _load(path: str) -> Dict[str, Any]:
    # our own file, with the param store's constraints pickled: not weights only
    state = torch.load(path, map_location="cpu", weights_only=False)
    if not isinstance(state, dict) or state.get("format") != _CHECKPOINT_FORMAT:
        raise ValueError(f"fit: {path!r} is not a checkpoint written by pyro_vinit.fit")
    return cast(Dict[str, Any], state)
