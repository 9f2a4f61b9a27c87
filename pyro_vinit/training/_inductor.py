"""
The inductor compile of :class:`~pyro_vinit.CapturedSVI`'s traced step
(``compile=True``), and the cost model by which :func:`~pyro_vinit.fit`
compiles a long run's step. It calls torch internals (``torch._inductor``): no public
API compiles an aten graph as it stands.
"""

import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple, cast

import torch

__all__ = ["compile_pays", "graph_size", "held_write", "inductor_compile"]

# fit's cost model of a compile on the CPU, fitted to five steps (the race's three
# problems and the MLP 64-400-400-10 at batch 128 and 1000; one thread;
# benchmarks/bench_fit_compile.py): the compiled step saves about _SAVED_PER_OPERATOR
# seconds per operator of the traced graph and _SAVED_PER_ELEMENT per element that its
# operators write; tracing again and compiling costs about _COMPILE_SECONDS, inductor's
# start-up in the process included, plus _COMPILE_PER_OPERATOR per operator.
_SAVED_PER_OPERATOR = 2.5e-6
_SAVED_PER_ELEMENT = 1.3e-10
_COMPILE_SECONDS = 21.0
_COMPILE_PER_OPERATOR = 6e-3
#: fit compiles where the projected saving repays the compile this many times over.
_PAYBACK = 2.0


def _schema(node: torch.fx.Node) -> Any:
    target = node.target
    return getattr(target, "_schema", None) if node.op == "call_function" else None


def held_write(graph: torch.fx.GraphModule,
               names: Optional[Dict[int, str]] = None) -> Optional[str]:
    """
    What tensor that ``graph`` does not make it writes in place (a model's
    buffer, e.g. BatchNorm's running statistics; an input), or None.
    Inductor's functional copy of such a graph drops those writes.
    ``names``: the names of the tensors the graph may hold (a model's
    buffers), by ``id``, to say which one.
    """
    for node in graph.graph.nodes:
        schema = _schema(node)
        if schema is None or not schema.is_mutable:
            continue
        for i, argument in enumerate(schema.arguments):
            if argument.alias_info is None or not argument.alias_info.is_write:
                continue
            value = node.args[i] if i < len(node.args) else node.kwargs.get(argument.name)
            while isinstance(value, torch.fx.Node) and value.op == "call_function":
                base = _schema(value)  # through views, to the tensor viewed
                if base is None or all(r.alias_info is None for r in base.returns):
                    break
                value = value.args[0]
            if isinstance(value, torch.fx.Node) and value.op in ("get_attr", "placeholder"):
                held = (getattr(graph, str(value.target), None) if value.op == "get_attr"
                        else None)
                name = (names or {}).get(id(held)) if held is not None else None
                what = f"the buffer {name!r}" if name is not None else value.target
                return (f"it writes in place to a tensor it reads ({node.target} on "
                        f"{what}; e.g. BatchNorm's running statistics), a write that "
                        "inductor's compiled graph would drop")
    return None


def graph_size(graph: torch.fx.GraphModule) -> Tuple[int, int]:
    """The number of operators ``graph`` calls and of the elements they write."""
    operators = elements = 0
    for node in graph.graph.nodes:
        if node.op != "call_function":
            continue
        operators += 1
        value = node.meta.get("val")
        for tensor in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(tensor, torch.Tensor):
                elements += tensor.numel()
    return operators, elements


def _off_cpu(graph: torch.fx.GraphModule) -> bool:
    """Whether ``graph`` reads or makes a tensor off the CPU."""
    for node in graph.graph.nodes:
        value = node.meta.get("val")
        for tensor in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(tensor, torch.Tensor) and tensor.device.type != "cpu":
                return True
    return False


def compile_pays(graph: torch.fx.GraphModule, steps: int) -> bool:
    """
    Whether compiling ``graph`` is projected to save, over ``steps``
    replays, at least twice what the compile costs; never for a graph with a
    tensor off the CPU (a model on CUDA that moves its CPU data there).
    """
    if _off_cpu(graph):
        return False
    operators, elements = graph_size(graph)
    saved = _SAVED_PER_OPERATOR * operators + _SAVED_PER_ELEMENT * elements
    cost = _COMPILE_SECONDS + _COMPILE_PER_OPERATOR * operators
    return steps * saved >= _PAYBACK * cost


def inductor_compile(graph: torch.fx.GraphModule, params: List[torch.Tensor],
                     tensors: List[torch.Tensor]) -> Callable[..., Any]:
    """
    ``graph`` (functional: before ``CapturedSVI``'s in-place rewrite)
    compiled whole by inductor, called as ``graph`` is. Its random draws stay PyTorch's
    (``fallback_random``): the same draws from the same generator, so on the
    CPU the same values as the eager step's (on CUDA inductor may order
    independent draws its own way: the same distribution, not the same
    values). ``graph`` itself is left as it was.
    """
    import torch.utils._pytree as pytree

    out_spec = graph.graph._codegen.pytree_info.out_spec  # type: ignore[attr-defined]
    nodes = torch.fx.Graph()  # the same nodes, flat inputs and outputs
    nodes.output(nodes.graph_copy(graph.graph, {}))
    flat = torch.fx.GraphModule(graph, nodes)
    examples = [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device).zero_()
                for t in [*params, *tensors]]
    # inductor's first import warns of torch's own deprecations (torch.jit.script_method):
    # nothing a user can act on, and an error where they turn DeprecationWarning into
    # one (pytest's -W error), which would leave the step uncompiled
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        # torch internals: no public API compiles an aten graph as it stands
        # (torch.compile would trace it again with dynamo and guard every call)
        from torch._inductor import config
        from torch._inductor.compile_fx import compile_fx

        with torch.no_grad(), config.patch(fallback_random=True):
            compiled = cast(Callable[..., Any], compile_fx(flat, examples))

    def replay(params: List[torch.Tensor], tensors: List[torch.Tensor]) -> Any:
        return pytree.tree_unflatten(list(compiled(*params, *tensors)), out_spec)

    return replay
