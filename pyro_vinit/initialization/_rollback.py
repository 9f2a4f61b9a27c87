"""Leaving a guide (and the param store) exactly as it was when an initializer fails."""

from contextlib import contextmanager
from typing import Iterator

import pyro
import torch
from pyro.distributions import constraints
from torch.distributions import transform_to


@contextmanager
def guide_rollback(guide) -> Iterator[None]:
    """
    Restores ``guide`` and the param store if the block raises: parameter
    values bit for bit, and, for a guide that was not set up before the
    block, its not-set-up state (the parameters that setting it up created
    are removed from it and from the param store), so that a corrected call
    can set it up anew.
    """
    store = pyro.get_param_store()
    names_before = set(store.keys())
    store_values = {name: p.detach().clone() for name, p in store.named_parameters()}
    attrs = dict(guide.__dict__)
    containers = {
        key: dict(attrs[key])
        for key in ("_modules", "_parameters", "_buffers", "_pyro_params")
        if isinstance(attrs.get(key), dict)
    }
    state = {k: v.detach().clone() for k, v in guide.state_dict().items()}
    try:
        yield
    except BaseException:
        with torch.no_grad():
            for name in set(store.keys()) - names_before:
                del store[name]
            for name, param in store.named_parameters():
                old = store_values.get(name)
                if old is not None and old.shape == param.shape:
                    param.copy_(old)
            guide.__dict__.clear()
            guide.__dict__.update(attrs)
            guide.__dict__.update(containers)
            for key, value in guide.state_dict().items():
                if key in state and state[key].shape == value.shape:
                    value.copy_(state[key])
        raise


@torch.no_grad()
def write_unconstrained(guide, name: str, loc: torch.Tensor, scale: torch.Tensor) -> None:
    """Sets the unconstrained loc and scale of a site of an AutoNormal-style guide."""
    params = dict(guide.named_parameters())
    for key, value, constraint in (
        (f"locs.{name}", loc, constraints.real),
        (f"scales.{name}", scale, guide.scale_constraint),
    ):
        param = params.get(key + "_unconstrained", params.get(key))
        if param is None:
            raise TypeError(
                f"{type(guide).__name__} has no parameter {key!r} for the noise site {name!r}"
            )
        param.copy_(transform_to(constraint).inv(value.to(param)).reshape(param.shape))


@torch.no_grad()
def write_param(name: str, unconstrained: torch.Tensor) -> None:
    """Sets the unconstrained value of the param-store entry ``name`` in place."""
    for key, param in pyro.get_param_store().named_parameters():
        if key == name:
            param.copy_(unconstrained.to(param).reshape(param.shape))
            return
    raise KeyError(f"no param {name!r} in the param store")
