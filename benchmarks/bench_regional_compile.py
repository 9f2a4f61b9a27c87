"""
Issue 25, item 2: does ``torch.compile``'s inductor, applied to the pure
pieces of fit's captured step, make the CPU step faster, and at what compile
time? Side by side in one run, on the step :func:`~pyro_vinit.fit` takes
(``AutoKTiedNormal(rank=2)`` under ``fit_config(guide).handlers()``, i.e.
``local_reparam()`` and the KL weight, :class:`~pyro_vinit.GroupedAdam`,
:class:`~pyro_vinit.CapturedSVI`), on the MLP 64→400→400→10 (scikit-learn
digits), one thread:

* *replay*: ``CapturedSVI`` as the library runs it (the traced graph of aten
  operators replayed, dead buffers overwritten in place);
* *regional*: the same graph (before the in-place rewrite) partitioned by
  ``torch.fx``'s ``CapabilityBasedPartitioner`` into maximal regions of
  pure operators other than matrix products, indexing and random draws
  (elementwise operators, reductions, views), each region of two or more
  computing operators compiled by inductor (``compile_fx``); the products,
  the draws and the rest run eagerly, as in the replay;
* *whole graph*: the whole graph compiled by inductor, with
  ``fallback_random`` (the random draws stay PyTorch's, so the draws are
  the eager step's) and inductor's default CPU matrix products (``aten``'s,
  called from the compiled code);
* *library*: ``CapturedSVI(compile=True)``, the library's own path to the
  whole graph compiled (its compile timed as its tracing step: trace,
  compile and first replay, with inductor's caches off);
* bayesian-torch's ``LinearReparameterization`` MLP, the issue's reference.

Also: the compile time of each (one compile thread, inductor's caches in a
fresh, empty folder: the first compile of the graph, and the same graph
compiled again, from those caches; inductor's start-up is timed apart, on
a trivial function compiled first), the loss and gradients of each compiled graph
against the eager step's under the same seed (float64 and float32), and
where the replay's time goes (``torch.profiler``: self CPU time of its
operators, grouped).

Usage::

    python -m benchmarks.bench_regional_compile            # full run (about 10 minutes)
    python -m benchmarks.bench_regional_compile --quick    # smoke run, no files
"""

import contextlib
import copy
import os
import shutil
import tempfile
import time

import pyro
import torch
import torch.utils._pytree as pytree
from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner
from torch.fx.passes.operator_support import OperatorSupportBase
from torch.profiler import ProfilerActivity, profile

import pyro_vinit.training.captured as captured_module
from benchmarks._steps import (
    BAYESIAN_TORCH,
    BAYESIAN_TORCH_MISSING,
    LinearReparameterization,
    bayesian_torch_step,
    make_model,
)
from benchmarks.harness import (
    host_info,
    make_parser,
    markdown_table,
    parse_args,
    result_stem,
    set_threads,
    time_interleaved,
    write_report,
)
from pyro_vinit import AutoKTiedNormal, CapturedSVI, GroupedAdam, fit_config
from pyro_vinit.data import load_digits

SIZES = (64, 400, 400, 10)
BATCHES = (128, 1000)

BT = "bayesian-torch LinearReparameterization"
REPLAY = "fit's step, CapturedSVI (replay)"
REGIONAL = "fit's step, CapturedSVI + inductor on the elementwise regions"
WHOLE = "fit's step, CapturedSVI + inductor on the whole graph"
LIBRARY = "fit's step, CapturedSVI(compile=True)"
VARIANTS = {REGIONAL: "regional", WHOLE: "whole", LIBRARY: "library"}
#: Largest relative difference from the eager step a graph may show, by dtype:
#: (loss, gradients); beyond it the run stops.
TOLERANCE = {torch.float64: (1e-10, 1e-10), torch.float32: (1e-3, 1e-4)}
RATIOS = [(REGIONAL, REPLAY), (WHOLE, REPLAY), (LIBRARY, REPLAY), (LIBRARY, WHOLE), (REPLAY, BT),
          (REGIONAL, BT), (WHOLE, BT), (LIBRARY, BT)]

_aten = torch.ops.aten
#: Kept out of the regions: matrix products, indexing and scattering, constants.
KEPT_EAGER = {
    _aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.dot.default,
    _aten.vdot.default, _aten.index.Tensor, _aten.index_put.default, _aten.gather.default,
    _aten.scatter_add.default, _aten.lift_fresh_copy.default, _aten.arange.default,
}
#: Operators that compute nothing (a region needs two others to be compiled).
VIEWS = {
    _aten.t.default, _aten.transpose.int, _aten.view.default, _aten.expand.default,
    _aten.unsqueeze.default, _aten.squeeze.dim, _aten.select.int, _aten.slice.Tensor,
    _aten.detach.default, _aten.alias.default,
}

#: Where the profiled self CPU time goes, by operator name.
GROUPS = {
    "matrix products": ("aten::mm", "aten::addmm", "aten::bmm", "aten::dot", "aten::vdot"),
    "random draws": ("aten::normal_", "aten::uniform_", "aten::random_", "aten::bernoulli_"),
    "reductions": ("aten::sum", "aten::logsumexp", "aten::mean", "aten::amax"),
    "optimizer": ("aten::_fused_adam_", "Optimizer.step"),
}


class PureRegions(OperatorSupportBase):
    """The aten operators a region may hold: pure (no mutation, no random
    draw), not a matrix product, an indexing or a constant."""

    def is_node_supported(self, submodules, node):
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
            return False
        return (target not in KEPT_EAGER and not target._schema.is_mutable
                and torch.Tag.nondeterministic_seeded not in target.tags)


class _Compiled(torch.nn.Module):
    """A compiled region, as a submodule of the partitioned graph."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


def _example(value):
    """A real tensor like ``value`` (a node's fake tensor), for inductor."""
    out = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype,
                              device=value.device)
    return out.zero_()


def compile_regions(graph):
    """``graph`` (functional) with its pure regions compiled by inductor;
    also the number of computing operators of each compiled region."""
    from torch._inductor.compile_fx import compile_fx

    partitioner = CapabilityBasedPartitioner(graph, PureRegions(),
                                             allows_single_node_partition=True)
    regions = [p for p in partitioner.propose_partitions()
               if sum(n.target not in VIEWS for n in p.nodes) >= 2]
    fused = partitioner.fuse_partitions(regions, prefix="region_")
    sizes = []
    for node in list(fused.graph.nodes):
        if node.op == "call_module" and node.target.startswith("region_"):
            sub = getattr(fused, node.target)
            sizes.append(sum(n.op == "call_function" and n.target not in VIEWS
                             for n in sub.graph.nodes))
            inputs = [_example(a.meta["val"]) for a in node.args]
            with torch.no_grad():
                setattr(fused, node.target, _Compiled(compile_fx(sub, inputs)))
    captured_module.reuse_dead_buffers(fused)  # the rest in place, as the library's replay
    return fused, sizes


def compile_whole(graph, params, tensors):
    """``graph`` compiled whole by inductor, called as the replay calls it."""
    from torch._inductor import config
    from torch._inductor.compile_fx import compile_fx

    out_spec = graph.graph._codegen.pytree_info.out_spec
    flat = copy.deepcopy(graph)
    flat.graph._codegen = torch.fx.graph.CodeGen()  # flat inputs and outputs
    flat.recompile()
    inputs = [_example(t) for t in pytree.tree_leaves((params, tensors))]
    with torch.no_grad(), config.patch(fallback_random=True):
        compiled = compile_fx(flat, inputs)

    def replay(params, tensors):
        return pytree.tree_unflatten(list(compiled(*pytree.tree_leaves((params, tensors)))),
                                     out_spec)

    return replay


@contextlib.contextmanager
def functional_graphs():
    """The graphs ``CapturedSVI`` traces meanwhile, collected before its
    in-place rewrite (which is skipped)."""
    graphs = []
    rewrite = captured_module.reuse_dead_buffers
    captured_module.reuse_dead_buffers = graphs.append
    try:
        yield graphs
    finally:
        captured_module.reuse_dead_buffers = rewrite


def fit_step(x, y, num_data, variant=None, again=False, cold=False):
    """One step as :func:`~pyro_vinit.fit` takes it, captured, its replayed
    graph compiled as ``variant`` says (None: the library's replay;
    ``"library"``: ``CapturedSVI(compile=True)``); the first two steps are
    taken here. Returns ``(step, parts)``: ``parts``
    holds the model, guide, handlers' config, the capture and the compile
    seconds (with ``again``, also those of compiling the same graph a second
    time, from inductor's caches; with ``cold``, the library's compile runs
    with inductor's caches off: the same graph was compiled before)."""
    from torch._inductor import config as inductor_config

    model = make_model(SIZES, num_data)
    guide = AutoKTiedNormal(model, rank=2)
    config = fit_config(guide)
    library = variant == "library"
    svi = CapturedSVI(model, guide, GroupedAdam({"lr": 1e-3}), config.elbo(), compile=library)

    def step():
        with config.handlers():
            return svi.step(x, y)

    step()
    caches_off = inductor_config.patch(force_disable_caches=True) if library and cold \
        else contextlib.nullcontext()
    start = time.perf_counter()
    with functional_graphs() if variant and not library else contextlib.nullcontext([]) \
            as graphs, caches_off:
        step()
    seconds = time.perf_counter() - start
    assert svi.num_traces == 1, svi.fallback_reason
    assert svi.compile_failure is None, svi.compile_failure
    capture = next(iter(svi._captures.values()))
    parts = {"model": model, "guide": guide, "config": config, "capture": capture,
             "compile_s": seconds if library else None, "compile_again_s": None,
             "regions": None}
    if variant and not library:
        (graph,) = graphs
        seconds = []
        for _ in range(2 if again else 1):  # again: from inductor's caches
            start = time.perf_counter()
            if variant == "regional":
                capture.graph, parts["regions"] = compile_regions(copy.deepcopy(graph))
            else:
                capture.graph = compile_whole(graph, capture.params, [x, y])
            seconds.append(time.perf_counter() - start)
        parts["compile_s"] = seconds[0]
        parts["compile_again_s"] = seconds[1] if again else None
    return step, parts


def eager_loss_and_grads(parts, x, y):
    """The eager step's loss and gradients of the capture's parameters."""
    capture, config = parts["capture"], parts["config"]
    with config.handlers():
        loss = config.elbo().differentiable_loss(parts["model"], parts["guide"], x, y)
    grads = torch.autograd.grad(loss, capture.params, allow_unused=True)
    return loss.detach(), grads


def agreement(x, y, num_data, dtype, seed=7, variants=VARIANTS):
    """Largest relative difference of the loss and of each gradient (to its
    largest element) between each graph (the library's replay, the control,
    and each compiled one of ``variants``) and the eager step, under the same
    seed."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        x = x.to(dtype)
        out = {}
        for name, variant in {REPLAY: None, **variants}.items():
            pyro.set_rng_seed(0)
            _, parts = fit_step(x, y, num_data, variant)
            params = parts["capture"].params
            torch.manual_seed(seed)
            loss, grads = eager_loss_and_grads(parts, x, y)
            torch.manual_seed(seed)
            with torch.no_grad():
                c_loss, c_grads = parts["capture"].graph(params, [x, y])
            worst = max((c - e).abs().max().item() / e.abs().max().item()
                        for c, e in zip(c_grads, grads) if e is not None)
            out[name] = {"loss": abs(c_loss.item() - loss.item()) / abs(loss.item()),
                         "gradient": worst}
            if out[name]["loss"] > TOLERANCE[dtype][0] or worst > TOLERANCE[dtype][1]:
                raise AssertionError(f"{name}, {dtype}: loss and gradients differ from the "
                                     f"eager step's by {out[name]} (tolerance "
                                     f"{TOLERANCE[dtype]}, relative)")
        return out
    finally:
        torch.set_default_dtype(previous)


def group_of(name):
    for group, prefixes in GROUPS.items():
        if name.startswith(prefixes):
            return group
    if "cpp_fused" in name or "Compiled" in name or "Torch-Compiled" in name:
        return "compiled code"
    return "elementwise, views, other operators"


def where_time_goes(step, steps):
    """Wall time per step and self CPU time of the profiled operators per
    step, by group (ms)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            step()
        wall = time.perf_counter() - start
    groups = dict.fromkeys([*GROUPS, "compiled code", "elementwise, views, other operators"], 0.0)
    for event in prof.key_averages():
        groups[group_of(event.key)] += event.self_cpu_time_total / 1e3 / steps
    return {"wall_ms": 1e3 * wall / steps, "groups_ms": groups}


def configurations(batch, x, y, num_data, again=True, variants=VARIANTS):
    xb, yb = x[:batch], y[:batch]
    configs, compiled = {}, {}
    if BAYESIAN_TORCH is not None:
        configs[BT] = bayesian_torch_step(LinearReparameterization, SIZES, xb, yb, num_data)
    configs[REPLAY], _ = fit_step(xb, yb, num_data)
    for name, variant in variants.items():
        configs[name], parts = fit_step(xb, yb, num_data, variant, again=again, cold=True)
        compiled[name] = {key: parts[key] for key in ("compile_s", "compile_again_s",
                                                      "regions")}
    return configs, compiled


def report(results, host, load_end):
    config = results["config"]
    lines = ["## Ratios of step times (median of per-round ratios, range over rounds)", ""]
    rows = []
    for batch, r in results["batches"].items():
        for row in r["ratios"]:
            v = row["ratio"]
            rows.append([f"{row['numerator']} ÷ {row['denominator']}", batch,
                         f"{v['median']:.2f} ({v['low']:.2f}–{v['high']:.2f})"])
    lines.append(markdown_table(["ratio", "batch", "value"], rows))
    if results["bayesian_torch"] is None:
        lines += ["", BAYESIAN_TORCH_MISSING]
    for batch, r in results["batches"].items():
        lines += ["", f"## batch {batch}: step time and compile time", ""]
        rows = []
        for name, ms in r["times"]["median_ms"].items():
            c = r["compiled"].get(name, {})
            regions = c.get("regions")
            rows.append([name, f"{ms:.2f}",
                         "—" if c.get("compile_s") is None else f"{c['compile_s']:.1f} / "
                         + ("—" if c["compile_again_s"] is None else f"{c['compile_again_s']:.1f}"),
                         "—" if not regions else f"{len(regions)} ({sum(regions)} operators)"])
        lines.append(markdown_table(["configuration", "ms per step (median)",
                                     "compile s (cold / again, cached)",
                                     "compiled regions"], rows))
        lines += ["", f"## batch {batch}: where the time goes (ms per step; self CPU time "
                      "of the profiled operators)", ""]
        names = list(r["profile"])
        groups = list(next(iter(r["profile"].values()))["groups_ms"])
        rows = [[g] + [f"{r['profile'][n]['groups_ms'][g]:.2f}" for n in names] for g in groups]
        rows.append(["all operators"] + [f"{sum(r['profile'][n]['groups_ms'].values()):.2f}"
                                         for n in names])
        rows.append(["wall time"] + [f"{r['profile'][n]['wall_ms']:.2f}" for n in names])
        lines.append(markdown_table(["group"] + names, rows))
    lines += ["", "## Compiled against the eager step, same seed (relative difference: loss; "
                  "gradients, to each one's largest element)", ""]
    rows = []
    for dtype, r in results["agreement"].items():
        for name, a in r.items():
            rows.append([dtype, name, f"{a['loss']:.1e}", f"{a['gradient']:.1e}"])
    lines.append(markdown_table(["dtype", "configuration", "loss", "gradients"], rows))
    lines += ["", f"MLP {'→'.join(map(str, SIZES))}, validation on, {config['threads']} "
                  f"thread(s), {config['rounds']} rounds × {config['block']} steps; inductor "
                  f"with one compile thread, its caches in a fresh folder (cold: the first "
                  f"compile of a graph; again: the same graph compiled a second time, in the "
                  f"same process; for {LIBRARY}, its whole tracing step (trace, compile "
                  f"and first replay), with inductor's caches off), its start-up "
                  f"({results['inductor_startup_s']:.1f} s, a "
                  f"trivial function compiled first) not counted; torch {host['torch']}, Pyro "
                  f"{host['pyro']}, bayesian-torch {results['bayesian_torch'] or 'not installed'}; "
                  f"load average (1, 5, 15 min) at the start {tuple(host['load_average'])}, at "
                  f"the end {tuple(load_end)}, on {host['cpu_count']} cores."]
    return "\n".join(lines)


def main(args):
    set_threads(args.threads)
    cache = tempfile.mkdtemp(prefix="inductor_cold_")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache  # read at inductor's first compile
    from torch._inductor import config as inductor_config

    inductor_config.compile_threads = 1
    start = time.perf_counter()  # inductor's start-up (imports, compiler checks), once
    torch.compile(lambda t: t.exp() + 1, backend="inductor")(torch.zeros(3))
    startup_s = time.perf_counter() - start
    pyro.settings.set(module_local_params=True)  # guides side by side, as nn.Modules
    host = host_info()
    x, y, _, _ = load_digits()
    # the smoke run leaves out the whole-graph control (the library's own path compiles
    # the whole graph)
    variants = {k: v for k, v in VARIANTS.items() if k != WHOLE} if args.quick else VARIANTS
    results = {"config": vars(args), "sizes": SIZES, "bayesian_torch": BAYESIAN_TORCH,
               "inductor_startup_s": startup_s, "batches": {}, "agreement": {}}
    try:
        with pyro.validation_enabled(True):
            for batch in args.batches:
                pyro.set_rng_seed(0)
                configs, compiled = configurations(batch, x, y, len(x), again=not args.quick,
                                                   variants=variants)
                timings = time_interleaved(configs, rounds=args.rounds, block=args.block,
                                           warmup=args.warmup)
                results["batches"][batch] = {
                    "compiled": compiled,
                    "times": timings.to_dict(),
                    "ratios": [{"numerator": n, "denominator": d,
                                "ratio": timings.ratio(n, d).to_dict()}
                               for n, d in RATIOS if n in configs and d in configs],
                    "profile": {name: where_time_goes(step, args.block)
                                for name, step in configs.items()},
                }
                print(f"  batch {batch} done", flush=True)
            batch = args.batches[0]
            for dtype in (torch.float64,) if args.quick else (torch.float64, torch.float32):
                results["agreement"][str(dtype)] = agreement(
                    x[:batch], y[:batch], len(x), dtype,
                    variants=variants)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    text = report(results, host, host_info()["load_average"])
    print(text)
    if not args.quick:
        write_report(result_stem(args, "bench_regional_compile"), results, text,
                     host_start=host)
    return results


if __name__ == "__main__":
    parser = make_parser(__doc__, timing=(10, 10, 3))
    parser.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    main(parse_args(parser, quick={"rounds": 2, "block": 1, "warmup": 1, "batches": [32]}))
