"""Leaving a guide (the param store, its model's buffers, the generators) exactly as it
was when an initializer fails."""

import contextlib
from types import TracebackType
from typing import Any, Dict, Iterator, List, Optional, Tuple, Type

import pyro
import torch

from pyro_vinit._pyro_compat import handler_chain


def innermost(model: Any) -> Any:
    """The callable inside every effect handler wrapped around ``model`` (an
    autoguide's InitMessenger, and e.g. the ``poutine.block`` of an AutoGuideList
    member)."""
    chain = handler_chain(model)
    return chain[-1][1] if chain else model


def saved_buffers(module: Any) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """Each buffer of ``module`` (if a module) with a copy of its value."""
    if not isinstance(module, torch.nn.Module):
        return []
    return [(buffer, buffer.detach().clone()) for buffer in module.buffers()]


@torch.no_grad()
def restore_buffers(saved: List[Tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Copies the values :func:`saved_buffers` kept back into the buffers."""
    for buffer, value in saved:
        buffer.copy_(value)


def rng_state() -> Dict[str, Any]:
    """The CPU generator's state, and every CUDA device's where CUDA is in use."""
    state: Dict[str, Any] = {"cpu": torch.get_rng_state()}
    # (is_initialized: not annotated in torch)
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Any) -> None:
    """Sets the generators to a :func:`rng_state` (or a CPU generator's state)."""
    if isinstance(state, torch.Tensor):  # a checkpoint of the CPU generator alone
        torch.set_rng_state(state)
        return
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


@contextlib.contextmanager
def generators_kept(loader: Any) -> Iterator[None]:
    """The block run with the global generators' state, and those of a
    DataLoader's own generator and of its sampler's, restored afterwards."""
    rng = rng_state()
    sampler = getattr(loader, "sampler", None)
    batch_sampler = getattr(getattr(loader, "batch_sampler", None), "sampler", None)
    owns = {id(g): g for g in (getattr(source, "generator", None)
                               for source in (loader, sampler, batch_sampler))
            if isinstance(g, torch.Generator)}
    states = [(g, g.get_state()) for g in owns.values()]
    try:
        yield
    finally:
        set_rng_state(rng)
        for generator, state in states:
            generator.set_state(state)


@contextlib.contextmanager
def restored_on_error(state: Dict[str, Any]) -> Iterator[None]:
    """The generators set to ``state`` (a :func:`rng_state`) where the block fails."""
    try:
        yield
    except BaseException:
        set_rng_state(state)
        raise


class GuideRollback:
    """
    Restores a guide (the param store, and the buffers of its model, e.g.
    BatchNorm's running statistics that the model's runs in train mode moved)
    and the generators (a corrected call draws as a first one would) if the
    block raises: for a guide
    that was not set up before the block, its not-set-up state (the
    parameters that setting it up created are removed from it and from the
    param store), so that a corrected call can set it up anew; and, once
    :meth:`checkpoint` has been called, every parameter value bit for bit.

    The values are copied only at :meth:`checkpoint`, which the caller calls
    right before its first write, so that the copy does not add to the
    memory of the work before it (nothing may be written before).
    """

    def __init__(self, guide: torch.nn.Module) -> None:
        self.guide = guide

    def __enter__(self) -> "GuideRollback":
        store = pyro.get_param_store()
        self._names = set(store.keys())
        self._attrs = dict(self.guide.__dict__)
        self._containers = {
            key: dict(self._attrs[key])
            for key in ("_modules", "_parameters", "_buffers", "_pyro_params")
            if isinstance(self._attrs.get(key), dict)
        }
        self._values: List[Tuple[torch.Tensor, torch.Tensor]] = []
        self._buffers = saved_buffers(innermost(getattr(self.guide, "model", None)))
        self._rng = rng_state()
        return self

    @torch.no_grad()
    def checkpoint(self) -> None:
        """Copies every parameter of the guide and the param store (once each)."""
        seen = set()
        params = list(self.guide.parameters()) + [
            p for _, p in pyro.get_param_store().named_parameters()
        ]
        for param in params:
            if id(param) not in seen:
                seen.add(id(param))
                self._values.append((param, param.detach().clone()))

    def __exit__(
        self,
        exc_type: Optional[Type[BaseException]],
        exc_value: Optional[BaseException],
        traceback: Optional[TracebackType],
    ) -> None:
        if exc_type is None:
            return
        self.restore()

    def restore(self) -> None:
        """Restores the guide and the param store as :meth:`__exit__` does on an
        error (for a block that must leave nothing behind either way)."""
        restore_buffers(self._buffers)
        with torch.no_grad():
            for param, value in self._values:
                param.copy_(value)
            store = pyro.get_param_store()
            for name in set(store.keys()) - self._names:
                del store[name]
            self.guide.__dict__.clear()
            self.guide.__dict__.update(self._attrs)
            self.guide.__dict__.update(self._containers)
        set_rng_state(self._rng)


@torch.no_grad()
def write_param(name: str, unconstrained: torch.Tensor) -> None:
    """Sets the unconstrained value of the param-store entry ``name`` in place."""
    for key, param in pyro.get_param_store().named_parameters():
        if key == name:
            param.copy_(unconstrained.to(param).reshape(param.shape))
            return
    raise KeyError(f"no param {name!r} in the param store")
