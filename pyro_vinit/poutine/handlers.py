"""
Handler functions in the style of :mod:`pyro.poutine`: ``local_reparam(fn)``
wraps a callable, ``local_reparam()`` is a context manager.
"""

from typing import Any, Callable, Optional, TypeVar, Union, overload

from pyro.poutine.messenger import Messenger

from pyro_vinit.poutine.flipout_messenger import FlipoutMessenger
from pyro_vinit.poutine.local_reparam_messenger import LocalReparamMessenger
from pyro_vinit.poutine.vectorized_layers_messenger import VectorizedLayersMessenger
from pyro_vinit.poutine.weight_noise_messenger import Config, WeightNoiseMessenger

__all__ = ["flipout", "local_reparam", "vectorized_layers", "weight_noise"]

_F = TypeVar("_F", bound=Callable[..., Any])
_M = TypeVar("_M", bound=Messenger)


def _apply(messenger: _M, fn: Optional[Callable[..., Any]]) -> Union[_M, Callable[..., Any]]:
    if fn is None:
        return messenger
    if not callable(fn):
        raise ValueError(f"{fn!r} is not callable, did you mean to pass it as a keyword arg?")
    return messenger(fn)


@overload
def local_reparam(
    fn: None = ..., *, strict: bool = False, low_rank: Optional[bool] = None, conv: bool = True
) -> LocalReparamMessenger: ...


@overload
def local_reparam(
    fn: _F, *, strict: bool = False, low_rank: Optional[bool] = None, conv: bool = True
) -> _F: ...


def local_reparam(
    fn: Optional[Callable[..., Any]] = None,
    *,
    strict: bool = False,
    low_rank: Optional[bool] = None,
    conv: bool = True,
) -> Union[LocalReparamMessenger, Callable[..., Any]]:
    """
    Convenient wrapper of :class:`~pyro_vinit.poutine.LocalReparamMessenger`.

    Usage::

        step = local_reparam(svi.step)
        loss = step(x, y)

    :param callable fn: A callable that runs both the guide and the model
        (e.g. ``svi.step`` or a :class:`~pyro.infer.Predictive`); if None,
        the handler itself, for use as a context manager.
    :param bool strict: See :class:`~pyro_vinit.poutine.LocalReparamMessenger`.
    :param low_rank: See :class:`~pyro_vinit.poutine.LocalReparamMessenger`.
    :param bool conv: See :class:`~pyro_vinit.poutine.LocalReparamMessenger`.
    """
    return _apply(LocalReparamMessenger(strict=strict, low_rank=low_rank, conv=conv), fn)


@overload
def flipout(fn: None = ..., *, strict: bool = False, conv: bool = True) -> FlipoutMessenger: ...


@overload
def flipout(fn: _F, *, strict: bool = False, conv: bool = True) -> _F: ...


def flipout(
    fn: Optional[Callable[..., Any]] = None, *, strict: bool = False, conv: bool = True
) -> Union[FlipoutMessenger, Callable[..., Any]]:
    """
    Convenient wrapper of :class:`~pyro_vinit.poutine.FlipoutMessenger`.

    Usage::

        step = flipout(svi.step)
        loss = step(x, y)

    :param callable fn: A callable that runs both the guide and the model; if
        None, the handler itself, for use as a context manager.
    :param bool strict: See :class:`~pyro_vinit.poutine.FlipoutMessenger`.
    :param bool conv: See :class:`~pyro_vinit.poutine.FlipoutMessenger`.
    """
    return _apply(FlipoutMessenger(strict=strict, conv=conv), fn)


@overload
def weight_noise(
    fn: None = ..., *, config: Optional[Config] = None, strict: bool = False
) -> WeightNoiseMessenger: ...


@overload
def weight_noise(fn: _F, *, config: Optional[Config] = None, strict: bool = False) -> _F: ...


def weight_noise(
    fn: Optional[Callable[..., Any]] = None,
    *,
    config: Optional[Config] = None,
    strict: bool = False,
) -> Union[WeightNoiseMessenger, Callable[..., Any]]:
    """
    Convenient wrapper of :class:`~pyro_vinit.poutine.WeightNoiseMessenger`.

    Usage::

        step = weight_noise(svi.step, config={"net.0.weight": Flipout()})
        loss = step(x, y)

    :param callable fn: A callable that runs both the guide and the model; if
        None, the handler itself, for use as a context manager.
    :param config: See :class:`~pyro_vinit.poutine.WeightNoiseMessenger`.
    :param bool strict: See :class:`~pyro_vinit.poutine.WeightNoiseMessenger`.
    """
    return _apply(WeightNoiseMessenger(config=config, strict=strict), fn)


@overload
def vectorized_layers(fn: None = ...) -> VectorizedLayersMessenger: ...


@overload
def vectorized_layers(fn: _F) -> _F: ...


def vectorized_layers(
    fn: Optional[Callable[..., Any]] = None,
) -> Union[VectorizedLayersMessenger, Callable[..., Any]]:
    """
    Convenient wrapper of :class:`~pyro_vinit.poutine.VectorizedLayersMessenger`.

    Usage::

        predictive = Predictive(model, guide=guide, num_samples=100, parallel=True)
        samples = vectorized_layers(predictive)(x)

    :param callable fn: A callable that runs both the guide and the model
        (e.g. a :class:`~pyro.infer.Predictive`); if None, the handler
        itself, for use as a context manager.
    """
    return _apply(VectorizedLayersMessenger(), fn)
