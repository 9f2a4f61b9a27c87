"""CapturedSVI(compile=True): inductor's compile of the traced step gives the
eager step's losses, gradients and parameters under the same seed (float64,
1e-10 relative; on CUDA, as one CUDA graph, where independent draws may come in
inductor's order: then the same distribution, in standard errors); bad values
and devices refused before anything changes; a compile that fails, or a step
that writes to a model's buffer, replayed uncompiled after one warning;
fit(capture="compile") passing it through, and fit(capture=None) compiling
where its cost model says the run repays it."""

import functools
import warnings

import pyro
import pytest
import torch
from pyro.infer import SVI, TraceMeanField_ELBO

import pyro_vinit.training.captured as training_captured
import pyro_vinit.training.loop as training_loop
from pyro_vinit import AutoKTiedNormal, CapturedSVI, fit, fit_config
from pyro_vinit.nn import BayesianClassifier, bayesianize, mlp
from pyro_vinit.training._cuda_graph import CudaGraphReplay
from pyro_vinit.training._inductor import compile_pays, graph_size, held_write
from tests.test_captured import PROBLEMS, GradRecorder, _close


def _no_inductor():
    """Why inductor cannot compile here (no C++ compiler), or None."""
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        get_cpp_compiler()
    except Exception as error:
        return f"inductor cannot compile on this host ({type(error).__name__}: {error})"
    return None


def _steps(make_svi, problem="mlp", steps=4, after=3, device="cpu", lr=1e-2, draw_seed=None):
    """Losses and recorded gradients of ``steps`` steps from seed 0 (Adam, ``lr``),
    the parameters after ``after`` steps, and the SVI object; with ``draw_seed``,
    the steps after the first (which sets the guide's parameters up) draw from it."""
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    with torch.device(device):
        model, make_guide, data, handler = PROBLEMS[problem](device)
    optim = GradRecorder(lr)
    svi = make_svi(model, make_guide(model), optim, TraceMeanField_ELBO())
    losses, params = [], None
    for step in range(steps):
        with handler() if handler is not None else warnings.catch_warnings():
            losses.append(svi.step(*data))
        if step == 0 and draw_seed is not None:
            pyro.set_rng_seed(draw_seed)
        if step + 1 == after:
            params = {k: v.detach().clone() for k, v in pyro.get_param_store().items()}
    buffers = {k: v.detach().clone() for k, v in model.named_buffers()}
    return losses, optim.grads, params, buffers, svi


def _float64(fn, *args, **kwargs):
    torch.set_default_dtype(torch.float64)
    try:
        return fn(*args, **kwargs)
    finally:
        torch.set_default_dtype(torch.float32)


def _assert_same_run(eager, other):
    losses, grads, params, buffers, _ = eager
    o_losses, o_grads, o_params, o_buffers, _ = other
    assert _close(losses, o_losses), (losses, o_losses)
    assert len(set(losses)) == len(losses)  # a fresh draw (and parameter) every step
    for step, (g, o) in enumerate(zip(grads, o_grads)):
        assert g.keys() == o.keys(), step
        for name in g:
            assert _close(g[name], o[name]), (step, name)
    assert params.keys() == o_params.keys()
    for name in params:
        assert _close(params[name], o_params[name]), name
    assert buffers.keys() == o_buffers.keys()
    for name in buffers:
        assert _close(buffers[name].double(), o_buffers[name].double()), name


@pytest.mark.skipif(_no_inductor() is not None, reason=str(_no_inductor()))
def test_compiled_step_equals_eager_step(device):
    # exact on the CPU; on CUDA inductor may order the draws its own way (the test below)
    if device.type != "cpu":
        pytest.skip("on CUDA the compiled step draws as the eager one in distribution: "
                    "test_compiled_cuda_step_draws_as_the_eager_step")
    for problem in ["mlp"]:
        eager = _float64(_steps, SVI, problem, device=device)
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # no fallback, no uncompiled replay
            compiled = _float64(_steps, lambda *a: CapturedSVI(*a, compile=True), problem,
                                device=device)
        svi = compiled[-1]
        assert svi.num_traces == 1 and svi.fallback_reason is None
        assert svi.compile_failure is None, problem
        (capture,) = svi._captures.values()
        # inductor's code, not the graph's replay
        assert not isinstance(capture.graph, torch.fx.GraphModule), problem
        assert not isinstance(capture.graph, CudaGraphReplay), problem
        _assert_same_run(eager, compiled)


def _fixed_draws(make_svi, problem, device, steps, draw_seed):
    """The losses and gradients of ``steps`` replays at fixed parameters (lr 0, those of
    seed 0): fresh draws of ``problem``'s step, from ``draw_seed``."""
    losses, grads, _, _, svi = _float64(_steps, make_svi, problem, steps, steps, device=device,
                                        lr=0.0, draw_seed=draw_seed)
    rows = torch.stack([torch.cat([v.flatten() for _, v in sorted(g.items())])
                        for g in grads[2:]])  # the replays only
    return torch.tensor(losses[2:], dtype=torch.float64), rows, svi


def _z(a, b):
    """The difference of the means of ``a`` and ``b`` (rows: draws), in standard errors."""
    se = (a.var(0) / len(a) + b.var(0) / len(b)).sqrt().clamp_min(1e-300)
    return (a.mean(0) - b.mean(0)) / se


@pytest.mark.skipif(_no_inductor() is not None, reason=str(_no_inductor()))
@pytest.mark.parametrize("problem", ["mlp", "cnn", "learned_noise"])
def test_compiled_cuda_step_draws_as_the_eager_step(device, problem):
    # On CUDA inductor takes independent draws (e.g. AutoMeanFieldNormal's weight sites) in
    # an order of its own: not the eager step's values, but the same distribution (loss and
    # gradients within Monte Carlo error of the eager step's at fixed parameters) and the
    # same run for the same seed. On the CPU the compiled step draws exactly as eager.
    if device.type != "cuda":
        pytest.skip("the CPU's compiled step draws as the eager one: "
                    "test_compiled_step_equals_eager_step")
    # independent samples: draws shared by the two (where inductor keeps the eager order)
    # would pull z to 0, draws swapped between sites would bias it either way
    eager_loss, eager_grads, _ = _fixed_draws(SVI, problem, device, 400, draw_seed=1)
    make = functools.partial(CapturedSVI, compile=True)
    loss, grads, svi = _fixed_draws(make, problem, device, 400, draw_seed=2)
    assert svi.compile_failure is None and isinstance(
        next(iter(svi._captures.values())).graph, CudaGraphReplay)
    assert len(set(loss.tolist())) == len(loss)  # fresh draws
    assert _z(loss[:, None], eager_loss[:, None]).abs().item() < 4
    z = _z(grads, eager_grads).abs()  # about N(0, 1) each: E|z| = 0.80
    assert z.mean() < 1.0 and z.max() < 5.5, (z.mean(), z.max())
    again, _, _ = _fixed_draws(make, problem, device, 20, draw_seed=2)
    assert again.tolist() == loss[:18].tolist()  # the same seed, the same run


def test_bad_values_are_refused_at_construction():
    model, make_guide, _, _ = PROBLEMS["mlp"]("cpu")
    guide = make_guide(model)
    for value in ("yes", 1, None):
        with pytest.raises(ValueError, match="compile must be True or False"):
            CapturedSVI(model, guide, pyro.optim.Adam({"lr": 1e-2}), TraceMeanField_ELBO(),
                        compile=value)
    # inductor's code replayed as a CUDA graph, where the step runs on CUDA
    svi = CapturedSVI(model, guide, pyro.optim.Adam({"lr": 1e-2}), TraceMeanField_ELBO(),
                      compile=True, cuda_graph=True)
    assert svi.compile and svi.cuda_graph


def test_data_off_the_cpu_is_refused_before_the_step():
    model, make_guide, (x, y), handler = PROBLEMS["mlp"]("cpu")
    svi = CapturedSVI(model, make_guide(model), pyro.optim.Adam({"lr": 1e-2}),
                      TraceMeanField_ELBO(), compile=True)
    with handler(), pytest.raises(ValueError,
                                  match=r"compile=True.*CPU or a CUDA device.*\['meta'\]"):
        svi.step(x.to("meta"), y.to("meta"))  # a device other than the CPU, on any host
    assert len(pyro.get_param_store()) == 0 and svi.num_traces == 0


def test_a_failed_compile_warns_once_and_replays_uncompiled(monkeypatch):
    calls = []

    def failing(graph, params, tensors):
        calls.append(graph)
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(training_captured, "inductor_compile", failing)
    captured = _float64(_steps, CapturedSVI)
    match = "not compiled .inductor failed: RuntimeError: no C.. compiler"
    with pytest.warns(RuntimeWarning, match=match) as record:
        compiled = _float64(_steps, lambda *a: CapturedSVI(*a, compile=True))
    assert len([w for w in record if "not compiled" in str(w.message)]) == 1
    svi = compiled[-1]
    assert len(calls) == 1 and "no C++ compiler" in svi.compile_failure
    assert svi.fallback_reason is None and svi.num_traces == 1
    (capture,) = svi._captures.values()
    assert isinstance(capture.graph, torch.fx.GraphModule)  # the plain replay
    _assert_same_run(captured, compiled)
    # a second signature: not compiled again, no second warning
    x, y = torch.randn(5, 6, dtype=torch.float64), torch.randint(0, 3, (5,))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        with PROBLEMS["mlp"]("cpu")[3]():
            _float64(lambda: [svi.step(x.double(), y) for _ in range(2)])
    assert len(calls) == 1 and svi.num_traces == 2


def test_inductor_compile_silences_only_deprecation_warnings(monkeypatch):
    # inductor's first import warns of torch's own deprecations, which a user cannot act
    # on (and pytest -W error would turn into a failed compile); its other warnings pass
    from torch.fx.experimental.proxy_tensor import make_fx

    with warnings.catch_warnings():  # the deprecations of inductor's first import
        warnings.simplefilter("ignore", DeprecationWarning)
        import torch._inductor.compile_fx as compile_fx_module

    from pyro_vinit.training._inductor import inductor_compile

    def warning_compile(graph, examples):
        warnings.warn("torch.jit.script_method is deprecated", DeprecationWarning, stacklevel=2)
        warnings.warn("inductor: falling back to an aten kernel", UserWarning, stacklevel=2)
        return graph

    monkeypatch.setattr(compile_fx_module, "compile_fx", warning_compile)
    graph = make_fx(lambda params, tensors: (params[0] * tensors[0],))(
        [torch.ones(2)], [torch.ones(2)])  # called as CapturedSVI's graphs are
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        replay = inductor_compile(graph, [torch.ones(2)], [torch.full((2,), 3.0)])
    assert [w.category for w in record] == [UserWarning]
    assert torch.equal(replay([torch.ones(2)], [torch.full((2,), 3.0)])[0], torch.full((2,), 3.0))


def test_held_write_finds_a_write_to_a_tensor_the_graph_does_not_make():
    from torch.fx.experimental.proxy_tensor import make_fx

    running, out = torch.zeros(4), torch.zeros(2)

    def through_a_view(x):  # a BatchNorm-like update of a slice
        running[:2].add_(x)
        return x * 2

    graph = make_fx(through_a_view)(torch.ones(2))
    names = {id(graph._tensor_constant0): "net.bn.running_mean"}
    suffix = ("; e.g. BatchNorm's running statistics), a write that inductor's compiled "
              "graph would drop")
    assert held_write(graph, names) == ("it writes in place to a tensor it reads (aten.add_."
                                        "Tensor on the buffer 'net.bn.running_mean'" + suffix)
    assert held_write(graph).startswith("it writes in place to a tensor it reads (aten.add_."
                                        "Tensor on _tensor_constant0;")

    def to_an_out_argument(x):  # the written argument a keyword, after one that is not
        torch.mul(x, x, out=out)
        return x + 1

    assert held_write(make_fx(to_an_out_argument)(torch.ones(2))) == (
        "it writes in place to a tensor it reads (aten.mul.out on _tensor_constant0" + suffix)

    def to_an_input(x):
        x.add_(1)
        return x * 2

    assert "(aten.add_.Tensor on x_1;" in held_write(make_fx(to_an_input)(torch.ones(2)))

    def to_its_own_tensor(x):  # max: getitem nodes, operators without a schema
        y = x * 2
        y.add_(1)
        return y, x.max(0)

    assert held_write(make_fx(to_its_own_tensor)(torch.ones(2))) is None


def test_a_step_writing_to_a_buffer_is_replayed_uncompiled(monkeypatch):
    calls = []
    monkeypatch.setattr(training_captured, "inductor_compile",
                        lambda *args: calls.append(args))
    eager = _float64(_steps, SVI, "batchnorm")
    # the buffer named: the model's, as the user knows it
    match = ("not compiled.*writes in place.*the buffer "
             "'net.1.(running_mean|running_var|num_batches_tracked)'.*running statistics")
    with pytest.warns(RuntimeWarning, match=match):
        compiled = _float64(_steps, lambda *a: CapturedSVI(*a, compile=True), "batchnorm")
    assert calls == []  # refused before inductor, which would drop the running statistics
    _assert_same_run(eager, compiled)


def test_fit_capture_compile_passes_it_through(monkeypatch):
    compiled = []

    def recording(graph, params, tensors):  # the functional graph, called as it is
        compiled.append(graph)
        return graph

    monkeypatch.setattr(training_captured, "inductor_compile", recording)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 5, generator=g), torch.arange(64) % 3

    def run(capture):
        pyro.clear_param_store()
        pyro.set_rng_seed(0)
        model = BayesianClassifier(bayesianize(mlp((5, 8, 3))), num_data=64)
        guide = AutoKTiedNormal(model, rank=2)
        history = fit(model, guide, (x, y), steps=6, batch_size=32, capture=capture,
                      init=None, progress=False)
        return history

    plain = run(True)
    assert compiled == []
    through = run("compile")
    assert len(compiled) == 1 and through.captured and through.compiled and not plain.compiled
    assert through.loss == plain.loss and len(set(plain.loss)) == 6
    with pytest.raises(TypeError, match="capture must be"):
        fit(None, None, (x, y), capture="yes")
    pyro.clear_param_store()
    model = BayesianClassifier(bayesianize(mlp((5, 8, 3))), num_data=64)
    guide = AutoKTiedNormal(model, rank=2)
    with pytest.raises(ValueError, match="capture='compile' is measured on the CPU and CUDA "
                                         "only; the data is on meta"):
        fit(model, guide, (x.to("meta"), y.to("meta")), steps=2, capture="compile",
            progress=False)
    assert len(pyro.get_param_store()) == 0 and guide.prototype_trace is None


# ---- fit's own choice: compile a long CPU run ---------------------------------------------


def test_graph_size_counts_operators_and_the_elements_they_write():
    from torch.fx.experimental.proxy_tensor import make_fx

    graph = make_fx(lambda a, b: ((a * 2).sum(0), b.t()))(torch.ones(3, 4), torch.ones(2, 5))
    # mul writes 12, sum 4, t 10 (a view: counted as written, as a replay allocates it)
    assert graph_size(graph) == (3, 26)


def test_compile_pays_where_the_projected_saving_repays_the_compile_twice():
    from torch.fx.experimental.proxy_tensor import make_fx

    graph = make_fx(lambda a: (a * 2).sum())(torch.ones(1000, 1000))  # 2 ops, 1000001 elements
    saved = 2 * 2.5e-6 + 1000001 * 1.3e-10  # seconds a step
    cost = 21.0 + 2 * 6e-3
    threshold = 2 * cost / saved  # about 314,000 steps
    assert not compile_pays(graph, int(threshold) - 1)
    assert compile_pays(graph, int(threshold) + 1)


def test_compile_pays_from_exactly_twice_the_cost(monkeypatch):
    # "at least twice": a saving of exactly twice the compile's cost compiles (a cost
    # model of round numbers, so that the products are exact)
    from torch.fx.experimental.proxy_tensor import make_fx

    import pyro_vinit.training._inductor as inductor

    monkeypatch.setitem(inductor._COST_MODELS, "cpu", inductor._CostModel(0.5, 0.0, 3.0, 1.0))
    graph = make_fx(lambda a: (a * 2).sum())(torch.ones(4))  # 2 operators: cost 5, saved 1
    assert compile_pays(graph, 10) and not compile_pays(graph, 9)


def _fake_cuda_graph(step):
    """``step`` of a 1000 x 1000 tensor traced on CUDA (fake tensors: no GPU needed)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    with FakeTensorMode():
        a = torch.empty(1000, 1000, device="cuda")
    return make_fx(step, tracing_mode="fake")(a)


def test_compile_pays_on_cuda_by_cuda_cost_model():
    # the saving and cost fitted to gpu_check's MLP on an H100 and an H200; a CPU scalar
    # (Pyro's plate makes its zero log-density on the CPU) does not count as a device
    graph = _fake_cuda_graph(lambda a: (a * 2).sum() + torch.zeros(()))
    assert {n.meta["val"].device.type for n in graph.graph.nodes if "val" in n.meta} == {
        "cuda", "cpu"}
    operators, elements = graph_size(graph)
    assert operators == 4 and elements == 1000003  # mul, sum, zeros, add
    saved = 4 * 1.25e-6 + 1000003 * 1e-12  # seconds a step
    cost = 17.0 + 4 * 6e-3
    threshold = 2 * cost / saved  # about 5.7 million steps
    assert not compile_pays(graph, int(threshold) - 1)
    assert compile_pays(graph, int(threshold) + 1)
    # a CPU tensor with elements made from constants: replayed as captured, a CUDA graph;
    # an empty CPU constant too (Pyro's step holds one, found on the H200)
    made = _fake_cuda_graph(lambda a: ((a * 2).sum(), torch.zeros(3)))
    assert compile_pays(made, 10**12)
    empty = _fake_cuda_graph(lambda a: (a * 2).sum() + torch.tensor([]).sum())
    assert compile_pays(empty, 10**12)
    # a draw on the CPU that the step reads: not one CUDA graph, not compiled
    mixed = _fake_cuda_graph(lambda a: (a * 2).sum() + torch.randn(3).sum().to(a.device))
    assert not compile_pays(mixed, 10**12)


def test_compile_pays_never_for_a_graph_on_two_devices_or_another_device():
    # a model on CUDA that moves fit's CPU data there: the data's device alone would allow
    # a compile, which would not be replayed as a CUDA graph
    from torch.fx.experimental.proxy_tensor import make_fx

    def step(w, x):
        return (x.to(w.device) * w).sum()

    on_cpu = make_fx(step)(torch.ones(1000, 1000), torch.ones(1000, 1000))
    assert compile_pays(on_cpu, 10**9)
    parameter_off = make_fx(step)(torch.ones(1000, 1000, device="meta"), torch.ones(1000, 1000))
    assert not compile_pays(parameter_off, 10**9)
    elsewhere = make_fx(step)(torch.ones(1000, 1000, device="meta"),
                              torch.ones(1000, 1000, device="meta"))
    assert not compile_pays(elsewhere, 10**9)  # no cost model measured there


def test_compile_pays_for_the_docs_example():
    # the MLP 64-400-400-10 at batch 1000 (the method page's example): fit compiles
    # for 11,000 steps left, not for 10,000
    pyro.clear_param_store()
    model = BayesianClassifier(bayesianize(mlp((64, 400, 400, 10))), num_data=5000)
    x, y = torch.randn(1000, 64), torch.arange(1000) % 10
    guide = AutoKTiedNormal(model, rank=2)
    config = fit_config(guide, kl_weight=0.01)
    svi = CapturedSVI(model, guide, config.optimizer(), config.elbo())
    for _ in range(2):  # eager, then traced
        with config.handlers():
            svi.step(x, y)
    (graph,) = svi._graphs()
    assert not compile_pays(graph, 10_000) and compile_pays(graph, 11_000)


def _fit_run(monkeypatch, problem="mlp", steps=8, pays=lambda graph, steps: True,
             compile=None, capture=None, num_data=32, loader=False):
    """fit's losses from seed 0, and the graphs "compiled" (the functional graph
    itself by default: replayed as it is)."""
    compiled = []

    def recording(graph, params, tensors):
        compiled.append(graph)
        return graph if compile is None else compile(graph, params, tensors)

    monkeypatch.setattr(training_captured, "inductor_compile", recording)
    decided = []

    def deciding(graph, steps):
        decided.append(steps)
        return pays(graph, steps)

    monkeypatch.setattr(training_loop, "compile_pays", deciding)
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(num_data, 5, generator=g), torch.arange(num_data) % 3
    net = (mlp((5, 8, 3)) if problem == "mlp" else
           torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(),
                               torch.nn.Linear(8, 3)))
    model = BayesianClassifier(bayesianize(net), num_data=num_data)
    data = [(x[i:i + 16], y[i:i + 16]) for i in range(0, num_data, 16)] if loader else (x, y)
    history = fit(model, AutoKTiedNormal(model, rank=2), data, steps=steps, batch_size=16,
                  capture=capture, init=None, progress=False)
    return history, compiled, decided


def test_fit_compiles_a_run_whose_saving_repays_the_compile(monkeypatch):
    plain, compiled, decided = _fit_run(monkeypatch, capture=True)
    assert not plain.compiled and compiled == [] and decided == []
    monkeypatch.setattr(training_loop, "_CAPTURE_MIN_STEPS", {"cpu": 1})
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        chosen, compiled, decided = _fit_run(monkeypatch)
    # decided once, after step 2 traced the graph: on the 6 steps left
    assert decided == [6] and len(compiled) == 1
    assert chosen.captured and chosen.compiled
    assert chosen.loss == plain.loss and len(set(plain.loss)) == 8


@pytest.mark.parametrize("loader", [False, True])
@pytest.mark.parametrize("num_data, captured_left", [(40, 6), (12, 10)])
def test_fit_projects_the_saving_over_the_captured_steps_left(monkeypatch, loader, num_data,
                                                              captured_left):
    # 40 rows in batches of 16: the third batch of each epoch (8 rows) takes the eager
    # step, so of the 10 steps left after the trace, 10 * 2 // 3 = 6 are captured;
    # 12 rows: every batch is the first's shape
    monkeypatch.setattr(training_loop, "_CAPTURE_MIN_STEPS", {"cpu": 1})
    history, compiled, decided = _fit_run(monkeypatch, steps=12, num_data=num_data,
                                          loader=loader)
    assert decided == [captured_left] and len(compiled) == 1 and history.compiled


def test_fit_does_not_compile_where_the_run_is_too_short(monkeypatch):
    monkeypatch.setattr(training_loop, "_CAPTURE_MIN_STEPS", {"cpu": 1})
    history, compiled, decided = _fit_run(monkeypatch, pays=compile_pays)
    assert decided == [6] and compiled == [] and history.captured and not history.compiled


def test_fit_leaves_a_step_that_writes_a_buffer_uncompiled_without_a_warning(monkeypatch):
    monkeypatch.setattr(training_loop, "_CAPTURE_MIN_STEPS", {"cpu": 1})
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # nobody asked for the compile
        history, compiled, decided = _fit_run(monkeypatch, problem="batchnorm")
    assert decided == [6] and compiled == [] and not history.compiled and history.captured


def test_fit_warns_once_where_its_compile_fails(monkeypatch):
    monkeypatch.setattr(training_loop, "_CAPTURE_MIN_STEPS", {"cpu": 1})

    def failing(graph, params, tensors):
        raise RuntimeError("no C++ compiler")

    with pytest.warns(RuntimeWarning, match="fit: the step of this long run is not compiled "
                      r"\(inductor failed: RuntimeError: no C\+\+ compiler\).*replayed "
                      r"uncompiled \(pass capture=True to skip the attempt\)") as record:
        history, compiled, _ = _fit_run(monkeypatch, compile=failing)
    assert len([w for w in record if "not compiled" in str(w.message)]) == 1
    assert record[0].filename == __file__  # the warning points at fit's caller
    assert len(compiled) == 1 and history.captured and not history.compiled


def test_history_compiled_only_where_a_step_ran_compiled(monkeypatch):
    # capture="compile" asks for it, but one step is eager: nothing was compiled
    history, compiled, _ = _fit_run(monkeypatch, steps=1, capture="compile")
    assert history.captured and compiled == [] and not history.compiled
    history, compiled, _ = _fit_run(monkeypatch, steps=2, capture="compile")
    assert len(compiled) == 1 and history.compiled


def test_fit_never_compiles_when_told_not_to(monkeypatch):
    monkeypatch.setattr(training_loop, "_CAPTURE_MIN_STEPS", {"cpu": 1})
    history, compiled, decided = _fit_run(monkeypatch, capture=True)
    assert decided == [] and not history.compiled
    history, compiled, decided = _fit_run(monkeypatch, capture=False)
    assert decided == [] and compiled == [] and not history.captured


class _FakeCudaGraph:
    """Stands in for CudaGraphReplay on the CPU: runs the warm-up (its draws and
    buffer writes) as the real one does, then calls the step it was given."""

    def __init__(self, replay, params, tensors, device):
        replay(params, [t.clone() for t in tensors])  # the warm-up
        self.replay = replay

    def __call__(self, params, tensors):
        return self.replay(params, tensors)


class _FailingCudaGraph(_FakeCudaGraph):
    def __init__(self, replay, params, tensors, device):
        super().__init__(replay, params, tensors, device)
        raise RuntimeError("operation not permitted when stream is capturing")


@pytest.mark.parametrize("replay", [_FakeCudaGraph, _FailingCudaGraph])
def test_compiled_step_in_a_cuda_graph_restores_the_warm_up(monkeypatch, replay):
    # the CUDA path's order on the CPU: inductor's compile (a stand-in), then the CUDA
    # graph's warm-up, which draws; captured or not, the step draws as the eager one
    def compiled(graph, params, tensors):
        return lambda p, t: graph(p, t)

    monkeypatch.setattr(training_captured, "inductor_compile", compiled)
    monkeypatch.setattr(training_captured, "CudaGraphReplay", replay)
    monkeypatch.setattr(training_captured, "off_device", lambda graph, device: None)
    monkeypatch.setattr(CapturedSVI, "_graph_device", lambda self, p, t: torch.device("cuda"))
    eager = _float64(_steps, SVI)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        other = _float64(_steps, lambda *a: CapturedSVI(*a, compile=True))
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    svi = other[-1]
    assert svi.compile_failure is None and svi.num_traces == 1
    (capture,) = svi._captures.values()
    if replay is _FailingCudaGraph:
        # inductor's code called as it is: not "operator by operator", which it is not
        (message,) = messages
        assert "compiled step runs" in message and "not as a CUDA graph" in message
        assert "operator by operator" not in message and "stream is capturing" in message
        assert not isinstance(capture.graph, (torch.fx.GraphModule, _FakeCudaGraph))
    else:
        assert messages == [] and isinstance(capture.graph, _FakeCudaGraph)
    assert svi._graphs() == []  # compiled: nothing left for fit to compile
    _assert_same_run(eager, other)


def test_an_uncompiled_cuda_graph_is_offered_to_fits_cost_model(monkeypatch):
    # fit decides on the traced graph under the CUDA graph (a stand-in here), then
    # compiles from the next step: traced again, compiled, captured as a CUDA graph again
    monkeypatch.setattr(training_captured, "CudaGraphReplay", _FakeCudaGraph)
    monkeypatch.setattr(training_captured, "off_device", lambda graph, device: None)
    monkeypatch.setattr(CapturedSVI, "_graph_device", lambda self, p, t: torch.device("cuda"))
    compiled = []

    def compile_(graph, params, tensors):
        compiled.append(graph)
        return lambda p, t: graph(p, t)

    monkeypatch.setattr(training_captured, "inductor_compile", compile_)
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    model, make_guide, data, _ = PROBLEMS["mlp"]("cpu")
    svi = CapturedSVI(model, make_guide(model), GradRecorder(1e-2), TraceMeanField_ELBO())
    for _ in range(2):  # eager, then traced and captured
        svi.step(*data)
    (capture,) = svi._captures.values()
    (graph,) = svi._graphs()
    assert isinstance(capture.graph, _FakeCudaGraph) and graph is capture.uncompiled
    assert graph_size(graph)[0] > 20 and compiled == []
    svi._compile_from_next_step()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        svi.step(*data)
    (capture,) = svi._captures.values()
    assert len(compiled) == 1 and svi.compile_failure is None
    assert isinstance(capture.graph, _FakeCudaGraph) and capture.uncompiled is None
    assert svi._graphs() == []


@pytest.mark.skipif(_no_inductor() is not None, reason=str(_no_inductor()))
def test_fit_compiles_a_long_cuda_run(device, monkeypatch):
    # capture=None on CUDA: CUDA graph first, fit's cost model on its traced graph, then
    # inductor's code captured as a CUDA graph from the next step; the same run per seed
    if device.type != "cuda":
        pytest.skip("the CPU's automatic compile: test_fit_compiles_a_run_whose_saving_...")
    monkeypatch.setattr(training_loop, "_CAPTURE_MIN_STEPS", {"cuda": 1})
    offered = []

    def deciding(graph, steps):  # the real model, then a run long enough to repay it
        offered.append((compile_pays(graph, steps), compile_pays(graph, 10**9)))
        return True

    monkeypatch.setattr(training_loop, "compile_pays", deciding)
    runs = []
    for _ in range(2):
        pyro.clear_param_store()
        pyro.set_rng_seed(0)
        x = torch.randn(64, 5, device=device)
        y = torch.arange(64, device=device) % 3
        model = BayesianClassifier(bayesianize(mlp((5, 8, 3))), num_data=64).to(device)
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            history = fit(model, AutoKTiedNormal(model, rank=2), (x, y), steps=8,
                          batch_size=32, init=None, progress=False)
        runs.append(history.loss)
    assert offered == [(False, True)] * 2  # 6 steps left: far too few
    assert history.captured and history.compiled
    assert all(torch.isfinite(torch.tensor(run)).all() for run in runs)
    assert runs[0] == runs[1] and len(set(runs[0])) == len(runs[0])
