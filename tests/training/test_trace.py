import pytest
import torch
from torch._guards import TracingContext, tracing
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from pyro_vinit.training._trace import trace_graph


def _loss_and_grad(w, x):
    loss = (torch.tanh(x @ w) ** 2).sum() + w.exp().sum()
    (grad,) = torch.autograd.grad(loss, [w])
    return loss.detach(), grad


def _fake_modes(graph):
    vals = [node.meta.get("val") for node in graph.graph.nodes]
    fakes = [v for v in vals if isinstance(v, FakeTensor)]
    assert len(fakes) > 10  # every operator's output is recorded
    return {id(v.fake_mode) for v in fakes}, fakes


def test_trace_graph_computes_as_the_function():
    w = torch.randn(4, 3, requires_grad=True)
    x = torch.randn(5, 4)
    graph = trace_graph(_loss_and_grad, w, x)
    expected = _loss_and_grad(w, x)
    with torch.no_grad():
        got = graph(w, x)
    for a, b in zip(got, expected):
        assert torch.equal(a, b)


def test_trace_graph_records_with_one_fake_mode():
    # make_fx's own way makes a fake mode per operator (each recording the Python stack)
    graph = trace_graph(_loss_and_grad, torch.randn(4, 3, requires_grad=True), torch.randn(5, 4))
    modes, _ = _fake_modes(graph)
    assert len(modes) == 1


def test_trace_graph_leaves_an_outer_tracing_context_alone():
    outer = FakeTensorMode(allow_fallback_kernels=True)
    with tracing(TracingContext(outer)):
        graph = trace_graph(_loss_and_grad, torch.randn(4, 3, requires_grad=True),
                            torch.randn(5, 4))
        assert TracingContext.try_get().fake_mode is outer
    modes, _ = _fake_modes(graph)
    assert modes == {id(outer)}
    assert TracingContext.try_get() is None


def test_trace_graph_leaves_no_tracing_context_after_an_error():
    def failing(w, x):
        (x @ w).sum()
        raise RuntimeError("the step failed")

    with pytest.raises(RuntimeError, match="the step failed"):
        trace_graph(failing, torch.randn(4, 3), torch.randn(5, 4))
    assert TracingContext.try_get() is None


def test_trace_graph_traces_make_fx_s_way_where_torch_s_internals_changed(monkeypatch):
    import torch._guards

    def changed(*args, **kwargs):
        raise TypeError("tracing() takes other arguments in this torch")

    monkeypatch.setattr(torch._guards, "tracing", changed)
    graph = trace_graph(_loss_and_grad, torch.randn(4, 3, requires_grad=True),
                        torch.randn(5, 4))
    modes, _ = _fake_modes(graph)
    assert len(modes) > 1  # a fake mode per operator, as make_fx makes them
