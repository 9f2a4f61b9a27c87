"""
The tracing of :class:`~pyro_vinit.CapturedSVI`'s step into one graph of aten
operations (``make_fx`` on the real tensors), and the rewrite of its dead
buffers into in-place operators. It calls torch internals
(``torch._guards``, ``torch._subclasses``) to make the trace cheaper, and traces
without them where they are gone.
"""

import contextlib
from typing import Any, Callable, Iterator, Set

import torch

__all__ = ["reuse_dead_buffers", "trace_graph"]


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


_aten = torch.ops.aten
#: Operators whose first argument the graph may overwrite, where it dies there.
_IN_PLACE = {
    _aten.add.Tensor: _aten.add_.Tensor, _aten.mul.Tensor: _aten.mul_.Tensor,
    _aten.sub.Tensor: _aten.sub_.Tensor, _aten.div.Tensor: _aten.div_.Tensor,
    _aten.sqrt.default: _aten.sqrt_.default, _aten.exp.default: _aten.exp_.default,
    _aten.log.default: _aten.log_.default, _aten.neg.default: _aten.neg_.default,
    _aten.relu.default: _aten.relu_.default,
    _aten.pow.Tensor_Scalar: _aten.pow_.Scalar,
}
#: Those of them whose two tensor arguments may be swapped (IEEE addition and
#: multiplication are commutative, bit for bit).
_COMMUTATIVE = {_aten.add.Tensor, _aten.mul.Tensor}


def _schema(node: torch.fx.Node) -> Any:
    target = node.target
    return getattr(target, "_schema", None) if node.op == "call_function" else None


def reuse_dead_buffers(graph: torch.fx.GraphModule) -> int:
    """
    Rewrites the out-of-place elementwise operators of ``graph`` whose input
    tensor is a fresh buffer that dies there (no later use, no view of it, not an
    output) into their in-place forms, as autograd's engine accumulates
    gradients in place where ``make_fx`` records ``add``: the same values,
    fewer fresh buffers. Returns the number of operators rewritten.
    """
    order = {node: i for i, node in enumerate(graph.graph.nodes)}
    outputs = {n for node in graph.graph.nodes if node.op == "output"
               for n in node.all_input_nodes}

    owned: Set[torch.fx.Node] = set()  # rewritten here: the buffer they overwrote, alone

    def fresh(node: Any) -> bool:
        if node in owned:
            return True
        schema = _schema(node) if isinstance(node, torch.fx.Node) else None
        return (schema is not None and not schema.is_mutable
                and all(r.alias_info is None for r in schema.returns))

    def dies_at(buffer: torch.fx.Node, node: torch.fx.Node) -> bool:
        if buffer in outputs or not fresh(buffer):
            return False
        for user in buffer.users:
            if user is node:
                continue
            schema = _schema(user)
            if order[user] > order[node] or schema is None or any(
                    r.alias_info is not None for r in schema.returns):
                return False  # used later, or viewed
        mine, result = buffer.meta.get("val"), node.meta.get("val")
        return (isinstance(mine, torch.Tensor) and isinstance(result, torch.Tensor)
                and mine.shape == result.shape and mine.dtype == result.dtype
                and mine.stride() == result.stride())

    rewritten = 0
    for node in list(graph.graph.nodes):
        if node.op != "call_function" or node.target not in _IN_PLACE or node.kwargs:
            continue
        args = list(node.args)
        if isinstance(args[0], torch.fx.Node) and dies_at(args[0], node):
            pass
        elif (node.target in _COMMUTATIVE and len(args) == 2
              and isinstance(args[1], torch.fx.Node) and dies_at(args[1], node)):
            args = [args[1], args[0]]
        else:
            continue
        node.args = tuple(args)
        node.target = _IN_PLACE[node.target]
        owned.add(node)
        rewritten += 1
    graph.recompile()
    return rewritten
