"""
:class:`GroupedAdam`: a Pyro optimizer that steps all the parameters of a call
with one fused ``torch.optim.Adam``.
"""

from typing import Any, Dict, FrozenSet, Iterable, List, Optional

import pyro
import torch
from pyro.optim import PyroOptim
from torch.nn.utils import clip_grad_norm_, clip_grad_value_

__all__ = ["GroupedAdam"]

_ADAM_ARGS = frozenset({"lr", "betas", "eps", "weight_decay", "amsgrad", "maximize"})
_CLIP_ARGS = frozenset({"clip_norm", "clip_value"})


def _check_args(what: str, args: Any, allowed: FrozenSet[str]) -> Dict[str, Any]:
    if not isinstance(args, dict):
        raise TypeError(
            f"GroupedAdam: {what} must be a dict of settings (e.g. {{'lr': 1e-3}}), got "
            f"{type(args).__name__}; for per-parameter settings use pyro.optim.Adam"
        )
    unknown = sorted(set(args) - allowed)
    if unknown:
        raise ValueError(f"GroupedAdam: unknown {what} {unknown}; known: {sorted(allowed)}")
    return dict(args)


class GroupedAdam(PyroOptim):
    r"""
    Adam [1] as a Pyro optimizer whose step updates all the parameters of a
    call together, with one ``torch.optim.Adam`` (its fused kernel on CPU and
    CUDA, its ``foreach`` one elsewhere), where ``pyro.optim.Adam`` keeps one
    optimizer per parameter and steps them one after the other. The update
    is Adam's,

    .. math::

        m_t = \beta_1 m_{t-1} + (1 - \beta_1) g_t, \quad
        v_t = \beta_2 v_{t-1} + (1 - \beta_2) g_t^2, \quad
        \theta_t = \theta_{t-1} - \eta \frac{m_t / (1 - \beta_1^t)}
        {\sqrt{v_t / (1 - \beta_2^t)} + \epsilon},

    for each parameter with its own step count :math:`t`: the values of
    ``pyro.optim.Adam`` up to rounding. With ``warmup_steps`` :math:`W > 0`
    each parameter's learning rate rises linearly over its first :math:`W`
    steps, :math:`\eta_t = \eta \min(1, t / W)` at its own step :math:`t`:
    Adam's first steps move every parameter by about :math:`\eta` whatever
    its gradient's size, which can throw a well-initialized network (e.g.
    by I-BLM) far from its start.

    Usage::

        svi = SVI(model, guide, GroupedAdam({"lr": 1e-3}), TraceMeanField_ELBO())
        svi.step(x, y)

    A call steps only the parameters it is given (those of one SVI step);
    parameters seen first in a later call join the optimizer with fresh
    moments and step count (their warm-up starts then). :meth:`get_state`
    gives each parameter's state under its param store name in the format
    of ``pyro.optim.Adam``'s, and :meth:`set_state` takes either's: the
    moments and step counts carry over, the hyperparameters are this
    optimizer's.

    :param dict optim_args: ``torch.optim.Adam``'s settings: ``lr``,
        ``betas``, ``eps``, ``weight_decay``, ``amsgrad``, ``maximize``.
    :param dict clip_args: ``clip_norm`` and/or ``clip_value``, applied to
        each parameter's gradient separately, as ``pyro.optim.Adam`` does.
    :param int warmup_steps: Steps of each parameter's linear learning-rate
        warm-up (0: none). A parameter's step count is restored with its
        state (:meth:`set_state`).

    [1] Kingma, D. P., Ba, J. (2015) "Adam: A Method for Stochastic Optimization"
    """

    def __init__(self, optim_args: Dict[str, Any],
                 clip_args: Optional[Dict[str, Any]] = None, *, warmup_steps: int = 0) -> None:
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) \
                or warmup_steps < 0:
            raise ValueError(f"GroupedAdam: warmup_steps must be an int >= 0, got "
                             f"{warmup_steps!r}")
        args = _check_args("optim_args", optim_args, _ADAM_ARGS)
        clip = _check_args("clip_args", clip_args if clip_args is not None else {}, _CLIP_ARGS)
        for name, value in clip.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"GroupedAdam: clip_args {name!r} must be a positive number, "
                                 f"got {value!r}")
        try:  # torch's own checks of the settings, now rather than at the first step
            probe = torch.optim.Adam([torch.zeros(1, requires_grad=True)], **args)
        except (TypeError, ValueError) as error:
            raise ValueError(f"GroupedAdam: bad optim_args {args!r}: {error}") from error
        super().__init__(torch.optim.Adam, args, clip)
        self._args = args
        self._clip = clip
        self._optim: Optional[torch.optim.Adam] = None
        self._known: Dict[torch.Tensor, None] = {}  # the parameters seen, in order
        self.warmup_steps = warmup_steps
        self._lr = probe.defaults["lr"]
        # each parameter's steps taken (or restored), for its warm-up: counted here, on the
        # host, as Adam's own step tensors may live on the device (reading one would sync)
        self._steps: Dict[torch.Tensor, int] = {}

    def __call__(self, params: Iterable[torch.Tensor], *args: Any, **kwargs: Any) -> None:
        """
        Takes one Adam step of each of ``params`` that has a gradient.

        :param params: The parameters (e.g. those of one SVI step).
        """
        called = [p for p in params if p.grad is not None]
        if not called:
            return
        new = [p for p in called if p not in self._known]
        if new:
            self._add(new)
        assert self._optim is not None
        if self._clip:
            for p in called:
                if "clip_norm" in self._clip:
                    clip_grad_norm_(p, self._clip["clip_norm"])
                if "clip_value" in self._clip:
                    clip_grad_value_(p, self._clip["clip_value"])
        group = self._optim.param_groups[0]
        steps = self._steps
        for p in called:
            steps[p] = steps.get(p, 0) + 1
        everything = group["params"]
        group["params"] = called  # only this call's parameters take a step
        warmup = self.warmup_steps
        if warmup and any(steps[p] < warmup for p in called):
            # each at its own rate: one group per rate, for this step
            by_rate: Dict[float, List[torch.Tensor]] = {}
            for p in called:
                by_rate.setdefault(self._lr * min(1.0, steps[p] / warmup), []).append(p)
            self._optim.param_groups = [{**group, "params": ps, "lr": lr}
                                        for lr, ps in by_rate.items()]
        try:
            self._optim.step(*args, **kwargs)
        finally:
            group["params"] = everything
            self._optim.param_groups = [group]

    def _add(self, new: List[torch.Tensor]) -> None:
        for p in new:
            self._known[p] = None
        old = self._optim
        params = list(self._known)
        # torch's fused kernel where it has one for every parameter, else its foreach one
        fused = all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in params)
        kernel: Dict[str, Any] = {"fused": True} if fused else {"foreach": True}
        self._optim = torch.optim.Adam(params, **kernel, **self._args)
        if old is not None:
            for p, state in old.state.items():
                self._optim.state[p] = {k: self._cast(k, v, p) for k, v in state.items()}
        store = pyro.get_param_store()
        for p in new:
            saved = self._state_waiting_to_be_consumed.pop(self._name(store, p), None)
            if saved is not None:
                self._load(p, saved)

    @staticmethod
    def _name(store: Any, p: torch.Tensor) -> Optional[str]:
        name = store.param_name(p)  # None: not in the param store (e.g. a module-local one)
        return None if name is None else str(name)

    def _load(self, p: torch.Tensor, saved: Dict[str, Any]) -> None:
        # saved: one parameter's torch.optim.Adam state_dict (pyro.optim.Adam's format)
        if "optimizer" in saved:  # an optimizer wrapped in a scheduler
            saved = saved["optimizer"]
        states = saved.get("state", {})
        if not states:
            return
        (state,) = states.values()
        assert self._optim is not None
        self._optim.state[p] = {k: self._cast(k, v, p).clone() for k, v in state.items()}
        if "step" in state:  # where its warm-up had got to
            self._steps[p] = int(torch.as_tensor(state["step"]).item())

    def _cast(self, key: str, value: Any, p: torch.Tensor) -> torch.Tensor:
        # as torch.optim.Adam.load_state_dict: the moments take the parameter's device and
        # dtype; the step count is float32, on the parameter's device for the fused kernel
        assert self._optim is not None
        if key != "step":
            return torch.as_tensor(value).to(device=p.device, dtype=p.dtype)
        fused = bool(self._optim.param_groups[0].get("fused"))
        return torch.as_tensor(value, dtype=torch.float32).to(
            device=p.device if fused else torch.device("cpu"))

    def get_state(self) -> Dict[str, Any]:
        """
        Each parameter's Adam state as ``pyro.optim.Adam`` gives it: ``{param
        store name: torch.optim.Adam state_dict of that parameter alone}``.
        """
        if self._optim is None:
            return {}
        store = pyro.get_param_store()
        hyper = {k: v for k, v in self._optim.param_groups[0].items() if k != "params"}
        result: Dict[str, Any] = {}
        for p in self._known:
            name = self._name(store, p)
            if name is None:
                continue
            state = self._optim.state.get(p)
            copied = {k: v.clone() for k, v in state.items()} if state else None
            result[name] = {"state": {0: copied} if copied else {},
                            "param_groups": [{**hyper, "params": [0]}]}
        return result
