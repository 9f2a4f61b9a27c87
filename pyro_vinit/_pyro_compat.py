"""
Every use of Pyro's private helpers, private attributes and undocumented
behaviour, in one place, so that a Pyro upgrade that moves or changes one
touches this file alone. ``tests/test_pyro_compat.py`` checks each against
the installed Pyro.

* :func:`deep_setattr`, :func:`helpful_support_errors`: helpers of
  ``pyro.infer.autoguide.utils``, not part of Pyro's documented API;
  :func:`discrete_site_error` reads the name of the site out of the error
  ``helpful_support_errors`` raises.
* :func:`unconstrained_param`: where :class:`~pyro.nn.PyroModule` keeps the
  parameter behind a :class:`~pyro.nn.PyroParam`.
* :func:`unwrap_init_messenger`: an autoguide's model without the
  ``InitMessenger`` Pyro wraps around it.
* :func:`setup_prototype`: runs :class:`~pyro.infer.autoguide.AutoGuide`'s
  own set-up (``AutoGuide._setup_prototype``), not a subclass's.
* :func:`share_prototype`: sets an autoguide up from another's prototype
  trace and plate frames (``AutoGuide._prototype_frames``).
* :func:`pyro_sample_priors`: the priors of a PyroModule's PyroSample
  attributes (``PyroModule._pyro_samples``).
* :func:`scale_and_mask`, :class:`ScoreParts`: the helpers
  ``pyro.poutine.Trace`` uses to store a site's log density.
* :func:`prefill_log_prob`: stores a site's log density in its message ahead
  of time; relies on ``Trace.compute_log_prob``, ``compute_score_parts`` and
  ``log_prob_sum`` leaving alone the sites that already have them.
* :func:`subsampled_plate`: the sizes of a subsampled plate, read from its
  subsample site's distribution (Pyro's private ``_Subsample``).
* :func:`is_vectorized_particles`: recognizes the plate in which an ELBO with
  ``vectorize_particles=True`` runs the model and guide (by its name).
* :func:`whole_trace_weights_elbo`: recognizes, on the call stack, the
  objectives that weigh whole-model samples against each other
  (``RenyiELBO``, ``TraceTailAdaptive_ELBO``, ``ReweightedWakeSleep``), by
  the ``self`` of the method, theirs or inherited, that runs the model.
* :func:`active_messengers`: the effect handlers active now
  (``pyro.poutine.runtime._PYRO_STACK``).
* :func:`traceable_elbos`: Pyro's ``Trace_ELBO`` and ``TraceMeanField_ELBO``
  with their scalar reads (``torch_item``, ``warn_if_nan``) kept as tensor
  ops, so that ``make_fx`` can trace them; swaps the names those modules
  imported.
"""

import re
import sys
import types
from contextlib import contextmanager
from operator import attrgetter
from typing import (
    Any,
    Callable,
    Dict,
    FrozenSet,
    Iterable,
    Iterator,
    List,
    NamedTuple,
    Optional,
    Set,
    Tuple,
    cast,
)

import torch
from pyro.distributions.score_parts import ScoreParts
from pyro.distributions.util import scale_and_mask
from pyro.infer import RenyiELBO, ReweightedWakeSleep, TraceTailAdaptive_ELBO
from pyro.infer.autoguide import AutoGuide
from pyro.infer.autoguide.utils import deep_setattr, helpful_support_errors
from pyro.poutine.indep_messenger import CondIndepStackFrame
from pyro.poutine.messenger import Messenger
from pyro.poutine.util import site_is_subsample

from pyro_vinit._typing import SampleSite

__all__ = [
    "ScoreParts",
    "SubsampledPlate",
    "active_messengers",
    "active_sample_plate",
    "conditioned_sites",
    "deep_setattr",
    "discrete_site_error",
    "guide_list_of",
    "handler_chain",
    "helpful_support_errors",
    "is_deterministic_site",
    "likelihood_sites",
    "is_predictive_samples",
    "is_sample_frame",
    "is_vectorized_particles",
    "model_swapped",
    "prefill_log_prob",
    "pyro_sample_priors",
    "replace_handler",
    "scale_and_mask",
    "setup_prototype",
    "share_prototype",
    "subsampled_plate",
    "traceable_elbos",
    "unconstrained_param",
    "unwrap_init_messenger",
    "whole_trace_weights_elbo",
    "without_trace_shapes",
    "wrap_inner",
]

# The name of the plate of pyro.infer.ELBO._vectorized_num_particles.
_PARTICLE_PLATE = "num_particles_vectorized"
# The name of the plate of pyro.infer.predictive._predictive (parallel=True).
_PREDICTIVE_PLATE = "_num_predictive_samples"


def unconstrained_param(module: torch.nn.Module, name: str) -> torch.nn.Parameter:
    """The unconstrained :class:`~torch.nn.Parameter` behind the
    :class:`~pyro.nn.PyroParam` at the dotted attribute ``name`` of a
    :class:`~pyro.nn.PyroModule` (PyroModule keeps it at ``<name>_unconstrained``)."""
    param = attrgetter(name + "_unconstrained")(module)
    if not isinstance(param, torch.nn.Parameter):
        raise RuntimeError(
            f"expected the PyroParam {name!r} to be stored as the torch Parameter "
            f"{name + '_unconstrained'!r}, found {type(param).__name__}; this Pyro version "
            "stores PyroParams differently: update pyro_vinit/_pyro_compat.py"
        )
    return param


_DISCRETE_SITE = re.compile(r"Continuous inference cannot handle discrete sample site '(.*?)'")


def discrete_site_error(error: BaseException) -> Optional[str]:
    """The name of the site if ``error`` is the ``ValueError`` that
    :func:`helpful_support_errors` raises for a discrete sample site (e.g. from
    an autoguide's ``init_to_feasible``), else None."""
    if not isinstance(error, ValueError):
        return None
    match = _DISCRETE_SITE.match(str(error))
    return match.group(1) if match else None


def without_trace_shapes(error: BaseException) -> BaseException:
    """The error a model raised, where ``poutine.trace`` raised it again with the
    trace's shapes appended (a ``ValueError`` or ``RuntimeError`` of the same
    type whose message is the model's, a newline and the shapes, raised from
    the model's); else ``error``."""
    cause = error.__cause__
    while (cause is not None and type(cause) is type(error)
           and str(error).startswith(f"{cause}\n")):
        error, cause = cause, cause.__cause__
    return error


def unwrap_init_messenger(model: Callable[..., Any]) -> Callable[..., Any]:
    """The model an autoguide was built from, without the
    :class:`~pyro.infer.autoguide.initialization.InitMessenger` the guide
    wraps around it (Pyro keeps only the wrapped callable, ``guide.model``,
    a partial of its private ``_context_wrap``)."""
    from functools import partial

    from pyro.infer.autoguide.initialization import InitMessenger
    from pyro.poutine.messenger import _context_wrap

    while True:
        fn = model
        while isinstance(fn, partial) and isinstance(fn.func, partial):
            fn = fn.func
        if not (
            isinstance(fn, partial)
            and fn.func is _context_wrap
            and len(fn.args) == 2
            and isinstance(fn.args[0], InitMessenger)
        ):
            return model
        model = fn.args[1]


def handler_chain(model: Callable[..., Any]) -> List[Tuple[Any, Callable[..., Any]]]:
    """The effect handlers wrapped around ``model`` by calling them on it
    (``poutine.block(model, ...)``, ``pyro.condition(model, ...)``, an
    autoguide's ``InitMessenger``), outermost first, each with the callable
    it wraps (Pyro keeps them in partials of its private ``_context_wrap``)."""
    from functools import partial

    from pyro.poutine.messenger import _context_wrap

    chain: List[Tuple[Any, Callable[..., Any]]] = []
    while True:
        fn = model
        while isinstance(fn, partial) and isinstance(fn.func, partial):
            fn = fn.func
        if not (isinstance(fn, partial) and fn.func is _context_wrap and len(fn.args) == 2):
            return chain
        chain.append((fn.args[0], fn.args[1]))
        model = fn.args[1]


def conditioned_sites(model: Callable[..., Any]) -> FrozenSet[str]:
    """The sites that a ``pyro.condition(model, data=...)`` around ``model`` fixes
    (observed in its trace like a likelihood; a Trace as ``data`` gives its nodes)."""
    from pyro.poutine.condition_messenger import ConditionMessenger

    names: Set[str] = set()
    for messenger, _ in handler_chain(model):
        if isinstance(messenger, ConditionMessenger):
            # a dict's keys, or a Trace's node names (a Trace iterates them)
            names.update(cast(Iterable[str], messenger.data))
    return frozenset(names)


def likelihood_sites(observed: List[Any], model: Callable[..., Any]) -> List[Any]:
    """The likelihoods among a run's ``observed`` sites of ``model``: where the model
    observes sites of its own (``obs=``), less those ``pyro.condition`` fixes (a
    hyperparameter held at a value); else all (the likelihood given by
    ``pyro.condition``)."""
    fixed = conditioned_sites(model)
    own = [site for site in observed if site["name"] not in fixed]
    return own if own else observed


def wrap_inner(model: Callable[..., Any], messenger: Any,
               transform: Callable[[Callable[..., Any]], Callable[..., Any]]) -> Callable[..., Any]:
    """``model`` with the callable that ``messenger`` (one of its
    :func:`handler_chain`) wraps replaced by ``transform`` of it, under the
    same handlers."""
    chain = handler_chain(model)
    index = next(i for i, (m, _) in enumerate(chain) if m is messenger)
    fn = transform(chain[index][1])
    for outer, _ in reversed(chain[: index + 1]):
        fn = outer(fn)
    return fn


def replace_handler(model: Callable[..., Any], messenger: Any,
                    replacement: Messenger) -> Callable[..., Any]:
    """``model`` with ``messenger`` (one of its :func:`handler_chain`) replaced
    by the handler ``replacement``, under the same other handlers."""
    chain = handler_chain(model)
    index = next(i for i, (m, _) in enumerate(chain) if m is messenger)
    fn: Callable[..., Any] = replacement(chain[index][1])
    for outer, _ in reversed(chain[:index]):
        fn = outer(fn)
    return fn


@contextmanager
def model_swapped(guide: AutoGuide, model: Callable[..., Any]) -> Iterator[None]:
    """Inside, ``guide.model`` is ``model`` (an autoguide keeps its model in the
    private ``_model``), e.g. to set the guide up on a model whose hidden
    sites are held fixed."""
    saved = getattr(guide, "_model", None)
    if not (isinstance(saved, tuple) and len(saved) == 1 and guide.model is saved[0]):
        raise RuntimeError(
            f"expected {type(guide).__name__} to keep its model as _model = (model,); this "
            "Pyro version stores it differently: update pyro_vinit/_pyro_compat.py"
        )
    guide._model = (model,)
    try:
        yield
    finally:
        guide._model = saved


def is_deterministic_site(site: Any) -> bool:
    """Whether a sample site is ``pyro.deterministic``'s record of a value (an
    observed ``Delta`` that Pyro marks with its private ``infer["_deterministic"]``)
    rather than a likelihood or a latent site."""
    return bool((site.get("infer") or {}).get("_deterministic"))


class SubsampledPlate(NamedTuple):
    """A subsampled plate's sizes and the device of its indices."""

    size: int
    subsample_size: int
    device: torch.device


def subsampled_plate(msg: Any) -> Optional[SubsampledPlate]:
    """The plate whose subsample site ``msg`` is, if that plate draws a proper
    subsample (``subsample_size < size``) or asks for more rows than it has
    (``subsample_size > size``, which Pyro refuses unless a handler supplies
    them); else None (another site, or a plate over all its rows)."""
    if not site_is_subsample(msg):
        return None
    fn = msg["fn"]  # Pyro's private _Subsample
    if fn.subsample_size is None or fn.subsample_size == fn.size:
        return None
    return SubsampledPlate(int(fn.size), int(fn.subsample_size), torch.device(fn.device))


def is_vectorized_particles(frame: CondIndepStackFrame) -> bool:
    """Whether the ``CondIndepStackFrame`` ``frame`` is the plate of an ELBO's
    vectorized particles."""
    return frame.name == _PARTICLE_PLATE


def is_predictive_samples(frame: CondIndepStackFrame) -> bool:
    """Whether the ``CondIndepStackFrame`` ``frame`` is the plate of the
    samples of :class:`~pyro.infer.Predictive` with ``parallel=True``."""
    return frame.name == _PREDICTIVE_PLATE


def is_sample_frame(frame: CondIndepStackFrame) -> bool:
    """Whether ``frame`` is the plate of an ELBO's vectorized particles or of
    :class:`~pyro.infer.Predictive`'s samples."""
    return is_vectorized_particles(frame) or is_predictive_samples(frame)


# The objectives that weigh whole-model samples against each other.
_WHOLE_TRACE_ELBOS = (RenyiELBO, TraceTailAdaptive_ELBO, ReweightedWakeSleep)


def whole_trace_weights_elbo() -> Optional[str]:
    """The name of the Pyro objective that runs the model now (a method of
    it, or one it inherits, such as ``TraceTailAdaptive_ELBO``'s
    ``Trace_ELBO.differentiable_loss``, on the call stack) if it weighs
    whole-model samples against each other, as ``RenyiELBO``'s importance
    weights do; else None."""
    frame: Optional[types.FrameType] = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_varnames[:1] == ("self",):
            owner = frame.f_locals.get("self")
            if isinstance(owner, _WHOLE_TRACE_ELBOS):
                return type(owner).__name__
        frame = frame.f_back
    return None


def prefill_log_prob(
    msg: SampleSite,
    unscaled: torch.Tensor,
    scaled: torch.Tensor,
    total: torch.Tensor,
) -> None:
    """
    Stores the log density of the sample site ``msg`` as
    ``Trace.compute_log_prob`` and ``compute_score_parts`` would (a
    reparameterized site: no score function), so that they keep it instead
    of computing it from ``msg["fn"]`` and ``msg["value"]``.

    :param dict msg: A sample site's message.
    :param torch.Tensor unscaled: ``fn.log_prob(value)``.
    :param torch.Tensor scaled: ``unscaled`` with the site's scale and mask applied.
    :param torch.Tensor total: ``scaled.sum()``.
    """
    msg["unscaled_log_prob"] = unscaled
    msg["log_prob"] = scaled
    msg["log_prob_sum"] = total
    msg["score_parts"] = ScoreParts(
        log_prob=scaled,
        score_function=0,  # type: ignore[arg-type]  # Pyro's own 0 for a reparameterized site
        entropy_term=scaled,
    )


def guide_list_of(guide: AutoGuide) -> Optional[AutoGuide]:
    """The ``AutoGuideList`` that holds ``guide`` (Pyro's private ``master``
    reference, through which a member sets itself up), or None."""
    master = getattr(guide, "master", None)
    return cast(Optional[AutoGuide], master()) if master is not None else None


def setup_prototype(guide: AutoGuide, *args: Any, **kwargs: Any) -> None:
    """Runs :class:`~pyro.infer.autoguide.AutoGuide`'s own set-up on ``guide``
    with the model's ``*args, **kwargs``: the prototype trace and plate
    frames, and none of a subclass's parameters (``AutoGuide._setup_prototype``,
    called past the subclasses' overrides)."""
    setup = getattr(AutoGuide, "_setup_prototype", None)
    if not callable(setup):
        raise RuntimeError(
            "expected pyro.infer.autoguide.AutoGuide._setup_prototype; this Pyro version "
            "sets guides up differently: update pyro_vinit/_pyro_compat.py"
        )
    setup(guide, *args, **kwargs)


def share_prototype(source: AutoGuide, target: AutoGuide) -> None:
    """Gives the autoguide ``target`` the prototype trace (and plate frames) of the
    set-up autoguide ``source`` of the same model, as if ``target`` had run the
    model itself (AutoGuide keeps the frames in ``_prototype_frames``)."""
    frames = getattr(source, "_prototype_frames", None)
    if source.prototype_trace is None or not isinstance(frames, dict):
        raise RuntimeError(
            f"expected the set-up {type(source).__name__} to hold prototype_trace and a "
            "_prototype_frames dict; this Pyro version sets guides up differently: update "
            "pyro_vinit/_pyro_compat.py"
        )
    target.prototype_trace = source.prototype_trace
    target._prototype_frames = dict(frames)


def pyro_sample_priors(
    module: torch.nn.Module,
) -> Dict[str, Any]:
    """The priors of the :class:`~pyro.nn.PyroSample` attributes of ``module``
    (not of its submodules), by attribute name; ``{}`` for a plain module
    (PyroModule keeps them in ``_pyro_samples``)."""
    samples = getattr(module, "_pyro_samples", None)
    if samples is None:
        return {}
    if not isinstance(samples, dict):
        raise RuntimeError(
            "expected PyroModule._pyro_samples to be a dict; this Pyro version keeps "
            "PyroSamples differently: update pyro_vinit/_pyro_compat.py"
        )
    return dict(samples)


def active_messengers() -> List[Any]:
    """The effect handlers active now, outermost first (a copy of Pyro's
    ``pyro.poutine.runtime._PYRO_STACK``, which lists them innermost last)."""
    from pyro.poutine import runtime

    stack = getattr(runtime, "_PYRO_STACK", None)
    if not isinstance(stack, list):
        raise RuntimeError(
            "expected pyro.poutine.runtime._PYRO_STACK to be a list; this Pyro version keeps "
            "its handlers differently: update pyro_vinit/_pyro_compat.py"
        )
    return list(stack)


def active_sample_plate() -> Optional[str]:
    """``"particles"`` or ``"samples"`` while the plate of an ELBO's vectorized
    particles or of :class:`~pyro.infer.Predictive`'s samples (``parallel=True``)
    is active (the innermost of them), else None."""
    for messenger in reversed(active_messengers()):
        name = getattr(messenger, "name", None)
        if name == _PARTICLE_PLATE:
            return "particles"
        if name == _PREDICTIVE_PLATE:
            return "samples"
    return None


def _detached(x: Any) -> Any:
    return x.detach() if isinstance(x, torch.Tensor) else x


def _no_nan_check(value: Any, msg: str = "", *args: Any, **kwargs: Any) -> None:
    return None


@contextmanager
def traceable_elbos() -> Iterator[None]:
    """
    Within this context, :class:`~pyro.infer.Trace_ELBO` and
    :class:`~pyro.infer.TraceMeanField_ELBO` read no scalar out of a tensor:
    ``torch_item(x)`` gives ``x.detach()`` (the same value, as a tensor) and
    ``warn_if_nan`` checks nothing, so that their ``differentiable_loss`` can be
    traced by ``torch.fx.experimental.proxy_tensor.make_fx`` (the names those
    modules imported from ``pyro.infer.util`` and ``pyro.util`` are swapped,
    and restored on exit).
    """
    from pyro.infer import trace_elbo, trace_mean_field_elbo

    swaps = [(module, name, value)
             for module in (trace_elbo, trace_mean_field_elbo)
             for name, value in (("torch_item", _detached), ("warn_if_nan", _no_nan_check))]
    missing = [f"{m.__name__}.{n}" for m, n, _ in swaps if not hasattr(m, n)]
    if missing:
        raise RuntimeError(
            f"expected {missing} in Pyro's ELBO modules; this Pyro version reads the loss "
            "differently: update pyro_vinit/_pyro_compat.py"
        )
    saved = [(module, name, getattr(module, name)) for module, name, _ in swaps]
    try:
        for module, name, value in swaps:
            setattr(module, name, value)
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)
