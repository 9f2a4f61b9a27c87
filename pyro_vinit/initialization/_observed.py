"""The model on the data, before anything changes: it runs, it has a likelihood,
and the targets fit the likelihood (its support, dtype and shape)."""

import linecache
import math
import os
from functools import partial
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, cast

import pyro.distributions as dist
import pyro.poutine as poutine
import torch
from pyro.infer.util import is_validation_enabled
from pyro.poutine.util import site_is_subsample
from pyro.util import check_site_shape
from torch.distributions import Distribution

from pyro_vinit._pyro_compat import (
    conditioned_sites,
    guide_list_of,
    is_deterministic_site,
    likelihood_sites,
    unwrap_init_messenger,
    without_trace_shapes,
)
from pyro_vinit._warn import warn_at_caller
from pyro_vinit.distributions import factorized_normal
from pyro_vinit.initialization._data import describe
from pyro_vinit.initialization._runs import prior_median
from pyro_vinit.poutine.layer_call_messenger import base_distribution

#: the package's directory: an error whose innermost frame lies in it is the library's
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep

__all__ = [
    "check_has_likelihood",
    "check_log_density_shape",
    "check_not_conditioned",
    "check_latent_shapes",
    "check_targets",
    "per_example_sites",
    "error_text",
    "warn_unscaled_targets",
]


def check_has_likelihood(model: Callable[..., Any], args: Sequence[Any],
                         member: Optional[Any] = None) -> poutine.Trace:
    """Before the first run with the guide: refuses arguments on which the model
    fails (naming them), without the targets (a model run without them would
    make the observed site a latent one of the guide), whose likelihood
    ``pyro.condition`` sets, or whose targets do not fit the likelihood
    (:func:`check_targets`, :func:`check_log_density_shape`), and a guide
    ``member`` to set up whose ``AutoGuideList`` is not (Pyro sets members up
    through it). Returns the model's trace on ``args``."""
    holder = guide_list_of(member) if member is not None else None
    if holder is not None and holder.prototype_trace is None:
        raise ValueError(
            f"the {type(member).__name__} is a member of an AutoGuideList that is not set "
            "up, through which Pyro sets its members up: call the list once on the data "
            "first, e.g. guide(x, y)")
    model = unwrap_init_messenger(model)
    try:
        with torch.no_grad(), poutine.block():
            trace = poutine.trace(model).get_trace(*args)
    except Exception as e:  # the user's model: any error, said with the arguments
        raise ValueError(f"the model fails on the first rows of the data (arguments "
                         f"{describe(args)}): {error_text(e)}") from e
    observed = [
        site
        for site in trace.nodes.values()
        if site["type"] == "sample"
        and site["is_observed"]
        and not site_is_subsample(site)
        and not is_deterministic_site(site)
    ]
    if not observed:
        raise ValueError(
            "the model has no observed sample site on these arguments: the initializer "
            "fits the likelihood, so pass the targets too, e.g. (x, y)"
        )
    for site in likelihood_sites(observed, model):
        check_not_conditioned(model, site["name"])
        check_targets(site, site["value"])  # (I-BLM checks every row as it reads them)
        check_log_density_shape(site)
        warn_unscaled_targets(trace, site, partial(_conditioned_trace, model, args))
    check_latent_shapes(trace)
    return trace


def _conditioned_trace(model: Callable[..., Any], args: Sequence[Any],
                       values: Dict[str, torch.Tensor]) -> poutine.Trace:
    with torch.no_grad(), poutine.block():
        return poutine.trace(poutine.condition(model, data=values)).get_trace(*args)


def per_example_sites(trace: poutine.Trace, rows: int, model: Callable[..., Any],
                      fewer: Optional[Callable[[], poutine.Trace]] = None,
                      ) -> List[Tuple[str, str]]:
    """The latent sites of ``trace`` (a run of ``model`` on ``rows`` rows of the
    data) that lie in a plate of the rows (subsampled or not): per-example
    latents, whose guide takes the shape of the rows it is set up on; with their
    plates' names. A plate of the rows has the dim and size of the likelihood's;
    where ``fewer`` gives the model's trace on one row fewer, only plates whose
    size follows the rows are (not one over as many units as there are rows)."""
    observed = likelihood_sites([s for s in trace.nodes.values() if s["type"] == "sample"
                                 and s["is_observed"] and not site_is_subsample(s)
                                 and not is_deterministic_site(s)], model)
    # (the plate of the rows: at an observation's leftmost batch dim, not one over its
    # features that happens to count as many; a latent's plate of the same dim and size may
    # have another name, one over as many units as a batch has rows another size)
    row_plates = {(frame.dim, frame.full_size or frame.size) for site in observed
                  for frame in site["cond_indep_stack"]
                  if frame.vectorized and frame.dim == -len(site["fn"].batch_shape)}
    found = []
    for name, site in trace.nodes.items():
        if (site["type"] != "sample" or site["is_observed"] or is_deterministic_site(site)
                or site_is_subsample(site)):
            continue
        for frame in site["cond_indep_stack"]:
            if (frame.vectorized and (frame.full_size or frame.size) == rows
                    and (frame.dim, rows) in row_plates):
                found.append((name, frame.name))
                break
    if found and fewer is not None:
        again = fewer()
        follows = {frame.name for site in again.nodes.values() if site["type"] == "sample"
                   for frame in site["cond_indep_stack"]
                   if frame.vectorized and (frame.full_size or frame.size) == rows - 1}
        found = [(name, plate) for name, plate in found if plate in follows]
    return found


def warn_unscaled_targets(trace: poutine.Trace, site: Any,
                          rerun: Callable[[Dict[str, torch.Tensor]], poutine.Trace]) -> None:
    """Warns where the targets of a Normal, StudentT or Laplace likelihood ``site``
    lie more than ten times beyond the largest scale of the Normal priors of the
    ``trace``'s latent sites (a bayesianized network's keep its outputs near unit
    scale) and beyond the likelihood's mean with every latent site at its prior's
    median (the trace of the model conditioned on them, by ``rerun``: a model
    that adds the targets' mean reaches them), where a Bayesian fit is pulled
    toward 0."""
    fn, y = base_distribution(site["fn"]), site["value"]
    if not isinstance(fn, (dist.Normal, dist.StudentT, dist.Laplace)) or y.numel() < 2:
        return
    scales = [float(normal.scale.max()) for s in trace.nodes.values()
              if s["type"] == "sample" and not s["is_observed"]
              for normal in [factorized_normal(s["fn"])] if normal is not None]
    size = max(abs(float(y.mean())), float(y.std()))  # (of the rows at hand)
    if not scales or size <= 10 * max(scales):
        return
    medians = {name: prior_median(cast(Distribution, s["fn"]))
               for name, s in trace.nodes.items()
               if s["type"] == "sample" and not s["is_observed"] and not site_is_subsample(s)}
    try:
        again = rerun(medians)
        offset = abs(float(base_distribution(again.nodes[site["name"]]["fn"]).loc.mean()))
    except Exception:  # (a model that cannot run at its priors' medians: the scales alone)
        offset = 0.0
    if size <= 10 * max(scales + [offset]):
        return
    # (its order of magnitude only: fit's first batch and I-BLM's first rows say the same)
    warn_at_caller(
        f"the targets of the likelihood {site['name']!r} have a mean or std of the order "
        f"of {10 ** math.floor(math.log10(size)):g}, more than ten times the largest scale "
        "of the model's Normal priors, under which a network's outputs stay near that "
        "scale: its fit is pulled toward 0 and fits them poorly. Standardize them, "
        "(y - y.mean()) / y.std(), and map the predictions back (times y.std(), plus "
        "y.mean()), or give the model priors on the targets' scale", UserWarning)


def check_not_conditioned(model: Callable[..., Any], name: str) -> None:
    """Refuses a likelihood whose observations ``pyro.condition`` fixes."""
    if name in conditioned_sites(model):
        raise ValueError(
            f"the observed site {name!r} is set by pyro.condition(model, data="
            f"{{{name!r}: ...}}): I-BLM runs the model on chunks and minibatches of the "
            "data rows, which a conditioned value does not follow. Pass the observations "
            "as a model argument instead, e.g. init_guide_iblm(AutoNormal(model), (x, y)) "
            "on the unconditioned model; the guide then serves the conditioned model too "
            "(it has the same latent sites)"
        )


def error_text(error: BaseException) -> str:
    """``Type: message`` of an error of the user's model, with advice after its first
    line where it is about mixed dtypes (float64 data on a float32 network); such an
    error, and one this library raised in the model (e.g. a module's check of the
    targets), without the trace's shapes that ``poutine.trace`` appends to it."""
    original = without_trace_shapes(error)
    first = str(error).partition("\n")[0]
    dtypes = "dtype" in first or ("type (" in first and "should be the same" in first)
    if dtypes or _raised_here(original):
        error = original
    first, _, rest = str(error).partition("\n")
    if dtypes:
        first += (". Give the data the network's dtype (x.float() for a float32 network) "
                  "or the network the data's (model.double())")
    return f"{type(error).__name__}: {first}" + (f"\n{rest}" if rest else "")


def _raised_here(error: BaseException) -> bool:
    # by a raise statement of the library (not by torch, called from the library's code)
    tb = error.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is None:
        return False
    path = tb.tb_frame.f_code.co_filename
    return (os.path.abspath(path).startswith(_PACKAGE)
            and linecache.getline(path, tb.tb_lineno).lstrip().startswith("raise "))


def check_targets(site: Any, y: torch.Tensor, all_y: Optional[torch.Tensor] = None,
                  prefix: str = "", what_y: str = "y") -> None:
    """The targets' dtype fits the likelihood of the observed ``site``, and they lie in
    its support: ``y`` (the site's value), or all the targets ``all_y`` where given for
    a Categorical's or Bernoulli's support (the same for every row). ``prefix`` begins
    the messages (e.g. ``"fit: "``), which call the targets ``what_y``."""
    fn = cast(Any, base_distribution(site["fn"]))
    name = site["name"]
    try:
        support = fn.support
    except NotImplementedError:  # a distribution of the user's that declares none
        return
    if isinstance(fn, dist.Categorical) and (y.is_floating_point() or y.dtype == torch.bool):
        raise TypeError(
            f"{prefix}the likelihood {name!r} is Categorical, so {what_y} must hold integer "
            f"class labels (y.long()), got {y.dtype}"
        )
    if isinstance(fn, dist.Bernoulli) and not y.is_floating_point():
        raise TypeError(
            f"{prefix}the likelihood {name!r} is Bernoulli, whose log-density takes "
            f"floating-point 0/1 targets (y.float()), got {y.dtype}"
        )
    if not support.is_discrete and not y.is_floating_point():
        raise TypeError(
            f"{prefix}the likelihood {name!r} is {type(fn).__name__}, continuous, "
            f"so {what_y} must be floating point (y.float()), got {y.dtype}"
        )
    whole = all_y is not None and isinstance(fn, (dist.Categorical, dist.Bernoulli))
    values = cast(torch.Tensor, all_y if whole else site["value"])
    inside = support.check(values)
    if not bool(inside.all()):
        bad = values[~inside]  # (the rows, for a support over an event dim)
        hint = (f": class labels must be 0 to {fn.logits.shape[-1] - 1} (1-based labels: "
                "y - 1)" if isinstance(fn, dist.Categorical) else "")
        if isinstance(fn, dist.OneHotCategorical) and y.dim() == 1:  # labels, not rows
            hint = f": it takes one-hot rows, F.one_hot({what_y}, {fn.logits.shape[-1]}).float()"
        raise ValueError(
            f"{prefix}{what_y} holds values outside the support of the likelihood {name!r} "
            f"({type(fn).__name__}, {support}), e.g. {bad.flatten()[0].item()!r}{hint}"
        )


def check_log_density_shape(site: Any, what_y: str = "y", prefix: str = "") -> None:
    """The distribution of the observed ``site`` does not broadcast its value: it may be
    broadcast up to the value (replicates along a dim it leaves free), but a value
    broadcast up by it (a column of labels against a batch of logits) would score each
    row against every row's prediction. ``prefix`` begins the message."""
    fn: Any = site["fn"]
    value = tuple(site["value"].shape)
    full = tuple(fn.batch_shape) + tuple(fn.event_shape)
    try:
        broadcast: Any = tuple(torch.broadcast_shapes(value, full))  # type: ignore[no-untyped-call]
    except RuntimeError:
        broadcast = None
    if broadcast != value:
        what = (f"broadcasts {what_y} to {broadcast}, which would score each row against "
                "other rows' predictions" if broadcast is not None
                else f"does not broadcast with {what_y}")
        if len(full) > len(value):  # the distribution has dims that the targets lack
            fix = (f"give the distribution's parameters the shape of {what_y} (e.g. "
                   "logits.squeeze(-1) for a network of one output column)")
        else:
            fix = (f"give {what_y} the batch shape followed by the event shape"
                   + (" (y.squeeze(-1) for a column)" if value[-1:] == (1,) else ""))
        raise ValueError(
            f"{prefix}{what_y} of shape {value} does not fit the likelihood {site['name']!r}: "
            f"its distribution, of batch shape {tuple(fn.batch_shape)} and event shape "
            f"{tuple(fn.event_shape)}, {what}; {fix}")


def check_latent_shapes(trace: poutine.Trace, prefix: str = "") -> None:
    """Pyro's ELBO check of each latent site's log-density shape against its plates
    (``pyro.util.check_site_shape``, under validation), on a first trace: a prior
    with batch dims outside any plate, e.g. ``Normal(0., 1.).expand([H, D])`` without
    ``.to_event(2)``, is refused before an initializer writes the guide, not at the
    first step; each message starts with ``prefix``."""
    if not is_validation_enabled():
        return
    for name, site in trace.nodes.items():
        if (site["type"] != "sample" or site["is_observed"] or site_is_subsample(site)
                or not isinstance(site["value"], torch.Tensor)):
            continue
        fn = cast(dist.TorchDistribution, site["fn"])
        with torch.no_grad():
            log_prob = fn.log_prob(site["value"])
        try:
            # (as the ELBO's first step, which guesses max_plate_nesting, checks it: no dim
            # left of the plates ignored)
            check_site_shape({**site, "log_prob": log_prob}, cast(int, float("inf")))
        except ValueError as e:
            batch = tuple(fn.batch_shape)
            if not site["cond_indep_stack"] and batch:
                full = list(batch + tuple(fn.event_shape))
                raise ValueError(
                    f"{prefix}the latent sample site {name!r} has a distribution of batch "
                    f"shape {batch} outside any pyro.plate, which Pyro's ELBO refuses: "
                    f"make those dims the sample's event, .to_event({len(batch)}) on its "
                    f"distribution (e.g. dist.Normal(0., 1.).expand({full})"
                    f".to_event({len(full)}))"
                ) from e
            raise ValueError(f"{prefix}the latent sample site {name!r} does not fit its "
                             f"plates: {e}") from e
