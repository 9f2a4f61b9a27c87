"""
One run of the model for the data-driven initializers: ``model(*args)`` with
some latent sites set, under a
:class:`~pyro_vinit.poutine.layer_recorder.LayerRecorderMessenger`. Every
model run of I-BLM goes through :func:`run_model`.
"""

import warnings
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Tuple

import pyro.poutine as poutine
import torch
from pyro.poutine.condition_messenger import ConditionMessenger
from torch.distributions import Distribution, Independent

from pyro_vinit._pyro_compat import (
    handler_chain,
    likelihood_sites,
    unwrap_init_messenger,
    wrap_inner,
)
from pyro_vinit._typing import SampleSite, sample_site
from pyro_vinit._warn import warn_at_caller
from pyro_vinit.initialization._data import DataPool
from pyro_vinit.initialization._rollback import innermost, rng_state, set_rng_state
from pyro_vinit.poutine.layer_recorder import (
    LayerRecorderMessenger,
    PlateRowsMessenger,
    RecordedLayer,
    StopModel,
)

if TYPE_CHECKING:
    from pyro.poutine.runtime import Message

#: batch-normalization statistics over several processes (see ``LayerRecorderMessenger``)
NormSyncFn = Callable[[torch.Tensor, List[int]], Tuple[torch.Tensor, ...]]


def run_model(
    model: Callable[..., Any],
    values: Dict[str, torch.Tensor],
    args: Sequence[Any],
    latent: Sequence[str],
    *,
    plate_rows: Optional[torch.Tensor] = None,
    num_rows: Optional[int] = None,
    track_flow: bool = False,
    on_layer: Optional[Callable[[RecordedLayer], Optional[torch.Tensor]]] = None,
    norm_statistics: Optional[Dict[int, List[Any]]] = None,
    norm_sync: Optional[NormSyncFn] = None,
    norm_rows: Optional[Tuple[int, int]] = None,
    sources: Optional[Dict[str, torch.Tensor]] = None,
) -> LayerRecorderMessenger:
    """Runs ``model(*args)`` with the latent sites set to ``values`` (hidden from
    any handler outside, e.g. ``local_reparam``) under a layer recorder, which
    it returns; ``on_layer`` may stop the run (:class:`StopModel`). The
    subsampled plates take ``plate_rows`` or, if ``args`` have ``num_rows``
    rows, rows among those (see :func:`in_rows`). With ``track_flow``, ``sources``
    are the values of sites hidden from the recorder (held by the model)."""
    recorder = LayerRecorderMessenger(
        latent,
        track_flow=track_flow,
        norm_statistics=norm_statistics,
        on_layer=on_layer,
        norm_sync=norm_sync,
        norm_rows=norm_rows,
        sources=sources,
        # (a BatchNorm layer in eval mode in a model in train mode is frozen)
        keep_frozen_norms=getattr(innermost(model), "training", False) is True,
    )
    if all(name in values for name in latent):
        # every latent site is conditioned: the autoguide's InitMessenger around the
        # model would only draw initial values (a prior sample per site) to be overwritten
        model = unwrap_init_messenger(model)
    fn = conditioned_in_rows(model, values, PlateRowsMessenger(plate_rows, num_rows))
    with torch.no_grad(), poutine.block(), recorder:
        fn(*args)
    recorder.observed[:] = likelihood_sites(recorder.observed, model)
    return recorder


def in_rows(model: Callable[..., Any], plates: PlateRowsMessenger) -> Callable[..., Any]:
    """``model`` with ``plates`` choosing the indices of its subsampled plates,
    applied inside every handler wrapped around it (so that a ``poutine.block``
    cannot hide a plate from it)."""
    chain = handler_chain(model)
    if not chain:
        return plates(model)
    return wrap_inner(model, chain[-1][0], plates)


def conditioned_in_rows(model: Callable[..., Any], values: Dict[str, torch.Tensor],
                        plates: PlateRowsMessenger) -> Callable[..., Any]:
    """``model`` in the rows ``plates`` choose (see :func:`in_rows`), with its
    sites set to ``values``; a per-example site whose values are not one per
    row of the run (an autoguide's, set up on all the rows, in a run on a chunk
    of them) is set to its prior's median, with a warning."""
    return _RowsConditionMessenger(values)(in_rows(model, plates))


class _RowsConditionMessenger(ConditionMessenger):
    data: Dict[str, torch.Tensor]

    def _pyro_sample(self, msg: "Message[..., Any]") -> None:
        super()._pyro_sample(msg)
        site = sample_site(msg)
        value, fn = site["value"], site["fn"]
        if site["name"] not in self.data or not isinstance(value, torch.Tensor):
            return
        for frame in site["cond_indep_stack"]:
            dim = (frame.dim or 0) - fn.event_dim
            if frame.vectorized and value.dim() >= -dim and value.shape[dim] not in (
                    1, frame.size):
                warn_at_caller(
                    f"the latent site {site['name']!r} lies in plate {frame.name!r}, and its "
                    f"guide holds {value.shape[dim]} values (one per row of the data it was "
                    "set up on), which I-BLM's runs of the model on chunks or blocks of the "
                    "rows cannot follow: its layers are fitted with it at its prior's "
                    "median, and its guide keeps its own initial values",
                    UserWarning)
                site["value"] = prior_median(fn).to(value)
                return


def _unwrap(fn: Distribution) -> Distribution:
    while isinstance(fn, Independent) or type(fn).__name__ in (
        "ExpandedDistribution",
        "MaskedDistribution",
    ):
        # Independent and Pyro's ExpandedDistribution / MaskedDistribution all
        # wrap the distribution they transform as base_dist
        fn = fn.base_dist  # type: ignore[attr-defined]
    return fn


def prior_median(fn: Distribution) -> torch.Tensor:
    """The median of a prior (its ``icdf(0.5)``, else of 1001 draws), in its shape."""
    shape = fn.batch_shape + fn.event_shape
    base = _unwrap(fn)
    try:
        like = base.sample()  # (the prior's dtype and device)
        half = torch.full(like.shape, 0.5, dtype=like.dtype, device=like.device)
        return base.icdf(half).expand(shape).clone()
    except (NotImplementedError, AttributeError, ValueError, RuntimeError):
        return fn.sample(torch.Size([1001])).median(0).values


def draws_the_rows(model: Callable[..., Any], values: Dict[str, torch.Tensor],
                    pool: DataPool, num_rows: int) -> bool:
    """Whether the model's subsampled plate, whose subsample size is the
    ``num_rows`` rows of the first chunk, draws as many rows as its arguments
    have (``pyro.plate("data", N, subsample_size=len(x))``: every row at hand,
    the likelihood scaled to ``N``), not a subsample of its own size: run on one
    row fewer, and one more where the pool has it, its subsample follows."""
    more = pool.rows_of(pool.select(slice(0, num_rows + 1))) > num_rows
    for rows in (num_rows - 1, num_rows + 1) if more else (num_rows - 1,):
        plates = PlateRowsMessenger(num_rows=rows)
        trace_on(model, pool, rows, plates, values)
        if {s for _, s in plates.subsampled_plates.values()} != {rows}:
            return False
    return True


def trace_on(model: Callable[..., Any], pool: DataPool, rows: int,
              plates: Optional[PlateRowsMessenger] = None,
              values: Optional[Dict[str, torch.Tensor]] = None) -> poutine.Trace:
    """The model's trace on the pool's first ``rows`` rows (its subsampled plates
    among them, its sites at ``values``), the generators left as they were."""
    plates = PlateRowsMessenger(num_rows=rows) if plates is None else plates
    rng = rng_state()
    try:
        with torch.no_grad(), poutine.block(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (a per-example latent's fallback: said already)
            return poutine.trace(conditioned_in_rows(model, values or {}, plates)).get_trace(
                *pool.select(slice(0, rows)))
    finally:
        set_rng_state(rng)


def observed_site(recorder: LayerRecorderMessenger) -> SampleSite:
    """The single observed sample site of a recorded run (``pyro.deterministic``
    sites and plate subsamples are not observations)."""
    sites = recorder.observed
    if len(sites) != 1:
        found = [s["name"] for s in sites]
        hint = (
            "call it with its targets, e.g. init_guide_iblm(guide, (x, y)); a guide set up "
            "without them (guide(x), Predictive(model, guide=guide)(x)) draws the likelihood "
            "as a latent site: make a fresh guide and let I-BLM set it up"
            if not sites
            else "I-BLM fits one likelihood; combine the observations into one site"
        )
        raise ValueError(
            f"I-BLM needs a model with exactly one observed sample site (its likelihood); "
            f"found {found}: {hint}"
        )
    return sites[0]


def capture(
    model: Callable[..., Any],
    values: Dict[str, torch.Tensor],
    args: Sequence[Any],
    latent: Sequence[str],
    weight_name: str,
    *,
    output: bool = False,
    plate_rows: Optional[torch.Tensor] = None,
    norm_sync: Optional[NormSyncFn] = None,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The input (and output) of the layer with weight ``weight_name`` when
    ``model(*args)`` runs with the latent sites set to ``values``; the model
    stops there."""
    found: Dict[str, torch.Tensor] = {}

    def on_layer(record: RecordedLayer) -> Optional[torch.Tensor]:
        if record.weight_name == weight_name:
            found["input"] = record.call.input
            if output:
                found["output"] = record.call()
            raise StopModel
        return None

    run_model(model, values, args, latent, plate_rows=plate_rows, on_layer=on_layer,
              norm_sync=norm_sync)
    if "input" not in found:
        raise RuntimeError(
            f"the model did not call the layer with weight {weight_name!r} on these "
            "arguments; I-BLM needs the same layers to run on every batch"
        )
    return found["input"], found.get("output")


def align_rows(tensor: torch.Tensor, what: str, *, n: int, rows: Optional[torch.Tensor],
               keep: int) -> torch.Tensor:
    """The rows of ``tensor`` for the block ``rows`` of a chunk of ``n`` rows."""
    if rows is None:
        if tensor.dim() == 0 or tensor.shape[0] != n:
            raise ValueError(
                f"{what} has shape {tuple(tensor.shape)} for {n} data rows; I-BLM needs the "
                "data rows along the leading dim"
            )
        # keep < n only for a run that a sharded pool makes to take part in collectives
        return tensor if keep == n else tensor[:keep]
    if tensor.dim() and tensor.shape[0] == len(rows):
        return tensor[:keep]
    if tensor.dim() and tensor.shape[0] == n:
        return tensor[rows[:keep]]
    raise ValueError(
        f"{what} has shape {tuple(tensor.shape)}, neither the {len(rows)} rows of the "
        f"subsampled plate nor the {n} rows of the data; I-BLM needs the data rows along "
        "the leading dim"
    )


def one_dim_sites(shapes: Dict[str, torch.Size]) -> List[str]:
    """The names among ``shapes`` of the sites of one dimension (of more than one
    element): a weight used as ``x @ beta`` with ``beta`` of shape (D,), which is
    not read as a layer (for the errors that name them)."""
    return [name for name, shape in shapes.items() if len(shape) == 1 and shape[0] > 1]
