"""
The parts of :func:`~pyro_vinit.training.fit`'s loop: minibatches, the
generator's state, validation metrics and checkpoints (the checks that run
the model are in ``_checks``).
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
    Mapping,
    Optional,
    Sequence,
    Sized,
    Tuple,
    Union,
    cast,
)

import pyro
import pyro.distributions as dist
import pyro.poutine as poutine
import torch
from pyro.infer.autoguide import AutoDelta, AutoGuide, AutoGuideList
from pyro.optim import PyroOptim
from torch import nn

from pyro_vinit._pyro_compat import is_deterministic_site, likelihood_sites
from pyro_vinit.guides.site_params import is_supported
from pyro_vinit.initialization._data import all_finite, check_like_first, describe
from pyro_vinit.initialization._rollback import generators_kept, rng_state, set_rng_state
from pyro_vinit.poutine.layer_call_messenger import base_distribution
from pyro_vinit.training.averaging import ParamAverage
from pyro_vinit.training.config import FitHistory

__all__: List[str] = []

Batch = Tuple[torch.Tensor, torch.Tensor]
Data = Union[Batch, Iterable[Batch]]

_CHECKPOINT_FORMAT = "pyro_vinit.fit/1"


@contextlib.contextmanager
def module_modes(modules: Iterable[Any], train: bool,
                 keep: Callable[[nn.Module], bool] = lambda module: False) -> Iterator[None]:
    """Runs the block with each ``nn.Module`` of ``modules`` in train (or eval)
    mode but the submodules ``keep`` holds for, which keep their own mode (e.g.
    a frozen BatchNorm), and every submodule's mode restored afterwards."""
    roots = [m for m in modules if isinstance(m, nn.Module)]
    modes = [(sub, sub.training) for m in roots for sub in m.modules()]
    try:
        for m in roots:
            m.train(train)
        for sub, mode in modes:
            if keep(sub):
                sub.training = mode
        yield
    finally:
        for sub, mode in modes:
            sub.training = mode


def _train_mode(model: Any) -> ContextManager[None]:
    """Runs the block with a model that is in eval mode (e.g. set for predicting
    before a second fit call) in train mode (:func:`module_modes`); a model in
    train mode is left as it is (a submodule's own mode, e.g. a frozen
    BatchNorm's, kept)."""
    if not isinstance(model, nn.Module) or model.training:
        return contextlib.nullcontext()
    return module_modes([model], train=True)


def _mean_field_list(guide: Callable[..., Any]) -> bool:
    """Whether ``guide`` is an ``AutoGuideList`` whose members each draw their
    sites independently (an ``AutoDelta`` or a guide I-BLM supports), so that
    the whole guide is mean-field in whatever order its sites come."""
    return isinstance(guide, AutoGuideList) and all(
        isinstance(member, AutoDelta) or is_supported(member) for member in guide)


# ---- the data -------------------------------------------------------------------------


def _is_pair(data: Any) -> bool:
    return (isinstance(data, (tuple, list)) and len(data) == 2
            and all(isinstance(t, torch.Tensor) for t in data))


def _not_a_pair(batch: Any) -> str:
    """What ``batch``, which is no pair of tensors, is, and the way to one."""
    if not isinstance(batch, (tuple, list)):
        return type(batch).__name__ + (
            ": convert it with torch.as_tensor" if hasattr(batch, "__array__") else "")
    kinds = ", ".join(type(t).__name__ for t in batch[:4]) + (", ..." if len(batch) > 4 else "")
    text = f"a {type(batch).__name__} of {len(batch)} ({kinds})"
    if any(hasattr(t, "__array__") and not isinstance(t, torch.Tensor) for t in batch):
        return text + ": convert arrays with torch.as_tensor"
    if batch and all(isinstance(t, torch.Tensor) for t in batch):
        return text + (": fit calls model(x, y), with two tensors; a model of more inputs "
                       "takes them as one tensor x, or from its own attributes")
    return text


def _check_batch(batch: Any, what: str) -> Batch:
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2
            and all(isinstance(t, torch.Tensor) for t in batch)):
        raise TypeError(f"fit: {what} must be a pair (x, y) of tensors, got {_not_a_pair(batch)}")
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


def describe_batch(batch: Batch) -> str:
    """``x (rows, ...) dtype, y (rows, ...) dtype``, for messages."""
    return describe(batch, ("x", "y"))


class _Batches:
    """An endless stream of minibatches: shuffled epochs of an (x, y) pair, or the
    batches of a re-iterable loader, pass after pass."""

    def __init__(self, data: Data, batch_size: int) -> None:
        self.pair: Optional[Batch] = None
        self.loader: Optional[Iterable[Batch]] = None
        self.batch_size = batch_size
        #: the rows of the data set of a DataLoader with drop_last=True, which the model
        #: may count as its data (num_data) beside the rows of one pass
        self.dataset_rows: Optional[int] = None
        if isinstance(data, (tuple, list)) and data and all(
                hasattr(t, "__array__") for t in data):  # tensors or arrays: one pair, or none
            self.pair = _check_batch(data, "data")
            self.num_data = self.pair[0].shape[0]
            #: Whether an epoch's last batch, of one row, joins the batch before it
            #: (BatchNorm cannot train on one row).
            self.fold = (self.num_data > batch_size > 1
                         and self.num_data % batch_size == 1)
            # (the first batch's rows: all of them where the one batch takes the last row)
            rows = self.num_data if self.fold and self.num_data // batch_size == 1 else batch_size
            self.first = (self.pair[0][:rows], self.pair[1][:rows])
            #: The first batch that has a single row, if any.
            self.one_row: Optional[int] = 0 if min(batch_size, self.num_data) == 1 else None
            self.batches_per_epoch = math.ceil(self.num_data / batch_size) - self.fold
            #: An epoch's batches of the first batch's shapes (the others, an epoch's
            #: partial last batch, take fit's eager step).
            self.full_batches = max(1, self.num_data // batch_size - self.fold)
        else:
            if (isinstance(data, (torch.Tensor, Mapping)) or hasattr(data, "__array__")
                    or not isinstance(data, Iterable)):
                keys = (f" with keys {list(data)[:4]}: pass the pair, e.g. "
                        "(data['x'], data['y'])" if isinstance(data, Mapping) else "")
                raise TypeError(
                    "fit: data must be an (x, y) pair of tensors or an iterable of (x, y) "
                    f"batches (e.g. a DataLoader), got {type(data).__name__}{keys}"
                )
            self.loader = cast(Iterable[Batch], data)
            self.fold = False
            self.one_row = None
            count, first, batches, same = 0, None, 0, 0
            # (a read that draws nothing: a shuffling loader's generators, its own, its
            # sampler's or the global one, are where they were, whether fit goes on or
            # fails; a DataLoader's iterator draws its seed)
            with generators_kept(data):
                if iter(data) is data:
                    raise TypeError(
                        "fit: data is an iterator, which can be read only once; pass a "
                        "re-iterable such as a DataLoader or a list of batches"
                    )
                for i, batch in enumerate(self.loader):
                    xb, yb = _check_batch(batch, f"batch {i} of data")
                    first = (xb, yb) if first is None else first
                    check_like_first(i, (xb, yb), first, ("x", "y"), "fit: ")
                    if xb.shape[0] == 1 and self.one_row is None:
                        self.one_row = i
                    same += (xb.shape, yb.shape) == (first[0].shape, first[1].shape)
                    count += xb.shape[0]
                    batches += 1
            if first is None:
                raise ValueError("fit: data (the loader) yields no batches")
            self.first, self.num_data, self.batches_per_epoch = first, count, batches
            self.full_batches = same
            # a DataLoader that drops its last partial batch reads every row of its data set
            # over the epochs when it shuffles: a model may count those rows as its data
            dataset = getattr(data, "dataset", None)
            if getattr(data, "drop_last", False) and hasattr(dataset, "__len__"):
                self.dataset_rows = len(cast(Sized, dataset))
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
            end = self.position + self.batch_size
            if self.fold and end == self.num_data - 1:
                end += 1  # the epoch's last row joins this batch
            idx = self.order[self.position:end].to(x.device)
            self.position = end
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
                "position": self.position, "batch_size": self.batch_size}

    def set_state(self, state: Dict[str, Any]) -> None:
        saved = state.get("batch_size")  # (absent from the checkpoints of older versions)
        if self.pair is not None and saved is not None and saved != self.batch_size:
            warnings.warn(
                f"fit: the checkpoint was written with batch_size={saved}; this call's "
                f"batch_size={self.batch_size} trains on from it, but not as the "
                "uninterrupted run would", UserWarning, stacklevel=3)
        self.generator.set_state(state["generator"])
        self.order, self.position = state["order"], state["position"]


# ---- distributions, the generator's state ------------------------------------------------


def _likelihoods(trace: poutine.Trace, model: Callable[..., Any]) -> List[Any]:
    """The observed sample sites of a trace of ``model``, less ``pyro.deterministic``'s
    records (observed ``Delta`` sites) and, where the model observes sites of its own
    (``obs=``), the sites ``pyro.condition`` fixes (a hyperparameter held at a value)."""
    return likelihood_sites([site for site in trace.nodes.values() if site["type"] == "sample"
                             and site["is_observed"] and not is_deterministic_site(site)],
                            model)


def _set_up(guide: Callable[..., Any], batch: Batch) -> None:
    """Sets an autoguide up (its parameters take the param store's values where it
    has them), leaving the RNG as it was."""
    if isinstance(guide, AutoGuide) and guide.prototype_trace is None:
        rng = rng_state()
        with torch.no_grad():
            poutine.block(guide)(*batch)
        set_rng_state(rng)


# ---- evaluation ----------------------------------------------------------------------


@torch.no_grad()
def _evaluate(model: Callable[..., Any], guide: Callable[..., Any], x: torch.Tensor,
              y: torch.Tensor, num_samples: int, chunk: int) -> Dict[str, float]:
    """Monte Carlo predictive MNLL (and error rate or RMSE) of ``num_samples`` guide
    draws, the model in eval mode, on chunks of at most ``chunk`` rows (a model built
    with ``num_data`` takes no larger batch)."""
    # (each submodule's own mode restored: a frozen BatchNorm in a model in train mode)
    with module_modes((model, guide), train=False):
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
                    base = base_distribution(observed[0]["fn"])
                    if isinstance(base, (dist.Categorical, dist.OneHotCategorical)):
                        kind = "error_rate" if isinstance(base, dist.Categorical) else "onehot"
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
        if kind in ("error_rate", "onehot"):
            pred = torch.stack(means).mean(0).argmax(-1)
            labels = y.argmax(-1) if kind == "onehot" else y
            result["error_rate"] = float((pred != labels).float().mean())
        elif kind == "bernoulli":  # a label wrong where its probability is across 0.5
            wrong = (torch.stack(means).mean(0) > 0.5) != (y.reshape(means[0].shape) > 0.5)
            result["error_rate"] = float(wrong.float().mean())
        elif kind == "rmse":
            mean = torch.stack(means).mean(0)
            result[kind] = float((mean - y.reshape(mean.shape)).pow(2).mean().sqrt())
        return result


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
        "rng": rng_state(),
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


def _check_checkpoint_path(path: str) -> None:
    """A checkpoint path that can be written: not a folder, in a folder that exists
    (checked before training, not at the first save)."""
    if os.path.isdir(path):
        raise ValueError(f"fit: the checkpoint {path!r} is a folder; pass a file path in it")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError(f"fit: the checkpoint's folder {folder!r} does not exist; create it "
                         "first (os.makedirs) or pass another path")


def _load(path: str) -> Dict[str, Any]:
    # our own file, with the param store's constraints pickled: not weights only
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # not a file torch wrote (e.g. text, a truncated file)
        raise ValueError(f"fit: {path!r} is not a checkpoint written by pyro_vinit.fit "
                         f"({type(e).__name__}: {e})") from e
    if not isinstance(state, dict) or state.get("format") != _CHECKPOINT_FORMAT:
        raise ValueError(f"fit: {path!r} is not a checkpoint written by pyro_vinit.fit")
    return cast(Dict[str, Any], state)


#: How much higher than at step 0 or at its best the last validation MNLL may be before
#: fit warns: by this share of its size (an MNLL can be negative), and at least by
#: _WORSE_NATS.
_WORSE_BY = 0.1
_WORSE_NATS = 0.05


def warn_if_worse(validation: List[Dict[str, float]], kl_weight: float,
                  dropout: Sequence[str] = ()) -> None:
    """Warns where the run ended with a validation MNLL well above its start's
    (the initializer's, or the first call's) or its best evaluation's: training
    made the model worse; ``dropout`` names the model's dropout modules, on in
    training and off in the initializer's fit."""
    finite = [v for v in validation if math.isfinite(v["mnll"])]
    if len(validation) < 2 or not finite:
        return
    best, last = min(finite, key=lambda v: v["mnll"]), validation[-1]["mnll"]
    if math.isfinite(last) and last - best["mnll"] <= max(_WORSE_BY * abs(best["mnll"]),
                                                          _WORSE_NATS):
        return
    remedy = (f"the tempered objective (kl_weight={kl_weight:g}) can overfit a small, noisy "
              "data set: try a larger kl_weight (1 is the full ELBO) or fewer steps"
              if kl_weight < 1 else "try fewer steps")
    if dropout:
        remedy += (f"; the model's dropout ({', '.join(dropout)}) is on in training and was "
                   "off in the initializer's fit, whose start it can undo: train without it")
    end, start = int(validation[-1]["step"]), validation[0]["mnll"]
    if validation[0]["step"] == 0 and not (math.isfinite(last) and last - start <= max(
            _WORSE_BY * abs(start), _WORSE_NATS)):
        said = (f"rose from {start:.4g} at step 0 to {last:.4g} at step {end}: "
                "training made the model worse than its start")
    else:
        said = (f"rose from its best, {best['mnll']:.4g} at step {int(best['step'])}, to "
                f"{last:.4g} at step {end}: training past step {int(best['step'])} made the "
                "model worse (e.g. overconfident)")
    warnings.warn(f"fit: the validation MNLL {said}; " + remedy, UserWarning, stacklevel=3)
