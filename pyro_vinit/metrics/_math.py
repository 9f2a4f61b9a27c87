"""Input checks and the formulas shared by the metric functions and the accumulators."""

import math
from typing import Optional, Tuple, Union, cast, overload

import torch

from pyro_vinit._warn import warn_at_caller

# rounded to a few decimals).
_PROBS_ATOL = 1e-3


def _check_samples(
    name: str, samples: torch.Tensor, y: Optional[torch.Tensor], extra_dims: int
) -> None:
    if not isinstance(samples, torch.Tensor) or not isinstance(y, (torch.Tensor, type(None))):
        arrays = any(hasattr(v, "__array__") and not isinstance(v, torch.Tensor)
                     for v in (samples, y))
        raise TypeError(
            (f"expected tensors for {name} and y, got {type(samples).__name__} and "
             f"{type(y).__name__}" if y is not None else
             f"expected a tensor for {name}, got {type(samples).__name__}")
            + ("; convert arrays with torch.as_tensor" if arrays else "")
        )
    expected = samples.shape[1 : samples.dim() - extra_dims]
    if samples.dim() < 1 + extra_dims + 1 or (y is not None and expected != y.shape):
        what = "(S,) + y.shape + (C,)" if extra_dims else "(S,) + y.shape"
        got = "" if y is None else f" and y.shape = {tuple(y.shape)}"
        labels = (extra_dims and y is not None and y.dim() == 2 and y.shape[-1] == 1
                  and y.shape[:1] == expected)
        raise ValueError(
            f"{name} must have shape {what} with the posterior samples on the left, "
            f"got {name}.shape = {tuple(samples.shape)}{got}; "
            + ("for labels of shape (N, 1) pass y.squeeze(-1)" if labels else
               "for a single prediction use .unsqueeze(0), "
               + ("for a binary classifier's one logit a row use .unsqueeze(-1) (S, N, 1)"
                  if extra_dims else "for a (N, 1) network output use .squeeze(-1)"))
        )


def _check_not_nan(name: str, value: torch.Tensor) -> None:
    # A NaN would otherwise come out as NaN from some metrics and as a plausible
    # number from others (argmax, binning, 0 * log 0 guards), so it is refused.
    if value.is_floating_point():
        nan = value.isnan()
        if nan.any():
            first = tuple(int(i) for i in nan.nonzero()[0])
            raise ValueError(
                f"{name} contains NaN ({int(nan.sum())} of {value.numel()} values, the first "
                f"at index {first}); a metric of it would be meaningless: check the model and "
                "the guide for divergence (e.g. a smaller learning rate), or drop those points"
            )


def _looks_one_hot(y: torch.Tensor) -> bool:
    return bool(((y == 0) | (y == 1)).all() and (y.sum(-1) == 1).all())


def _labels(y: torch.Tensor, samples: torch.Tensor, name: str) -> torch.Tensor:
    # Class indices (N,) as long, or a clear error; checked before the shape so
    # that one-hot labels get their own message.
    num_classes = samples.shape[-1]
    if not isinstance(y, torch.Tensor):
        raise TypeError(f"expected a tensor of labels y, got {type(y).__name__}")
    if y.dim() >= 1 and y.shape == samples.shape[1:] and samples.dim() == 3:
        kind = "one-hot labels" if _looks_one_hot(y) else "a class dimension"
        raise ValueError(
            f"y has shape {tuple(y.shape)} = {name}.shape[1:], as {kind} would: the metrics "
            f"take class indices of shape (N,) in [0, {num_classes}); pass y.argmax(-1)"
        )
    if y.is_complex() or y.dtype == torch.bool:
        raise ValueError(
            f"classification targets y must be integer class indices, got dtype {y.dtype}; "
            "pass y.long()"
        )
    if y.is_floating_point():
        _check_not_nan("y", y)
        if not bool((y == y.round()).all()):
            raise ValueError(
                "classification targets y must be integer class indices, got floats that are "
                f"not whole numbers (dtype {y.dtype}); pass the class indices, e.g. "
                "probs.argmax(-1) for probability targets"
            )
    # every integer dtype (int32 from numpy, uint8 from image files, ...) becomes
    # long, the index type that gather and one_hot need
    return y.long()


def _two_classes(
    logits: Optional[torch.Tensor], probs: Optional[torch.Tensor], y: Optional[torch.Tensor]
) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor], Optional[torch.Tensor]]:
    # A binary classifier's logits or probabilities of class 1 (Bernoulli), one a row:
    # (S, N, 1), or (S, N) with labels y of shape (N,), as the two classes' (S, N, 2);
    # labels of shape (N, 1) beside (S, N, 1) as (N,).
    samples = logits if logits is not None else probs
    if not isinstance(samples, torch.Tensor) or not samples.is_floating_point():
        return logits, probs, y
    if not ((samples.dim() == 3 and samples.shape[-1] == 1)
            or (samples.dim() == 2 and isinstance(y, torch.Tensor) and y.dim() == 1
                and samples.shape[1:] == y.shape)):
        return logits, probs, y
    if isinstance(y, torch.Tensor) and samples.dim() == 3 and y.shape == samples.shape[1:]:
        y = y.squeeze(-1)
    name = "logits" if logits is not None else "probs"
    if (samples.dim() == 2 and isinstance(y, torch.Tensor) and not y.is_floating_point()
            and y.numel() and bool((y.min() < 0) | (y.max() > 1))):
        raise ValueError(
            f"{name} of shape {tuple(samples.shape)} beside {y.shape[0]} labels are read "
            f"as the binary {name} of class 1, one a sample and row, whose labels lie in [0, 2), "
            f"but y holds {int(y.min())} to {int(y.max())}: for one network's (N, C) "
            f"{name}, pass {name}.unsqueeze(0)")
    one = samples.reshape(samples.shape[:2])
    if logits is not None:
        if one.numel() > 1 and bool(((one >= 0) & (one <= 1)).all()):
            warn_at_caller(
                "every binary logit lies in [0, 1], as probabilities of class 1 do: if they "
                "are (e.g. torch.sigmoid's), pass them as probs=", UserWarning)
        return torch.stack([torch.zeros_like(one), one], -1), None, y
    return None, torch.stack([1 - one, one], -1), y


@overload
def _class_log_probs(
    y: torch.Tensor, logits: Optional[torch.Tensor], probs: Optional[torch.Tensor]
) -> Tuple[torch.Tensor, torch.Tensor]: ...


@overload
def _class_log_probs(
    y: None, logits: Optional[torch.Tensor], probs: Optional[torch.Tensor]
) -> Tuple[torch.Tensor, None]: ...


def _class_log_probs(
    y: Optional[torch.Tensor], logits: Optional[torch.Tensor], probs: Optional[torch.Tensor]
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    # Per-sample log class probabilities (S, N, C) and the labels as long.
    if logits is not None and probs is None:
        samples, name = logits, "logits"
    elif probs is not None and logits is None:
        samples, name = probs, "probs"
    else:
        raise ValueError("pass exactly one of logits= or probs= (shape (S, N, C))")
    if isinstance(samples, torch.Tensor) and not samples.is_floating_point():
        raise ValueError(
            f"{name} must be floating point of shape (S, N, C), got dtype {samples.dtype} and "
            f"shape {tuple(samples.shape)}; sampled labels (Predictive's observed site) are "
            "not class probabilities: return the logits (return_sites=['_RETURN'] for "
            "BayesianClassifier), or pass probs=F.one_hot(labels, C).float() for the cruder "
            "estimate from labels"
        )
    logits, probs, y = _two_classes(logits, probs, y)
    samples = logits if logits is not None else cast(torch.Tensor, probs)
    if y is not None and isinstance(samples, torch.Tensor):
        y = _labels(y, samples, name)
    _check_samples(name, samples, y, extra_dims=1)
    if samples.dim() != 3:
        raise ValueError(f"{name} must have shape (S, N, C), got {tuple(samples.shape)}")
    _check_not_nan(name, samples)
    if y is not None:
        num_classes = samples.shape[-1]
        if y.numel() and (y.min() < 0 or y.max() >= num_classes):
            raise ValueError(
                f"labels y must lie in [0, {num_classes}), "
                f"got min {int(y.min())} and max {int(y.max())}"
            )
    if logits is not None:
        if (logits == math.inf).any():
            raise ValueError(
                "logits contain +inf, which has no softmax; -inf (probability 0) is allowed"
            )
        if (logits == -math.inf).all(-1).any():
            raise ValueError("a row of logits is -inf for every class: no class has mass")
        if (
            logits.numel()
            and logits.shape[-1] > 1
            and (logits >= 0).all()
            and ((logits.sum(-1) - 1).abs() <= _PROBS_ATOL).all()
        ):
            # Softmax of probabilities is a flattened, wrong distribution; genuine
            # logits with every row on the simplex are all but impossible.
            raise ValueError(
                "logits look like probabilities (every row is non-negative and sums to 1): "
                "pass them as probs= instead; if they really are logits, add a constant "
                "(the softmax does not change)"
            )
        return torch.log_softmax(logits, dim=-1), y
    if (samples < 0).any() or not torch.allclose(samples.sum(-1), samples.new_ones(())):
        raise ValueError(
            "probs must be non-negative and sum to 1 over the last dimension; "
            "pass logits or log-probabilities as logits="
        )
    return samples.log(), y


@overload
def _regression_inputs(
    y: Optional[torch.Tensor], loc: torch.Tensor, scale: Union[float, torch.Tensor]
) -> torch.Tensor: ...


@overload
def _regression_inputs(y: Optional[torch.Tensor], loc: torch.Tensor, scale: None) -> None: ...


def _regression_inputs(
    y: Optional[torch.Tensor], loc: torch.Tensor, scale: Union[float, torch.Tensor, None]
) -> Optional[torch.Tensor]:
    # Checks the per-sample means (and targets); returns scale as a tensor.
    _check_samples("loc", loc, y, extra_dims=0)
    _check_not_nan("loc", loc)
    if y is not None:
        _check_not_nan("y", y)
    if scale is None:
        return None
    scale = torch.as_tensor(scale, dtype=loc.dtype, device=loc.device)
    if not (scale > 0).all():
        # NaN fails the comparison too
        raise ValueError(f"scale must be positive (and not NaN), got min {scale.min().item()}")
    if (scale.dim() == 1 and loc.dim() > 1 and scale.shape[0] > 1
            and scale.shape[0] == loc.shape[0] == loc.shape[-1]):
        # A per-sample (S,) scale (e.g. Predictive's samples of a learned noise site) would
        # broadcast along the points (or the last event dim) when their number equals S,
        # e.g. in a streaming evaluation whose batch size is the number of samples.
        per_sample = "scale[:, None]" if loc.dim() == 2 else (
            f"scale.reshape(-1{', 1' * (loc.dim() - 1)})")
        many, one = ("points", "point") if loc.dim() == 2 else (
            "elements in loc's last dim", "element of that dim")
        raise ValueError(
            f"scale of shape {tuple(scale.shape)} is ambiguous for loc.shape = "
            f"{tuple(loc.shape)}: as many samples as {many}; pass {per_sample} for one "
            f"scale per sample, or scale[None] for one per {one}"
        )
    try:
        # torch.broadcast_shapes is unannotated.
        shape = torch.broadcast_shapes(scale.shape, loc.shape)  # type: ignore[no-untyped-call]
    except RuntimeError:
        shape = None
    if shape != loc.shape:
        hint = (f"; for a per-sample scale of shape (S,) = {tuple(scale.shape)}: pass "
                "scale[:, None]" if scale.dim() == 1 and loc.dim() > 1
                and scale.shape[0] == loc.shape[0] else "")
        raise ValueError(
            f"scale of shape {tuple(scale.shape)} must broadcast to loc.shape = "
            f"{tuple(loc.shape)} (a number, a per-point (N,) tensor, or per sample (S, N))"
            + hint
        )
    return scale


def _predictive_log_probs(log_probs: torch.Tensor) -> torch.Tensor:
    # log of the Monte Carlo mixture (N, C): logsumexp over samples minus log S
    return torch.logsumexp(log_probs, dim=0) - math.log(log_probs.shape[0])


def _entropy(log_p: torch.Tensor) -> torch.Tensor:
    # over the last dimension; xlogy-style: a class of zero probability adds 0, not nan
    return -torch.where(log_p > -math.inf, log_p.exp() * log_p, log_p.new_zeros(())).sum(-1)


# The math of each metric, once: per-point values (or per-bin sums) that the
# functions below average over one tensor of test points and the streaming
# accumulators sum over batches.


def _class_nll(log_probs: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    # (N,): -log of the mixture probability of the label, from (S, N, C)
    log_p = log_probs.gather(-1, y.expand(log_probs.shape[:-1]).unsqueeze(-1)).squeeze(-1)
    return -_predictive_log_probs(log_p)


def _regression_nll(y: torch.Tensor, loc: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    # (N,): -log of the Normal mixture density; trailing dimensions of y are one event
    log_p = torch.distributions.Normal(loc, scale).log_prob(y)
    log_p = log_p.reshape(log_p.shape[:2] + (-1,)).sum(-1)  # (S, N)
    return -_predictive_log_probs(log_p)


def _squared_errors(y: torch.Tensor, loc: torch.Tensor) -> torch.Tensor:
    # y.shape: squared error of the predictive mean, element-wise
    return (loc.mean(0) - y).pow(2)


def _errors(log_p: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    # (N,): 1 where the most probable class of the mixture (N, C) is not the label
    return (log_p.argmax(-1) != y).to(log_p.dtype)


def _brier(log_p: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    # (N,): squared distance of the mixture probabilities to the one-hot label
    p = log_p.exp()
    one_hot = torch.nn.functional.one_hot(y, p.shape[-1]).to(p.dtype)
    return (p - one_hot).pow(2).sum(-1)


def _check_num_bins(num_bins: int) -> None:
    if isinstance(num_bins, bool) or not isinstance(num_bins, int) or num_bins < 1:
        raise ValueError(f"num_bins must be a positive integer, got {num_bins!r}")


def _calibration_sums(
    log_p: torch.Tensor, y: torch.Tensor, num_bins: int, dtype: Optional[torch.dtype] = None
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # Per confidence bin: the number of points (long), the sum of their
    # confidences and the number of correct predictions (summed in dtype,
    # log_p's by default).
    log_conf, pred = log_p.max(-1)
    conf = log_conf.exp()
    correct = (pred == y).to(conf.dtype)
    edges = _bin_edges(num_bins, conf.dtype, conf.device)
    # right=False: bin b holds (edges[b], edges[b + 1]]
    index = torch.bucketize(conf, edges[1:-1]).clamp(max=num_bins - 1)
    count = torch.bincount(index, minlength=num_bins)
    dtype = dtype or conf.dtype
    sum_conf = conf.new_zeros(num_bins, dtype=dtype).index_add_(0, index, conf.to(dtype))
    sum_correct = conf.new_zeros(num_bins, dtype=dtype).index_add_(0, index, correct.to(dtype))
    return count, sum_conf, sum_correct


def _bin_edges(num_bins: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.linspace(0, 1, num_bins + 1, dtype=dtype, device=device)



