"""
An exponential moving average of the param store's parameters (Polyak
averaging), which :func:`~pyro_vinit.training.fit` evaluates and returns.
"""

import contextlib
import math
from typing import Any, Dict, Iterator, List, Optional, Set, Tuple

import pyro
import torch
from torch import nn

from pyro_vinit._warn import warn_at_caller

__all__ = ["ParamAverage"]


def _check_decay(decay: Any, what: str) -> None:
    if (isinstance(decay, bool) or not isinstance(decay, (int, float))
            or not math.isfinite(decay) or not 0 <= decay < 1):
        raise ValueError(f"{what} must be a number in [0, 1) (the decay of the parameters' "
                         f"moving average; 0 for none), got {decay!r}")


class ParamAverage:
    r"""
    An exponential moving average of the unconstrained values of the
    parameters in Pyro's param store (or of one module's parameters), updated
    after each SVI step.

    Usage::

        average = ParamAverage(decay=0.99)
        for step in range(num_steps):
            svi.step(x, y)
            average.update()
        with average.swapped():  # the averaged parameters, restored on exit
            samples = Predictive(model, guide=guide, num_samples=8)(x_test)
        average.write()  # keep them

    After the :math:`n`-th update the average of each parameter is

    .. math::

        \bar\theta_n = (1 - w_n)\,\bar\theta_{n-1} + w_n\,\theta_n, \qquad
        w_n = \max(1 - \beta, 1/n),

    the plain mean of the steps so far while :math:`n < 1/(1 - \beta)` and an
    exponential average over about the last :math:`1/(1 - \beta)` steps after.
    A parameter first seen at a later update starts at its value then.
    ``decay=0`` keeps the last step's values.

    [1] Polyak, Juditsky (1992) "Acceleration of Stochastic Approximation by
    Averaging"

    :param float decay: The decay :math:`\beta`, in ``[0, 1)``.
    :param torch.nn.Module module: Average this module's parameters instead of
        the param store's (e.g. a loss module under
        ``pyro.settings.set(module_local_params=True)``, whose parameters are
        not in the store).
    """

    def __init__(self, decay: float = 0.99, module: Optional[nn.Module] = None) -> None:
        _check_decay(decay, "ParamAverage: decay")
        if module is not None and not isinstance(module, nn.Module):
            raise TypeError(f"ParamAverage: module must be a torch.nn.Module, got "
                            f"{type(module).__name__}")
        self.decay = float(decay)
        self.module = module
        self.count = 0
        self._params: Dict[str, torch.Tensor] = {}
        self._average: Dict[str, torch.Tensor] = {}
        self._warned = False
        self._restored: Set[str] = set()

    def _source(self) -> Dict[str, torch.Tensor]:
        if self.module is not None:
            return dict(self.module.named_parameters())
        return dict(pyro.get_param_store().named_parameters())

    def _tracked(self) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
        # the parameters now; a name that is new, or whose tensor was replaced (set
        # afresh by pyro.param, a reloaded store), starts at its current value, unless
        # the new tensor is the old one's storage (an nn.Parameter made of it by a
        # PyroModule) or the first one seen since set_state (a store restored after it)
        params, averages = [], []
        for name, param in self._source().items():
            old = self._params.get(name)
            if old is not param:
                average = self._average.get(name)
                kept = (old is not None and average is not None
                        and (average.shape, average.dtype, average.device)
                        == (param.shape, param.dtype, param.device)
                        and (name in self._restored or old.data_ptr() == param.data_ptr()))
                self._params[name] = param
                if not kept:
                    self._average[name] = param.detach().clone()
            elif self._average[name].shape != param.shape:
                self._average[name] = param.detach().clone()
            self._restored.discard(name)
            params.append(param)
            averages.append(self._average[name])
        return params, averages

    @torch.no_grad()
    def update(self) -> None:
        """Moves the average towards the parameters' current values (call it after
        each step)."""
        self.count += 1
        params, averages = self._tracked()
        if not params:
            if not self._warned:
                self._warned = True
                where = ("the module has no parameters" if self.module is not None else
                         "Pyro's param store holds no parameters (with module_local_params=True"
                         ", pass the module: ParamAverage(decay, module=loss_fn))")
                warn_at_caller(f"ParamAverage.update: nothing to average: {where}",
                               UserWarning)
            return
        weight = max(1.0 - self.decay, 1.0 / self.count)
        if weight == 1.0:
            torch._foreach_copy_(averages, [p.detach() for p in params])
        else:
            torch._foreach_lerp_(averages, [p.detach() for p in params], weight)

    @torch.no_grad()
    def write(self) -> None:
        """Copies the average into the parameters, in place (every module, guide
        and optimizer that holds them sees the averaged values)."""
        if self.count == 0:
            return
        params, averages = self._tracked()
        torch._foreach_copy_(params, averages)

    @contextlib.contextmanager
    def swapped(self) -> Iterator[None]:
        """A context in which the parameters hold the average; their own values
        come back on exit."""
        if self.count == 0:
            yield
            return
        params, averages = self._tracked()
        with torch.no_grad():
            saved = [p.detach().clone() for p in params]
            torch._foreach_copy_(params, averages)
        try:
            yield
        finally:
            with torch.no_grad():
                torch._foreach_copy_(params, saved)

    def get_state(self) -> Dict[str, Any]:
        """The decay, the number of updates and the averages (by parameter name),
        for a checkpoint."""
        return {"decay": self.decay, "count": self.count,
                "average": {name: value.detach().clone()
                            for name, value in self._average.items()}}

    def set_state(self, state: Dict[str, Any]) -> None:
        """Restores :meth:`get_state`'s state; the averages are copied to the
        devices of the parameters of the same names."""
        store = self._source()
        unknown = sorted(set(state["average"]) - set(store))
        where = "the module" if self.module is not None else "the param store"
        if unknown:
            raise ValueError(f"ParamAverage.set_state: {unknown[:5]} are not parameters of "
                             f"{where}")
        shapes = sorted(f"{name} {tuple(value.shape)} vs {tuple(store[name].shape)}"
                        for name, value in state["average"].items()
                        if value.shape != store[name].shape)
        if shapes:  # the average would start over at the parameters, silently
            raise ValueError(f"ParamAverage.set_state: averages of other shapes than the "
                             f"parameters of {where} ({', '.join(shapes[:5])}): a state of "
                             "another model")
        self.decay = float(state["decay"])
        self.count = int(state["count"])
        self._params = {name: store[name] for name in state["average"]}
        self._restored = set(state["average"])
        self._average = {name: value.detach().clone().to(store[name].device, store[name].dtype)
                         for name, value in state["average"].items()}
