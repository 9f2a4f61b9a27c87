"""
The tracing of :class:`~pyro_vinit.CapturedSVI`'s step into one graph of aten
operations (``make_fx`` on the real tensors). It calls torch internals
(``torch._guards``, ``torch._subclasses``) to make the trace cheaper, and traces
without them where they are gone.
"""

import contextlib
from typing import Any, Callable, Iterator

import torch

__all__ = ["trace_graph"]


@contextlib.contextmanager
def _one_fake_mode() -> Iterator[None]:
    # make_fx keeps a fake copy of each operator's output in its node's meta. For a real
    # tensor it makes a new FakeTensorMode per operator, and each one records the Python
    # stack at its making: under Pyro's deep stacks, about half of a step's trace. A
    # fake mode held by a tracing context is found first, and serves every operator.
    context: Any = None
    try:
        from torch._guards import TracingContext, tracing
        from torch._subclasses.fake_tensor import FakeTensorMode

        if TracingContext.try_get() is None:  # (inside another tracer: its own, left alone)
            context = tracing(TracingContext(FakeTensorMode(allow_fallback_kernels=True)))
    except Exception:  # another torch's internals: make_fx's own way
        context = None
    with context if context is not None else contextlib.nullcontext():
        yield


def trace_graph(fn: Callable[..., Any], *args: Any) -> torch.fx.GraphModule:
    """``make_fx(fn)(*args)``: ``fn`` run once on the real ``args``, its aten
    operations recorded as a graph."""
    from torch.fx.experimental.proxy_tensor import make_fx

    with _one_fake_mode():
        return make_fx(fn)(*args)
