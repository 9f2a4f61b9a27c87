"""
The CUDA-graph replay of :class:`~pyro_vinit.CapturedSVI`'s traced step:
whether a graph can be replayed as one CUDA graph on a device
(:func:`off_device`), and the replay (:class:`CudaGraphReplay`).
"""

from typing import Any, Callable, List, Optional, Set

import torch

__all__ = ["CudaGraphReplay", "node_tensors", "off_device"]

_aten = torch.ops.aten


def node_tensors(graph: torch.fx.GraphModule, node: torch.fx.Node) -> List[torch.Tensor]:
    """The tensors a node of ``graph`` computes (or holds, for a constant)."""
    if node.op == "get_attr":
        value: Any = graph
        for name in str(node.target).split("."):
            value = getattr(value, name)
    else:
        value = node.meta.get("val")
    values = value if isinstance(value, (tuple, list)) else (value,)
    return [v for v in values if isinstance(v, torch.Tensor)]


def off_device(graph: torch.fx.GraphModule, device: torch.device) -> Optional[str]:
    """
    Why a CUDA graph on ``device`` would not replay ``graph`` as it runs, or
    None. Off-device operators run once, at capture, and their values are
    frozen into it: refused are an off-device value that changes from step to
    step (a random draw, such as a subsampled plate's CPU ``randperm``, or what
    reads a draw or an input), an off-device tensor the graph holds rather than
    makes (a model's tensor, which may change in place between steps), and an
    off-device tensor with elements that a device operator reads (a copy from
    host memory at each step). Off-device scalars made from constants (Pyro's
    plate makes its zero log-density on the CPU) are the same at every step.
    """
    varying: Set[torch.fx.Node] = set()
    fresh = {_aten.lift_fresh_copy.default, _aten.lift_fresh.default}
    for node in graph.graph.nodes:
        if node.op == "placeholder":
            varying.add(node)
        elif node.op == "get_attr":
            if any(t.device != device and t.numel() for t in node_tensors(graph, node)) and any(
                    user.target not in fresh for user in node.users):
                return f"{node.target} is a tensor held on another device than {device}"
        if node.op != "call_function":
            continue
        mine = node_tensors(graph, node)
        if any(t.device == device for t in mine):
            for source in node.all_input_nodes:
                if any(t.device != device and t.dim() for t in node_tensors(graph, source)):
                    return f"{node.target} reads a tensor from {source.target}, off {device}"
        if torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ()) or any(
                n in varying for n in node.all_input_nodes):
            varying.add(node)
            if any(t.device != device and t.numel() for t in mine):
                return f"{node.target} computes on another device than {device}"
    return None


class CudaGraphReplay:
    """
    A traced step replayed as one CUDA graph: the data tensors are copied into
    static inputs, the graph is launched once, and its loss and gradients are
    static outputs, overwritten by the next replay. Random draws stay fresh:
    PyTorch's CUDA generator hands each replay the next offsets of its stream.
    """

    def __init__(self, graph: Callable[..., Any], params: List[torch.Tensor],
                 tensors: List[torch.Tensor], device: torch.device) -> None:
        self.inputs = [t.detach().clone() for t in tensors]
        self.storage = [p.data_ptr() for p in params]
        self.cuda_graph = torch.cuda.CUDAGraph()
        current = torch.cuda.current_stream(device)
        try:
            with torch.no_grad(), torch.cuda.device(device):
                side = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
                side.wait_stream(current)
                with torch.cuda.stream(side):  # warm-up (lazy library state) off the capture
                    graph(params, self.inputs)
                current.wait_stream(side)
                # thread_local: another thread's CUDA work (a loader pinning memory) does
                # not invalidate the capture
                with torch.cuda.graph(self.cuda_graph, stream=side,
                                      capture_error_mode="thread_local"):
                    self.outputs = graph(params, self.inputs)
                current.wait_stream(side)
        finally:
            torch.cuda.set_stream(current)  # also where the capture's end raised

    def __call__(self, params: List[torch.Tensor], tensors: List[torch.Tensor]) -> Any:
        if [p.data_ptr() for p in params] != self.storage:
            raise RuntimeError(
                "CapturedSVI: a parameter's storage changed since its step was captured as a "
                "CUDA graph (p.data = ..., module.to(...)); make a new CapturedSVI")
        for static, value in zip(self.inputs, tensors):
            if static.data_ptr() != value.data_ptr():
                static.copy_(value)
        self.cuda_graph.replay()
        return self.outputs
