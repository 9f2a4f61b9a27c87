"""
:func:`update_batch_norm`: the running statistics of a Bayesian network's
BatchNorm layers, recomputed for the guide's current posterior.
"""

import itertools
from typing import Any, Callable, Iterable, Iterator, List, Optional, Union, cast

import pyro.poutine as poutine
import torch
from torch import nn

from pyro_vinit._warn import warn_at_caller
from pyro_vinit.initialization._observed import error_text
from pyro_vinit.training._support import Batch, _is_pair, describe_batch, module_modes

__all__ = ["update_batch_norm"]

def _batches(data: Union[Batch, Iterable[Batch]], batch_size: int) -> Iterator[Batch]:
    if _is_pair(data):
        x, y = cast(Batch, tuple(data))
        starts = list(range(0, len(x), batch_size))
        if len(starts) > 1 and len(x) - starts[-1] == 1:
            starts.pop()  # a last row alone joins the batch before it
        for i, start in enumerate(starts):
            end = starts[i + 1] if i + 1 < len(starts) else len(x)
            yield x[start:end], y[start:end]
        return
    for i, batch in enumerate(cast(Iterable[Any], data)):
        if not _is_pair(batch):
            raise TypeError(
                "update_batch_norm: data must be an (x, y) pair of tensors or an iterable of "
                f"(x, y) batches; batch {i} is a {type(batch).__name__}"
            )
        yield cast(Batch, tuple(batch))


@torch.no_grad()
def update_batch_norm(
    model: Callable[..., Any],
    guide: Callable[..., Any],
    data: Union[Batch, Iterable[Batch]],
    *,
    batch_size: int = 1024,
) -> int:
    r"""
    Recomputes the running statistics of every ``nn.BatchNorm*d`` of ``model``
    over ``data``, with the latent sites at the guide's median (in a model in
    train mode, a BatchNorm layer in eval mode is frozen and left alone).

    In train mode a BatchNorm layer normalizes with the statistics of its
    batch; in eval mode, with running statistics accumulated while training.
    Those lag behind the weights as SVI moves them, and eval-mode predictions
    go wrong. As ``torch.optim.swa_utils.update_bn`` does for averaged
    weights, this recomputes them, as the average over ``data`` of each
    batch's statistics, for the weights of the current posterior.
    :func:`~pyro_vinit.fit` calls it after training a model that has
    BatchNorm layers.

    Usage::

        update_batch_norm(model, guide, (x, y))
        model.eval()  # predict

    :param callable model: A Pyro model that is an ``nn.Module`` (e.g. a
        ``PyroModule``); a model without BatchNorm layers is left as it is.
    :param callable guide: Its guide, with a ``median(*args)`` method (every
        autoguide has one).
    :param data: An ``(x, y)`` pair of tensors, or an iterable of ``(x, y)``
        batches (e.g. a ``DataLoader``; a batch of one row, from which
        BatchNorm computes no statistics, is left out, with a warning).
    :param int batch_size: Rows per model run for an ``(x, y)`` pair (a last
        row alone joins the run before it).
    :return: The number of BatchNorm layers updated.
    :rtype: int
    """
    if not isinstance(model, nn.Module):
        return 0
    # (in a model in train mode, a layer in eval mode is frozen: its statistics kept)
    norms: List[nn.modules.batchnorm._BatchNorm] = [
        m for m in model.modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats
        and (m.training or not model.training)
    ]
    if not norms:
        return 0
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(
            f"update_batch_norm: batch_size must be a positive int, got {batch_size!r}"
        )
    median = getattr(guide, "median", None)
    if not callable(median):
        raise TypeError(
            f"update_batch_norm: the guide ({type(guide).__name__}) has no median(); pass an "
            "autoguide"
        )
    if isinstance(data, torch.Tensor) or not (_is_pair(data) or isinstance(data, Iterable)):
        raise TypeError(
            "update_batch_norm: data must be an (x, y) pair of tensors or an iterable of (x, y) "
            f"batches, got {type(data).__name__}"
        )
    batches = _batches(data, batch_size)
    first = next(batches, None)
    if first is None:
        raise ValueError("update_batch_norm: data has no batches")
    try:
        values = median(*first)
    except Exception as e:  # the user's model and guide: any error, said with the batch
        raise ValueError(f"update_batch_norm: the guide's median fails on the first batch "
                         f"({describe_batch(first)}): {error_text(e)}") from e
    momenta: List[Optional[float]] = [m.momentum for m in norms]
    saved = [(m.running_mean.clone() if m.running_mean is not None else None,
              m.running_var.clone() if m.running_var is not None else None,
              m.num_batches_tracked.clone() if m.num_batches_tracked is not None else None)
             for m in norms]
    try:
        for m in norms:
            m.reset_running_stats()
            m.momentum = None  # a cumulative average over the batches
        # (a frozen layer normalizes as it did)
        with module_modes([model], train=True, keep=lambda m: isinstance(
                m, nn.modules.batchnorm._BatchNorm) and m not in norms):
            conditioned = poutine.block(poutine.condition(model, data=values))
            left_out = []
            for i, batch in enumerate(itertools.chain([first], batches)):
                if len(batch[0]) == 1:  # (one at a time: a loader is not held in memory)
                    left_out.append(i)  # train-mode BatchNorm takes no single row
                    continue
                try:
                    conditioned(*batch)
                except Exception as e:  # the user's model: any error, said with the batch
                    raise ValueError(f"update_batch_norm: the model fails on batch {i} of data "
                                     f"({describe_batch(batch)}): {error_text(e)}") from e
            if left_out and len(left_out) == i + 1:
                raise ValueError(
                    "update_batch_norm: every batch of data has a single row, from which "
                    "BatchNorm computes no statistics; pass batches of two rows or more")
            if left_out:
                warn_at_caller(
                    f"update_batch_norm: the batches {left_out} of data have a single row, from "
                    "which BatchNorm computes no statistics; the statistics are those of the "
                    "other batches", UserWarning)
    except BaseException:
        for m, (mean, var, count) in zip(norms, saved):
            for buffer, value in ((m.running_mean, mean), (m.running_var, var),
                                  (m.num_batches_tracked, count)):
                if buffer is not None and value is not None:
                    buffer.copy_(value)
        raise
    finally:
        for m, momentum in zip(norms, momenta):
            m.momentum = momentum
    names = {id(m): name for name, m in model.named_modules()}
    flat = [names[id(m)] for m in norms
            if m.running_var is not None and bool((m.running_var == 0).any())]
    if flat:
        warn_at_caller(
            f"update_batch_norm: the inputs of the BatchNorm layers {flat} have channels of "
            "variance 0 at the guide's median (e.g. a guide neither initialized nor "
            "trained, whose median weights are all 0), which eval mode divides by "
            "sqrt(eps); initialize the guide (init_guide_iblm) or train it first",
            UserWarning)
    return len(norms)
