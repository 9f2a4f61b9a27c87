"""
The model's own uses of a sample site's value that leads with the dim of
:class:`~pyro.infer.Predictive`'s samples (``parallel=True``) or of an
ELBO's vectorized particles: like every tensor of such a run, the model must
count its dims from the right. A use that counts them from the left within
the site's own dims (``w[:3]`` for the first rows of a matrix ``w``,
``w.flip(0)``, ``w.t()``) would take or move samples instead; it is refused
with a :class:`ValueError` naming the site and the spelling to use.
"""

from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch.fx.experimental import proxy_tensor

from pyro_vinit._pyro_compat import active_sample_plate, is_sample_frame
from pyro_vinit.poutine._layer_ops import op_name
from pyro_vinit.poutine._left_dims import inputs_of, left_dims
from pyro_vinit.poutine._site_value import SiteValue, from_the_model, unwrap
from pyro_vinit.poutine._tensor_ops import ELEMENT_OPS, ViewOp, element_index

__all__: List[str] = []

_ADVICE = ("a model run with vectorized samples must count a value's dims from the right "
           "(w[..., :3, :] for the first three rows of a matrix w, w.mT rather than w.t() or "
           "w.T, w.unflatten(-1, (5, 4)) rather than w.view(5, 4)). Else predict with "
           "Predictive(..., parallel=False) (or vectorize_particles=False)")


def _sampled(value: Any) -> Optional[SiteValue]:
    # ``value`` where it is a latent site's value in the plate of the samples or particles
    if not (isinstance(value, SiteValue) and value.msgs):
        return None
    frames = value.msgs[0].get("cond_indep_stack", ())
    return value if any(is_sample_frame(f) for f in frames) else None


def _lead(value: SiteValue) -> int:
    # The leading dims that the samples (or particles) give the model's site, which its
    # views keep on their left (a view may have other dims than the site,
    # w.unflatten(-1, (2, 2)), and the draw be another site's, AutoDiagonalNormal's flat
    # latent): its batch dims left of the model's own plates
    msg = value.msgs[-1]  # (the model's site: a guide's draws come first)
    plates = [-f.dim for f in msg.get("cond_indep_stack", ())
              if f.dim is not None and not is_sample_frame(f)]
    return max(len(getattr(msg["fn"], "batch_shape", ())) - max(plates, default=0), 0)


def _keeps_samples(value: SiteValue, op: ViewOp, out: torch.Tensor) -> bool:
    # Whether ``out``, ``op`` of ``value``, keeps the samples' dim of the draw (its first)
    # on its left, each element in its sample (singletons may come and go: Pyro's
    # reshapes of a sample to its plate's dim)
    draw = value.uses.shape
    rows = draw[0] if draw else 1
    if rows == 1:
        return True
    sizes, size = set(), 1
    for n in out.shape:
        size *= n
        sizes.add(size)
    if rows not in sizes:
        return False
    index = element_index(draw, value.view_ops + (op,)) if value.derived is None else None
    if index is None:
        return True
    own = torch.arange(rows).unsqueeze(-1).expand(rows, index.numel() // rows)
    return torch.equal(index.reshape(rows, -1) // draw[1:].numel(), own)


def refuse_left_counting(func: Callable[..., Any], args: Tuple[Any, ...],
                         kwargs: Dict[str, Any], out: Any, dispatch: Tuple[str, ...]) -> None:
    """
    Refuses the model's use ``func(*args, **kwargs)`` of a site value in the
    plate of the samples or particles that counts the value's dims from the
    left within the site's own dims: a dim argument (``w.flip(0)``), or a view
    that indexes, moves or merges the samples' dim (``w[:3]``) or that torch
    refused (``out``, the error, for ``w.t()``).

    :param object out: The result of ``func`` (None before it runs), or its error.
    :param tuple dispatch: The modules that handed the call on to this one (the
        handler's, and a torch function mode's).
    """
    x = next((v for v in map(_sampled, inputs_of(args, kwargs)) if v is not None), None)
    if x is None or active_sample_plate() is None:  # (outside the run: e.g. its results)
        return
    if not from_the_model(__name__, SiteValue.__module__, *dispatch):
        return
    lead = _lead(x)
    found = left_dims(func, args, kwargs, lambda _: lead)
    head = (f"of the value of sample site {x.site!r}, of shape {tuple(x.shape)}, which leads "
            f"with the dims of Predictive's samples (parallel=True) or of vectorized "
            f"particles")
    if found is not None:
        raise ValueError(
            f"{op_name(func)}({found.name}={found.given}) {head}: a dim counted from the "
            f"left lands on them. Count dims from the right, as models run with vectorized "
            f"samples must: {found.name}={found.own}")
    if isinstance(out, (RuntimeError, IndexError)):
        what = f"failed ({str(out).splitlines()[0]})"
    elif func in ELEMENT_OPS and isinstance(out, torch.Tensor):
        op = (func, unwrap(args[1:]), unwrap(kwargs))
        if proxy_tensor.get_proxy_mode() is None:
            keeps = _keeps_samples(x, op, out)
        else:  # (a trace of the step, CapturedSVI: shapes, not values of the step)
            with proxy_tensor.disable_proxy_modes_tracing():
                keeps = _keeps_samples(x, op, out)
        if keeps:
            return
        what = f"indexes, moves or merges them (a result of shape {tuple(out.shape)})"
    else:
        return
    raise ValueError(f"{op_name(func)} {head}, {what}: {_ADVICE}")
