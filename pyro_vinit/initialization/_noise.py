"""
I-BLM's observation noise (regression with a learnable scale): the residual
std of the fitted network, and the noise site's, param's or scale head's
value that gives it, found by false position through the model.
"""

from dataclasses import replace
from typing import Any, Callable, Dict, Optional, Tuple, Union, cast

import pyro
import torch
from torch.distributions import Normal, StudentT, biject_to

from pyro_vinit._warn import warn_at_caller
from pyro_vinit.initialization._collective import Collective
from pyro_vinit.initialization._fits import Fit, NoiseFit, stage
from pyro_vinit.initialization._options import IBLMOptions
from pyro_vinit.initialization._passes import layer_inputs, observed_sites
from pyro_vinit.initialization._rollback import write_param
from pyro_vinit.initialization._runs import observed_site, run_model
from pyro_vinit.initialization._solve import solve_layer
from pyro_vinit.initialization._targets import Targets
from pyro_vinit.initialization._tracing import Layer, Prepared, unwrap_likelihood
from pyro_vinit.poutine.layer_recorder import RecordedLayer

# Unconstrained range searched for the noise level.
_LINK_RANGE = 15.0


def fit_noise(prep: Prepared, values: Dict[str, torch.Tensor], targets: Targets,
              fits: Dict[str, Fit], options: IBLMOptions,
              collective: Collective) -> Optional[NoiseFit]:
    r"""
    Regression: the residual std :math:`\hat\sigma` of the fitted network (at
    ``values``), used in two refits of the output layer (updating ``fits`` and
    ``values``), and the value that gives it to the noise site or param (or
    the fit of the scale head that does).
    """
    likelihood = prep.likelihood
    if targets.task != "regression" or targets.fixed_noise:
        return None
    output = prep.structure.output_layers[0]
    if options.noise_scale is not None:
        sigma = torch.tensor(options.noise_scale, dtype=targets.y.dtype,
                             device=targets.y.device)
    else:
        inputs = layer_inputs(prep, values, output, options.chunk_rows, collective)
        for _ in range(2):  # the residuals of a fit with the noise they imply
            sigma = residual_std(prep, values, options.chunk_rows, collective)
            # (in the targets' units: the likelihood's over the model's gain)
            own = sigma if targets.gain is None else sigma / targets.gain.abs()
            refit = replace(targets, noise_var=_column_var(own, targets.y))
            fit = solve_layer(prep.pool, output, inputs, refit, options, collective)
            stage(prep.site_shape, values, fits, fit, options.propagate)
        sigma = residual_std(prep, values, options.chunk_rows, collective)
    if likelihood.noise == "layer":
        head = next(layer for layer in prep.layers if layer.role == "scale")
        level = link_inverse(prep, values, sigma, collective, head=head)
        inputs = layer_inputs(prep, values, head, options.chunk_rows, collective)
        fit = solve_layer(prep.pool, head, inputs, targets, options, collective, constant=level)
        stage(prep.site_shape, values, fits, fit, options.propagate)
        return None
    return noise_fit(prep, values, sigma, collective)


def noise_fit(prep: Prepared, values: Dict[str, torch.Tensor], sigma: torch.Tensor,
              collective: Collective) -> Optional[NoiseFit]:
    """For a noise site or param, the value that gives the noise std ``sigma`` to
    the likelihood (:func:`link_inverse`); else None."""
    likelihood = prep.likelihood
    if likelihood is None or likelihood.noise not in ("site", "param", "held"):
        return None
    try:
        level = link_inverse(prep, values, sigma, collective)
    except ValueError as error:
        if likelihood.noise != "held":
            raise
        # e.g. a narrow support of another member's site: that member's value stays
        warn_at_caller(f"{error}; the noise site, which another member of the guide list "
                       "owns, keeps that member's value", UserWarning)
        return None
    spread = torch.full_like(level, min(0.1, (2.0 * prep.pool.num_rows) ** -0.5))
    return NoiseFit(cast(str, likelihood.noise_name), level, spread)


def residual_std(prep: Prepared, values: Dict[str, torch.Tensor], chunk_rows: int,
                 collective: Collective) -> torch.Tensor:
    """Root mean square residual of the network at ``values``, per target column."""
    squares: Union[float, torch.Tensor] = 0.0
    n: Union[int, torch.Tensor] = 0
    with collective.agree():
        for site, rows_of in observed_sites(prep, values, chunk_rows, collective):
            fn = cast(Union[Normal, StudentT], unwrap_likelihood(site))  # regression
            loc = fn.loc.expand(site["value"].shape)
            loc = rows_of(loc, "the likelihood's mean")
            obs = rows_of(site["value"], "the observed site")
            resid = (obs - loc).reshape(obs.shape[0], -1)
            squares = squares + resid.pow(2).sum(0)
            n += resid.shape[0]
    squares = cast(torch.Tensor, squares)  # the pool has rows: some chunk kept them
    total = collective.all_reduce(torch.cat([squares, squares.new_tensor([n])]))
    squares, n = total[:-1], total[-1]
    return (squares / n).sqrt().clamp_min(1e-6)


def link_inverse(prep: Prepared, values: Dict[str, torch.Tensor], sigma: torch.Tensor,
                 collective: Collective, head: Optional[Layer] = None) -> torch.Tensor:
    """The unconstrained value of the noise site or param (or the constant
    output of the scale head) at which the likelihood's scale is ``sigma``,
    by false position (the map is taken to be monotone and element-wise), on the
    first rows (the first process's)."""
    with collective.agree():
        level = _search_link(prep, values, sigma, head)
    return collective.broadcast(level)


def _search_link(prep: Prepared, values: Dict[str, torch.Tensor], sigma: torch.Tensor,
                 head: Optional[Layer]) -> torch.Tensor:
    likelihood = prep.likelihood
    # the noise site's or param's name (or the scale head's): set whenever the noise is fitted
    noise_name = cast(str, likelihood.noise_name)
    args, rows = prep.first, None
    if prep.structure.block_size is not None:
        n = prep.pool.rows_of(args)
        rows = torch.arange(prep.structure.block_size, device=prep.pool.device) % n
    model, latent = prep.model, prep.latent
    if head is not None:
        shape = torch.Size([head.num_units])
        what = f"the scale head {head.weight_name!r}"
    elif likelihood.noise == "site":
        site = prep.guide.prototype_trace.nodes[noise_name]
        shape, support = site["value"].shape, site["fn"].support
        what = f"the noise site {noise_name!r}"
    elif likelihood.noise == "held":  # set through the value the model holds it at
        held_value, source = prep.structure.held[noise_name]
        shape, support = held_value.shape, likelihood.noise_support
        what = f"the noise site {noise_name!r}"
    else:
        store = pyro.get_param_store()
        if noise_name not in store:
            raise ValueError(
                f"I-BLM sets the model's learned noise param {noise_name!r} through Pyro's "
                "param store, which does not hold it (under pyro.settings.set("
                "module_local_params=True) it is its module's own): run I-BLM with "
                "module_local_params=False, or pass init=None to fit"
            )
        # set in place: a PyroModule's own nn.Parameter ignores what pyro.param returns
        saved = dict(store.named_parameters())[noise_name].detach().clone()  # unconstrained
        shape = saved.shape
        what = f"the noise param {noise_name!r}"
    target = sigma if sigma.numel() == shape.numel() else sigma.pow(2).mean().sqrt()

    def scale_at(u: torch.Tensor) -> torch.Tensor:
        kwargs: Dict[str, Any] = {}
        run_values = values
        if head is not None:
            def on_layer(record: RecordedLayer) -> Optional[torch.Tensor]:
                if record.weight_name != head.weight_name:
                    return None
                return u.to(record.call.input).expand(record.call.input.shape[:-1] + shape)

            kwargs["on_layer"] = on_layer
        elif likelihood.noise == "site":
            run_values = {**values, noise_name: biject_to(support)(u)}
        elif likelihood.noise == "held":
            prep.structure.held[noise_name] = (biject_to(support)(u).to(held_value), source)
        else:
            write_param(noise_name, u)
        recorder = run_model(model, run_values, args, latent, plate_rows=rows, **kwargs)
        site = observed_site(recorder)
        fn = cast(Union[Normal, StudentT], unwrap_likelihood(site))  # regression
        scale = fn.scale.expand(site["fn"].shape())  # (the model's shape, not the value's)
        scale = scale.reshape(scale.shape[0], -1) if scale.dim() else scale.reshape(1, 1)
        per_column = scale.mean(0)
        if per_column.numel() == u.numel():
            return per_column.reshape(u.shape)
        return scale.mean().expand(u.shape)

    dtype, device = target.dtype, target.device
    lo = torch.full(shape, -_LINK_RANGE, dtype=dtype, device=device)
    hi = torch.full(shape, _LINK_RANGE, dtype=dtype, device=device)
    goal = target.reshape(shape) if target.numel() > 1 else target.reshape(()).expand(shape)
    try:
        level, reached = monotone_inverse(scale_at, goal, lo, hi)
    finally:
        if likelihood.noise == "param" and head is None:
            write_param(noise_name, saved)  # (the level is written with the fits)
        elif likelihood.noise == "held":  # (written by the guide list into its owner)
            prep.structure.held[noise_name] = (held_value, source)
    if not bool(((reached - goal).abs() <= 1e-3 * goal).all()):
        raise ValueError(
            f"I-BLM estimated the observation noise std as {goal.tolist()}, but {what} "
            f"cannot make the likelihood's scale that (closest: {reached.tolist()}); "
            "widen its prior's support, or pass noise_scale=..."
        )
    return level


def monotone_inverse(
    fn: Callable[[torch.Tensor], torch.Tensor], goal: torch.Tensor, lo: torch.Tensor,
    hi: torch.Tensor,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """
    ``(u, fn(u))`` with ``fn(u) = goal`` element-wise, ``lo <= u <= hi``, for an
    element-wise monotone positive ``fn`` (increasing or decreasing), by the
    Illinois variant of false position on ``log fn`` (one step where ``log fn``
    is linear in ``u``, as for an exp link; a few for softplus), a bisection
    step wherever false position leaves the bracket. It stops once every
    element is within a relative 1e-6 of ``goal`` (or its bracket has closed),
    or after 60 steps (two calls of ``fn`` for the ends, one per step); an
    unreachable ``goal`` gives the nearer end of the range.
    """
    tol = max(1e-6, 8 * torch.finfo(goal.dtype).eps)
    log_goal = goal.log()
    f_lo, f_hi = fn(lo).log() - log_goal, fn(hi).log() - log_goal
    # a: the end where log fn - log goal is below zero, b: above (for a reachable goal)
    swap = f_lo > f_hi
    a, b = torch.where(swap, hi, lo), torch.where(swap, lo, hi)
    fa, fb = torch.where(swap, f_hi, f_lo), torch.where(swap, f_lo, f_hi)
    side = torch.zeros_like(goal, dtype=torch.long)  # the end replaced last: -1 a, +1 b
    u, value = lo, goal  # (set by the first step)
    for _ in range(60):
        u = a - fa * (b - a) / (fb - fa)
        inside = torch.isfinite(u) & (u >= torch.minimum(a, b)) & (u <= torch.maximum(a, b))
        u = torch.where(inside, u, (a + b) / 2)
        value = fn(u)
        f = value.log() - log_goal
        closed = ((value - goal).abs() <= tol * goal) | ((b - a).abs() <= tol * (1 + u.abs()))
        if bool(closed.all()):
            break
        below, above = (f < 0) & ~closed, (f > 0) & ~closed
        # Illinois: an end kept twice in a row has its value halved
        fb = torch.where(below & (side == -1), fb / 2, fb)
        fa = torch.where(above & (side == 1), fa / 2, fa)
        a, fa = torch.where(below, u, a), torch.where(below, f, fa)
        b, fb = torch.where(above, u, b), torch.where(above, f, fb)
        side = torch.where(below, -1, torch.where(above, 1, side))
        a, b = torch.where(closed, u, a), torch.where(closed, u, b)  # settled: frozen at u
        fa, fb = torch.where(closed, f, fa), torch.where(closed, f, fb)
    return u, value


def _column_var(sigma: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Noise variances shaped like ``y`` from a residual std per column (or one)."""
    return sigma.pow(2).to(y).expand(y.shape[1]).expand_as(y).clone()
