"""
The inductor compile of :class:`~pyro_vinit.CapturedSVI`'s traced step
(``compile=True``), and the cost model by which :func:`~pyro_vinit.fit`
compiles a long run's step. It calls torch internals (``torch._inductor``): no public
API compiles an aten graph as it stands.
"""

import warnings
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Set, Tuple, cast

import torch

from pyro_vinit.training._cuda_graph import node_tensors, off_device

__all__ = ["compile_pays", "graph_size", "held_write", "inductor_compile"]


class _CostModel(NamedTuple):
    """A compiled step saves about ``saved_per_operator`` seconds per operator of the
    traced graph and ``saved_per_element`` per element its operators write; tracing
    again and compiling costs about ``compile_seconds`` (inductor's start-up in the
    process included) plus ``compile_per_operator`` per operator."""

    saved_per_operator: float
    saved_per_element: float
    compile_seconds: float
    compile_per_operator: float


# fit's cost models of a compile, by the device type of every tensor of the graph. The
# CPU's is fitted to five steps (the race's three problems and the MLP 64-400-400-10 at
# batch 128 and 1000; one thread; benchmarks/bench_fit_compile.py). CUDA's to the MLP
# 64-w-w-10 (586 operators) at widths 400 and 2000, batch 128 and 1024, on an H100 and an
# H200 (benchmarks/gpu_check.py): the compile saves 1.25-1.68 us per operator over the
# uncompiled CUDA graph, and its tracing step takes 7-19 s, the most for the first in
# the process; the saving is taken at its low end, the cost at its high end.
_COST_MODELS: Dict[str, _CostModel] = {
    "cpu": _CostModel(2.5e-6, 1.3e-10, 21.0, 6e-3),
    "cuda": _CostModel(1.25e-6, 1e-12, 17.0, 6e-3),
}
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
        elements += sum(tensor.numel() for tensor in node_tensors(graph, node))
    return operators, elements


def _devices(graph: torch.fx.GraphModule) -> Set[torch.device]:
    """The devices of the tensors with elements in one dimension or more that
    ``graph`` takes or holds (its inputs, a model's tensors): where its work runs.
    Scalars, empty tensors and what the graph makes from them do not count: Pyro
    makes some on the CPU (a plate's zero log-density, an empty constant), which a
    CUDA graph replays as it captured them."""
    return {tensor.device for node in graph.graph.nodes if node.op in ("placeholder", "get_attr")
            for tensor in node_tensors(graph, node) if tensor.dim() and tensor.numel()}


def compile_pays(graph: torch.fx.GraphModule, steps: int) -> bool:
    """
    Whether compiling ``graph`` is projected to save, over ``steps``
    replays, at least twice what the compile costs, by the cost model of the
    one device type its inputs and tensors are on (the CPU's; CUDA's for a
    graph that replays as one CUDA graph); never for a graph on two devices (a
    model on CUDA that moves its CPU data there), a CUDA graph with work off its
    device (:func:`~pyro_vinit.training._cuda_graph.off_device`), or another
    device.
    """
    devices = _devices(graph)
    if len(devices) != 1:
        return False
    device = devices.pop()
    model = _COST_MODELS.get(device.type)
    if model is None or (device.type == "cuda" and off_device(graph, device) is not None):
        return False
    operators, elements = graph_size(graph)
    saved = model.saved_per_operator * operators + model.saved_per_element * elements
    cost = model.compile_seconds + model.compile_per_operator * operators
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
