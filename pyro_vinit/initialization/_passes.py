"""
I-BLM's passes over the pool of data rows: one model run per chunk (or block
of a subsampled plate), with the latent sites set to ``values``.
"""

from functools import partial
from typing import Any, Callable, Dict, Iterator, List, Tuple

import torch

from pyro_vinit._typing import SampleSite
from pyro_vinit.initialization._collective import Collective
from pyro_vinit.initialization._data import all_finite
from pyro_vinit.initialization._runs import align_rows, capture, observed_site, run_model
from pyro_vinit.initialization._tracing import Layer, Prepared
from pyro_vinit.poutine.layer_recorder import norm_statistics

#: picks a tensor's rows of the chunk at hand: ``rows_of(tensor, what)``
RowsOf = Callable[[torch.Tensor, str], torch.Tensor]


def observed_sites(prep: Prepared, values: Dict[str, torch.Tensor], chunk_rows: int,
                   collective: Collective) -> Iterator[Tuple[SampleSite, RowsOf]]:
    """The observed site of a run of the model over each chunk (or block) of the
    data, with a function picking a tensor's rows of that chunk, in order."""
    for chunk in collective.chunks(chunk_rows, prep.structure.block_size):
        recorder = run_model(prep.model, values, chunk.args, prep.latent,
                             plate_rows=chunk.plate_rows, norm_sync=chunk.norm_sync)
        if not chunk.keep:  # a run for the collectives only
            continue
        n = prep.pool.rows_of(chunk.args)
        yield observed_site(recorder), partial(align_rows, n=n, rows=chunk.plate_rows,
                                               keep=chunk.keep)


def layer_inputs(prep: Prepared, values: Dict[str, torch.Tensor], layer: Layer,
                 chunk_rows: int, collective: Collective) -> torch.Tensor:
    """The input of ``layer`` on every row of the pool ``(rows, ...)``."""
    chunks: List[torch.Tensor] = []
    with collective.agree():
        for chunk in collective.chunks(chunk_rows, prep.structure.block_size):
            x, _ = capture(prep.model, values, chunk.args, prep.latent, layer.weight_name,
                           plate_rows=chunk.plate_rows, norm_sync=chunk.norm_sync)
            if chunk.keep:  # (0: a run for the collectives only)
                chunks.append(align_rows(x, f"the input of layer {layer.weight_name!r}",
                                         n=prep.pool.rows_of(chunk.args),
                                         rows=chunk.plate_rows, keep=chunk.keep))
        inputs = torch.cat(chunks)
        if not all_finite(inputs):
            raise ValueError(f"the input of layer {layer.weight_name!r} is not finite")
    return inputs


@torch.no_grad()
def refresh_norm_statistics(prep: Prepared, values: Dict[str, torch.Tensor], chunk_rows: int,
                            collective: Collective) -> None:
    """Sets the running statistics of every ``F.batch_norm`` the model calls
    (``nn.BatchNorm*d``) to the mean and variance of its input over the data
    with the latent sites at ``values``, so that the model in eval mode
    computes what the initializer fitted (it normalizes with batch statistics
    while fitting)."""
    if not prep.structure.batch_norm:
        return
    for running_mean, running_var, mean, var in norm_input_statistics(prep, values, chunk_rows,
                                                                      collective):
        running_mean.copy_(mean)
        if running_var is not None:
            running_var.copy_(var)


def norm_input_statistics(prep: Prepared, values: Dict[str, torch.Tensor], chunk_rows: int,
                          collective: Collective) -> List[Tuple[torch.Tensor, ...]]:
    """:func:`~pyro_vinit.poutine.layer_recorder.norm_statistics` of every
    ``F.batch_norm`` input over the pool's rows, each counted once, with the
    latent sites at ``values``."""
    accumulated: Dict[int, List[Any]] = {}
    for chunk in collective.chunks(chunk_rows, prep.structure.block_size):
        rows = (prep.pool.rows_of(chunk.args) if chunk.plate_rows is None
                else len(chunk.plate_rows))
        run_model(prep.model, values, chunk.args, prep.latent,
                  plate_rows=chunk.plate_rows, norm_sync=chunk.norm_sync,
                  norm_statistics=accumulated if chunk.keep else {},
                  norm_rows=(rows, chunk.keep))
    collective.reduce_norm_statistics(accumulated)
    return norm_statistics(accumulated)
