"""
The part of :class:`~pyro_vinit.CapturedSVI`'s input signature that the
effect handlers around a step give: their settings, compared by value.
"""

import functools
import inspect
import numbers
import types
from typing import Any, Callable, Hashable

import torch

__all__ = ["messenger_state"]


class _Same:
    """An object compared by identity, held by the signature that names it: its id is
    never another object's (a freed object's id is reused by the next one made)."""

    __slots__ = ("obj",)

    def __init__(self, obj: object) -> None:
        self.obj = obj

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Same) and other.obj is self.obj

    def __hash__(self) -> int:
        return id(self.obj)

    def __repr__(self) -> str:  # the object's id: a set's keys sort alike at each step
        return f"_Same({id(self.obj):#x})"


def _is_setting(name: str, value: Any) -> bool:
    # An object's public attributes are settings; of its private ones only the plain
    # numbers and strings are (a KL weight held as _scale), not its counters and per-run
    # containers.
    return not name.startswith("_") or isinstance(value, (float, str))


def _setting_key(value: Any, depth: int = 0) -> Hashable:
    # A setting compared by value: equal settings made afresh (a handler entered at each
    # step) are one signature; different ones (another strategy, another function) are not.
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.Tensor):  # the same tensor, not changed in place
        return ("tensor", id(value), value._version)
    if isinstance(value, numbers.Number) and not hasattr(value, "__dict__"):
        # a NumPy scalar (e.g. poutine.scale(scale=np.float32(...))), a complex: by value
        return (type(value), value)
    if depth >= 3 or isinstance(value, type):
        return ("object", _Same(value))
    deeper = functools.partial(_setting_key, depth=depth + 1)
    if isinstance(value, (list, tuple)):
        return (type(value), tuple(map(deeper, value)))
    if isinstance(value, (set, frozenset)):
        return (type(value), tuple(sorted(map(deeper, value), key=repr)))
    if isinstance(value, dict):  # e.g. a per-site config
        return (dict, tuple(sorted(((k, deeper(v)) for k, v in value.items()),
                                   key=lambda kv: repr(kv[0]))))
    if isinstance(value, functools.partial):  # e.g. poutine.block's hide_fn
        return (functools.partial, deeper(value.func), deeper(value.args),
                deeper(value.keywords))
    if isinstance(value, types.FunctionType):  # its code, captured values and defaults
        cells = []
        for cell in value.__closure__ or ():
            try:
                cells.append(deeper(cell.cell_contents))
            except ValueError:  # an empty cell
                cells.append(("empty",))
        return (types.FunctionType, value.__code__, tuple(cells),
                deeper(value.__defaults__), deeper(value.__kwdefaults__))
    if hasattr(value, "__dict__") and not inspect.isroutine(value):
        # a strategy or schedule object (e.g. LocalReparam(low_rank=...), AutoWeightNoise
        # and the strategies it holds): its type and settings, as a handler's
        return _object_key(value, deeper)
    if isinstance(value, types.MethodType):  # made afresh at each attribute access
        return (types.MethodType, deeper(value.__func__), deeper(value.__self__))
    return ("object", _Same(value))  # a builtin: the same one


def _object_key(value: Any, key: Callable[[Any], Hashable]) -> Hashable:
    # An object's type and its settings, each by ``key``.
    return (type(value), tuple(sorted(
        (k, key(v)) for k, v in vars(value).items() if _is_setting(k, v))))


def messenger_state(messenger: Any) -> Hashable:
    """A handler's part of the input signature: its type and settings (a KL
    weight, a scale, a strategy), constants of the graph, so that a changed
    setting re-traces."""
    return _object_key(messenger, _setting_key)
