"""Metrics accumulated over batches of test points and reduced across processes."""

import math
from typing import Any, Dict, List, Optional, Tuple, Union

import torch

from pyro_vinit.metrics._math import (
    _brier,
    _calibration_sums,
    _check_num_bins,
    _class_log_probs,
    _class_nll,
    _entropy,
    _errors,
    _predictive_log_probs,
    _regression_inputs,
    _regression_nll,
    _squared_errors,
)
from pyro_vinit.metrics.functional import (
    Calibration,
    _calibration_from_sums,
    _check_scores,
    ood_auroc,
)

__all__ = ["ClassificationMetrics", "OODAUROC", "RegressionMetrics"]


def _check_not_synced(acc: Any, what: str) -> None:
    if acc._synced:
        raise RuntimeError(
            f"{type(acc).__name__}.{what}: the state already holds every process's data, "
            "which would count twice; call reset() to start a new evaluation"
        )


# The accumulators count and sum in float64, exact or nearly so where the
# batch's dtype (float16 above 2048, float32 above 2 ** 24) would not be.


def _count(n: int, like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(float(n), dtype=torch.float64, device=like.device)


def _sum64(values: torch.Tensor) -> torch.Tensor:
    return values.to(torch.float64).sum()


class _StreamingMetrics:
    # Sums of per-point values over batches, in float64 (counts stay exact up
    # to 2 ** 53), all-reduced in one call by sync().

    _names: Tuple[str, ...] = ()

    def __init__(self) -> None:
        self.reset()

    def _sizes(self) -> Tuple[int, ...]:
        return (1,) * len(self._names)

    def reset(self) -> None:
        """
        Forgets every batch (and a previous :meth:`sync`).
        """
        self._state = {
            name: torch.zeros(size, dtype=torch.float64)
            for name, size in zip(self._names, self._sizes())
        }
        self._synced = False

    def _add(self, **sums: torch.Tensor) -> None:
        # called once per update() with every statistic, after all the checks
        _check_not_synced(self, "update() after sync()")
        for name, value in sums.items():
            state = self._state[name]
            if state.device != value.device:
                state = state.to(value.device)
            self._state[name] = state + value.detach().to(torch.float64)

    def sync(self, process_group: Optional[Any] = None) -> None:
        """
        Sums the statistics of every process of ``process_group`` (a collective
        call: every process must make it, after its last :meth:`update`). A
        no-op where :mod:`torch.distributed` is not initialized.

        :param process_group: The process group to reduce over (default: the
            whole world).
        """
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return
        _check_not_synced(self, "sync() was already called")
        flat = torch.cat([value.reshape(-1) for value in self._state.values()])
        device = flat.device
        if dist.get_backend(process_group) == "nccl":
            flat = flat.to(torch.device("cuda", torch.cuda.current_device()))
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=process_group)
        flat = flat.to(device)
        state, start = {}, 0
        for name, value in self._state.items():
            state[name] = flat[start : start + value.numel()].reshape(value.shape)
            start += value.numel()
        self._state = state
        self._synced = True

    def _num_points(self) -> float:
        num_points = self._state["num_points"].item()
        if num_points == 0:
            raise ValueError(
                f"{type(self).__name__}.compute() before any test point: call update() with "
                "each batch first"
            )
        return num_points


class ClassificationMetrics(_StreamingMetrics):
    r"""
    The metrics of :func:`classification_metrics`, accumulated over batches of
    test points: each :meth:`update` keeps sums of per-point values (and the
    per-bin sums of the ECE), not the batch, so a test set of any size takes
    memory of one batch. :meth:`sync` adds up the sums of the processes of a
    :mod:`torch.distributed` group; :meth:`compute` then gives the values of
    the functions on all the test points at once.

    Usage::

        acc = ClassificationMetrics()
        for batch in torch.arange(len(y_test)).split(10):   # a test loader's batches
            acc.update(y_test[batch], logits=logits[:, batch])
        acc.sync()      # under torch.distributed: every rank, after its last batch
        acc.compute()   # classification_metrics(y_test, logits=logits), batch by batch

    :param int num_bins: Number of confidence bins of the ECE.
    """

    _names = (
        "num_points", "error", "nll", "brier", "entropy", "bin_count", "bin_conf", "bin_correct"
    )

    def __init__(self, num_bins: int = 15) -> None:
        _check_num_bins(num_bins)
        self.num_bins = num_bins
        self._num_classes: Optional[int] = None
        super().__init__()

    def _sizes(self) -> Tuple[int, ...]:
        return (1,) * 5 + (self.num_bins,) * 3

    def reset(self) -> None:
        super().reset()
        self._num_classes = None

    def update(
        self,
        y: torch.Tensor,
        *,
        logits: Optional[torch.Tensor] = None,
        probs: Optional[torch.Tensor] = None,
    ) -> None:
        """
        Adds a batch of test points.

        :param torch.Tensor y: Labels ``(B,)``.
        :param torch.Tensor logits: Per-sample logits ``(S, B, C)``.
        :param torch.Tensor probs: Per-sample class probabilities ``(S, B, C)``.
        """
        log_probs, y = _class_log_probs(y, logits, probs)
        num_classes = log_probs.shape[-1]
        if self._num_classes is not None and num_classes != self._num_classes:
            raise ValueError(
                f"this batch has {num_classes} classes, the earlier ones "
                f"{self._num_classes}: every batch needs the same classes (reset() between "
                "evaluations of different models)"
            )
        log_p = _predictive_log_probs(log_probs)
        count, sum_conf, sum_correct = _calibration_sums(log_p, y, self.num_bins, torch.float64)
        self._add(
            num_points=_count(y.numel(), log_p),
            error=_sum64(_errors(log_p, y)),
            nll=_sum64(_class_nll(log_probs, y)),
            brier=_sum64(_brier(log_p, y)),
            entropy=_sum64(_entropy(log_p)),
            bin_count=count,
            bin_conf=sum_conf,
            bin_correct=sum_correct,
        )
        self._num_classes = num_classes

    def calibration(self) -> Calibration:
        """
        The :class:`Calibration` of the test points so far (as :func:`calibration`).
        """
        self._num_points()
        state = self._state
        return _calibration_from_sums(
            state["bin_count"].round().long(), state["bin_conf"], state["bin_correct"]
        )

    def compute(self) -> Dict[str, float]:
        """
        The metrics of the test points so far, as :func:`classification_metrics`
        gives them: ``error_rate``, ``mnll``, ``ece``, ``brier`` and ``mean_entropy``.

        :rtype: dict
        """
        n = self._num_points()
        state = self._state
        return {
            "error_rate": state["error"].item() / n,
            "mnll": state["nll"].item() / n,
            "ece": self.calibration().ece.item(),
            "brier": state["brier"].item() / n,
            "mean_entropy": state["entropy"].item() / n,
        }


class RegressionMetrics(_StreamingMetrics):
    """
    The metrics of :func:`regression_metrics` (``rmse`` and ``mnll``),
    accumulated over batches of test points; see :class:`ClassificationMetrics`.

    Usage::

        acc = RegressionMetrics()
        for batch in torch.arange(len(y_test)).split(10):
            acc.update(y_test[batch], loc=means[:, batch], scale=noise_scale)
        acc.sync()
        acc.compute()   # {"rmse": ..., "mnll": ...}
    """

    _names = ("num_points", "num_elements", "squared_error", "nll")

    def update(
        self, y: torch.Tensor, *, loc: torch.Tensor, scale: Union[float, torch.Tensor]
    ) -> None:
        """
        Adds a batch of test points.

        :param torch.Tensor y: Targets ``(B,)`` (or ``(B, ...)``).
        :param torch.Tensor loc: Per-sample means ``(S,) + y.shape``.
        :param scale: The Normal likelihood's standard deviation, a positive
            number or a tensor broadcastable to ``loc``.
        :type scale: float or torch.Tensor
        """
        scale = _regression_inputs(y, loc, scale)
        self._add(
            num_points=_count(y.shape[0], loc),
            num_elements=_count(y.numel(), loc),
            squared_error=_sum64(_squared_errors(y, loc)),
            nll=_sum64(_regression_nll(y, loc, scale)),
        )

    def compute(self) -> Dict[str, float]:
        """
        The metrics of the test points so far, as :func:`regression_metrics`
        gives them.

        :rtype: dict
        """
        n = self._num_points()
        state = self._state
        return {
            "rmse": math.sqrt(state["squared_error"].item() / state["num_elements"].item()),
            "mnll": state["nll"].item() / n,
        }


class OODAUROC:
    r"""
    The AUROC of :func:`ood_auroc`, over batches of in- and out-of-distribution
    points. The AUROC ranks all the scores, so :meth:`update` keeps them: one
    number per point (e.g. its :func:`predictive_entropy`), not its samples.
    :meth:`sync` gathers the scores of the processes of a
    :mod:`torch.distributed` group.

    Usage::

        acc = OODAUROC()
        h = predictive_entropy(logits=logits)    # first 12 points in distribution
        acc.update(scores_in=h[:12])
        acc.update(scores_out=h[12:])
        acc.sync()      # under torch.distributed: every rank, after its last batch
        acc.compute()   # ood_auroc(h[:12], h[12:])
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """
        Forgets every batch (and a previous :meth:`sync`).
        """
        self._scores: Dict[str, List[torch.Tensor]] = {"scores_in": [], "scores_out": []}
        self._synced = False

    def update(
        self, scores_in: Optional[torch.Tensor] = None, scores_out: Optional[torch.Tensor] = None
    ) -> None:
        """
        Adds the scores of a batch of in-distribution points, of
        out-of-distribution points, or both.

        :param torch.Tensor scores_in: Scores of in-distribution points ``(B_in,)``.
        :param torch.Tensor scores_out: Scores of out-of-distribution points ``(B_out,)``.
        """
        _check_not_synced(self, "update() after sync()")
        batch = {"scores_in": scores_in, "scores_out": scores_out}
        given = {name: scores for name, scores in batch.items() if scores is not None}
        if not given:
            raise ValueError("pass scores_in=, scores_out= or both (shape (B,))")
        for name, scores in given.items():
            _check_scores(name, scores, allow_empty=True)
        for name, scores in given.items():
            self._scores[name].append(scores.detach())

    def _cat(self, name: str) -> torch.Tensor:
        parts = self._scores[name]
        if not parts:
            return torch.zeros(0, dtype=torch.float64)
        dtype = parts[0].dtype
        for part in parts[1:]:
            dtype = torch.promote_types(dtype, part.dtype)
        device = parts[0].device
        return torch.cat([part.to(dtype=dtype, device=device) for part in parts])

    def sync(self, process_group: Optional[Any] = None) -> None:
        """
        Gathers the scores of every process of ``process_group`` (a collective
        call, as :meth:`ClassificationMetrics.sync`); a no-op where
        :mod:`torch.distributed` is not initialized.

        :param process_group: The process group to gather over (default: the
            whole world).
        """
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return
        _check_not_synced(self, "sync() was already called")
        world_size = dist.get_world_size(process_group)
        device = torch.device("cpu")
        if dist.get_backend(process_group) == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        for name in self._scores:
            # float64 holds every float32 and integer score exactly
            local = self._cat(name).to(device=device, dtype=torch.float64)
            size = torch.tensor([local.numel()], device=device)
            sizes = [torch.zeros_like(size) for _ in range(world_size)]
            dist.all_gather(sizes, size, group=process_group)
            longest = int(max(int(n) for n in sizes))
            padded = torch.cat([local, local.new_zeros(longest - local.numel())])
            gathered = [torch.zeros_like(padded) for _ in range(world_size)]
            dist.all_gather(gathered, padded, group=process_group)
            self._scores[name] = [
                part[: int(n)] for part, n in zip(gathered, sizes) if int(n)
            ]
        self._synced = True

    def compute(self) -> float:
        """
        The AUROC of the scores so far (see :func:`ood_auroc`).

        :rtype: float
        """
        scores_in, scores_out = self._cat("scores_in"), self._cat("scores_out")
        if not (scores_in.numel() and scores_out.numel()):
            raise ValueError(
                f"OODAUROC.compute() needs in- and out-of-distribution scores, got "
                f"{scores_in.numel()} and {scores_out.numel()}: call update() with each first"
            )
        return ood_auroc(scores_in, scores_out).item()
