"""
The cost curve: training-step time and peak memory against layer width and
against batch size, for a deterministic network, bayesian-torch and Pyro
guides, and I-BLM's initialization time and peak memory against width and
against the number of data rows.

*Steps.* A ReLU MLP 64→w→w→10 (N(0, 1/D_in) priors), random inputs, with
w = 100 … 3200 at batch 128 and batch 32 … 4096 at w = 400; configurations:
a deterministic ``nn`` Adam step, bayesian-torch's
``LinearReparameterization`` (skipped, with a note, when it is not
installed), and Pyro's ``AutoNormal``, ``AutoKTiedNormal(rank=2)`` without
and with ``local_reparam()``, ``AutoRadialNormal`` without and with
``flipout()``, all through Pyro's PyTorch-native loop
(``TraceMeanField_ELBO()(model, guide)`` and one ``torch.optim.Adam``),
Pyro's validation off. At each grid point the configurations are timed in
interleaved rounds (``benchmarks/harness.py``); then each runs once
more under a dispatch-level counter of its operators, their FLOPs (matrix
products exactly, one per element for the rest) and the bytes they read and
write. Peak memory is measured in a fresh process per configuration and
grid point (forked from a server that has imported everything, so that
peaks do not mix): the growth of the high-water mark of resident memory
over the process's start, through the model's and guide's set-up and two
steps.

*Fits.* Per configuration, the exponent of time and memory against width
or batch (least squares on log-log over the upper half of the grid); and
:math:`t \\approx a + b\\,F` with F the counted FLOPs of a step
(``harness.fit_fixed_and_rate``): ``a`` is the
per-step cost that does not grow with the arithmetic (Python, Pyro's
tracing, the handlers, the optimizer's per-parameter work), and the
crossover is where ``b F`` overtakes it. *A GPU model* (nothing here runs
on a GPU): the step's host time is ``a`` plus a launch cost per operator,
its device time the sum over operators of max(FLOPs / peak FLOP/s, bytes /
bandwidth), and the step takes the larger of the two, since CUDA runs
asynchronously.

*I-BLM.* An MLP 20-h-h-3 (ReLU), AutoNormal, ``init_guide_iblm`` with its
defaults on Gaussian blobs: h = 125 … 4000 on 500 rows, and 250 … 16 000
rows at h = 1000; each in a fresh process, which reports the wall time of
the initialization and the peak resident memory after setting the guide up
and after I-BLM.

Usage::

    python -m benchmarks.bench_scaling --threads 1   # full run (a few minutes)
    python -m benchmarks.bench_scaling --quick       # smoke run (no files unless --out)
"""

import math
import multiprocessing
import os
import resource
import time

import pyro
import torch
from pyro.infer.autoguide import AutoNormal
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

from benchmarks._steps import (
    BAYESIAN_TORCH,
    BAYESIAN_TORCH_MISSING,
    LinearReparameterization,
    bayesian_torch_step,
    deterministic_step,
    make_model,
    native_step,
)
from benchmarks.harness import (
    fit_exponent,
    fit_fixed_and_rate,
    host_info,
    make_parser,
    markdown_table,
    parse_args,
    set_threads,
    time_interleaved,
    write_json,
)
from pyro_vinit import (
    AutoKTiedNormal,
    AutoRadialNormal,
    FlipoutMessenger,
    LocalReparamMessenger,
    init_guide_iblm,
)
from pyro_vinit.nn import BayesianClassifier, bayesianize, mlp
from pyro_vinit.testing.user_models import blobs

HERE = os.path.dirname(os.path.abspath(__file__))
DOCS_STATIC = os.path.join(os.path.dirname(HERE), "docs", "_static", "scaling")
INPUTS, CLASSES, NUM_DATA = 64, 10, 60000

DETERMINISTIC = "nn (deterministic)"
BT = "bayesian-torch"
# name: (guide class, guide kwargs, handler class)
PYRO = {
    "AutoNormal": (AutoNormal, {}, None),
    "AutoKTiedNormal(2)": (AutoKTiedNormal, {"rank": 2}, None),
    "AutoKTiedNormal(2) + LRT": (AutoKTiedNormal, {"rank": 2}, LocalReparamMessenger),
    "AutoRadialNormal": (AutoRadialNormal, {}, None),
    "AutoRadialNormal + Flipout": (AutoRadialNormal, {}, FlipoutMessenger),
}
CONFIGS = [DETERMINISTIC, BT, *PYRO]


def sizes_of(width):
    return (INPUTS, width, width, CLASSES)


def build_step(name, width, batch, seed=0):
    """One training step of configuration ``name`` on 64→w→w→10 at ``batch``
    (one step is taken while building it)."""
    pyro.set_rng_seed(seed)
    sizes = sizes_of(width)
    x, y = torch.randn(batch, INPUTS), torch.randint(0, CLASSES, (batch,))
    if name == DETERMINISTIC:
        return deterministic_step(sizes, x, y)
    if name == BT:
        return bayesian_torch_step(LinearReparameterization, sizes, x, y, NUM_DATA)
    guide_cls, kwargs, handler = PYRO[name]
    model = make_model(sizes, NUM_DATA)
    return native_step(model, guide_cls(model, **kwargs), x, y,
                       handler=None if handler is None else handler())


# --------------------------------------------------------------- op counting


class OpCounter(TorchDispatchMode):
    """Counts the operators of a computation (views excluded: they launch no
    kernel and move no data), their FLOPs (matrix products by PyTorch's flop
    formulas, one per output element otherwise) and the bytes of their tensor
    inputs and outputs, and the modelled device time on a GPU of ``flops``
    FLOP/s and ``bandwidth`` bytes/s (each operator at its roofline)."""

    def __init__(self, flops, bandwidth):
        super().__init__()
        self.peak_flops, self.bandwidth = flops, bandwidth
        self.ops = self.flops = self.bytes = 0
        self.device_seconds = 0.0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        schema = func._schema
        if not schema.is_mutable and any(r.alias_info is not None for r in schema.returns):
            return out  # a view
        tensors = [t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)]
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        formula = flop_registry.get(func._overloadpacket)
        if formula is not None:
            flops = formula(*args, **kwargs, out_val=out)
        else:
            flops = sum(t.numel() for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor))
        self.ops += 1
        self.flops += flops
        self.bytes += nbytes
        self.device_seconds += max(flops / self.peak_flops, nbytes / self.bandwidth)
        return out


def count_ops(step, args):
    counter = OpCounter(args.gpu_tflops * 1e12, args.gpu_bandwidth * 1e9)
    with counter:
        step()
    return {"ops": counter.ops, "flops": counter.flops, "bytes": counter.bytes,
            "gpu_device_seconds": counter.device_seconds}


# ------------------------------------------------------------ fresh processes


def _resident_mb(field):
    # VmRSS: now; VmHWM: the high-water mark (Linux); elsewhere ru_maxrss for both
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def step_memory(name, width, batch, threads):
    """In a fresh process: peak resident memory of setting up ``name`` and two steps."""
    torch.set_num_threads(threads)
    pyro.settings.set(module_local_params=True)
    pyro.enable_validation(False)
    start = _resident_mb("VmRSS")
    step = build_step(name, width, batch)
    step()
    peak = _resident_mb("VmHWM")
    return {"start_mb": start, "peak_mb": peak, "increment_mb": peak - start}


def iblm_memory(width, rows, threads):
    """In a fresh process: I-BLM's wall time and peak resident memory on 20-h-h-3."""
    torch.set_num_threads(threads)
    pyro.set_rng_seed(0)
    start = _resident_mb("VmRSS")
    x, y, _, _ = blobs(num_classes=3, dim=20, n=rows)
    model = BayesianClassifier(bayesianize(mlp((20, width, width, 3))), num_data=len(x))
    guide = AutoNormal(model)
    with torch.no_grad():
        guide(x[:8], y[:8])
    setup = _resident_mb("VmHWM")
    begin = time.perf_counter()
    init_guide_iblm(guide, (x, y))
    seconds = time.perf_counter() - begin
    peak = _resident_mb("VmHWM")
    return {"width": width, "rows": rows, "num_weights": 20 * width + width * width + 3 * width,
            "seconds": seconds, "start_mb": start, "setup_peak_mb": setup, "peak_mb": peak,
            "setup_increment_mb": setup - start, "increment_mb": peak - start,
            "iblm_increment_mb": peak - setup}


def in_fresh_process(pool_context, fn, *args):
    with pool_context.Pool(1, maxtasksperchild=1) as pool:
        return pool.apply(fn, args)


# -------------------------------------------------------------------- sweeps


def sweep(axis, grid, configs, args, ctx):
    """Times, op counts and memory of every configuration at every grid point."""
    points = []
    for value in grid:
        width, batch = (value, args.batch) if axis == "width" else (args.width, value)
        steps = {name: build_step(name, width, batch) for name in configs}
        timings = time_interleaved(steps, rounds=args.rounds, block_seconds=args.block_seconds,
                                   warmup=1)
        counts = {name: count_ops(step, args) for name, step in steps.items()}
        del steps
        memory = {name: in_fresh_process(ctx, step_memory, name, width, batch, args.threads)
                  for name in configs}
        point = {axis: value, "width": width, "batch": batch, "configs": {}}
        for name in configs:
            point["configs"][name] = {"ms": timings.median_ms(name), **counts[name],
                                      **memory[name]}
        points.append(point)
        print(f"  {axis} {value}: " + ", ".join(
            f"{name} {timings.median_ms(name):.1f} ms" for name in configs), flush=True)
    return points


def _upper_half(xs):
    # the upper half of the grid, and at least its last two points
    return slice(min(len(xs) // 2, len(xs) - 2), None)


def analyse(axis, points, configs, args, host_fixed=None):
    """Exponents over the upper half of the grid, the fixed-plus-rate fit, its
    crossover, and the GPU model, per configuration. The model's host time is
    ``host_fixed[name]`` (seconds; default: this sweep's own fixed cost) plus
    the launches: pass the width sweep's, whose fixed cost is what remains as
    the arithmetic goes to zero, while the batch sweep's also holds the
    per-weight work of its layers, which a GPU would do on the device."""
    xs = [p[axis] for p in points]
    upper = _upper_half(xs)
    out = {}
    for name in configs:
        rows = [p["configs"][name] for p in points]
        ms = [r["ms"] for r in rows]
        flops = [r["flops"] for r in rows]
        fixed, rate = fit_fixed_and_rate(flops, [t / 1e3 for t in ms])
        crossover_flops = fixed / rate if rate > 0 else float("inf")
        memory = [max(r["increment_mb"], 1e-3) for r in rows]
        host = fixed if host_fixed is None else host_fixed[name]
        host_ms = [1e3 * (host + r["ops"] * args.launch_us * 1e-6) for r in rows]
        device_ms = [1e3 * r["gpu_device_seconds"] for r in rows]
        out[name] = {
            "time_exponent": fit_exponent(xs[upper], ms[upper]),
            "memory_exponent": fit_exponent(xs[upper], memory[upper]),
            "fixed_ms": 1e3 * fixed,
            "gflops_per_second": rate and 1e-9 / rate,
            "crossover_flops": crossover_flops,
            "crossover": crossover(xs, flops, crossover_flops),
            "gpu_model_host_ms": host_ms,
            "gpu_model_device_ms": device_ms,
            "gpu_model_ms": [max(h, d) for h, d in zip(host_ms, device_ms)],
            "gpu_model_bound": ["device" if d >= h else "host"
                                for h, d in zip(host_ms, device_ms)],
            # FLOPs a step needs before the device, at its peak rate, outlasts the host
            "gpu_crossover_flops": host * args.gpu_tflops * 1e12,
        }
    return out


def analyse_steps(results, configs, args):
    """:func:`analyse` of both sweeps, the GPU model's host cost from the width sweep."""
    steps = results["steps"]
    steps["width"]["fits"] = analyse("width", steps["width"]["points"], configs, args)
    host = {name: fit["fixed_ms"] / 1e3 for name, fit in steps["width"]["fits"].items()}
    steps["batch"]["fits"] = analyse("batch", steps["batch"]["points"], configs, args, host)


def crossover(xs, flops, target):
    """The grid value where the counted FLOPs reach ``target`` (log-log
    interpolation between grid points), or None outside the grid."""
    for (x0, f0), (x1, f1) in zip(zip(xs, flops), zip(xs[1:], flops[1:])):
        if f0 <= target <= f1:
            s = math.log(target / f0) / math.log(f1 / f0)
            return x0 * (x1 / x0) ** s
    return None


def iblm_sweeps(args, ctx):
    out = {}
    for axis, grid in (("width", args.iblm_widths), ("rows", args.iblm_rows)):
        rows = []
        for value in grid:
            width, n = (value, args.iblm_default_rows) if axis == "width" else \
                (args.iblm_width, value)
            row = in_fresh_process(ctx, iblm_memory, width, n, args.threads)
            rows.append(row)
            print(f"  I-BLM h={width}, {n} rows: {row['seconds']:.2f} s, peak "
                  f"{row['peak_mb']:.0f} MB (+{row['iblm_increment_mb']:.0f} MB over set-up)",
                  flush=True)
        xs = [r[axis] for r in rows]
        upper = _upper_half(xs)
        out[axis] = {
            "rows": rows,
            "time_exponent": fit_exponent(xs[upper], [r["seconds"] for r in rows][upper]),
            "memory_exponent": fit_exponent(
                xs[upper], [max(r["increment_mb"], 1e-3) for r in rows][upper]),
        }
    return out


# -------------------------------------------------------------------- report


def _fmt_x(x, axis):
    if x is None:
        return "outside the grid"
    return f"w ≈ {x:.0f}" if axis == "width" else f"batch ≈ {x:.0f}"


def report(results):
    lines = []
    for axis in ("width", "batch"):
        points, fits = results["steps"][axis]["points"], results["steps"][axis]["fits"]
        xs = [p[axis] for p in points]
        fixed = (f"batch {results['config']['batch']}" if axis == "width"
                 else f"w = {results['config']['width']}")
        lines += ["", f"## Step time (ms) against {axis}, 64→w→w→10, {fixed}", ""]
        rows = [[name, *(f"{p['configs'][name]['ms']:.2f}" for p in points),
                 f"{fits[name]['time_exponent']:.2f}"] for name in fits]
        lines.append(markdown_table(["configuration", *map(str, xs), "exponent (upper half)"],
                                    rows))
        lines += ["", f"## Peak memory growth (MB) against {axis}", ""]
        rows = [[name, *(f"{p['configs'][name]['increment_mb']:.0f}" for p in points),
                 f"{fits[name]['memory_exponent']:.2f}"] for name in fits]
        lines.append(markdown_table(["configuration", *map(str, xs), "exponent (upper half)"],
                                    rows))
        lines += ["", f"## Fixed cost, arithmetic rate and crossover against {axis}; "
                  f"counts and GPU model at {axis} {xs[-1]}", ""]
        rows = []
        for name, f in fits.items():
            top = points[-1]["configs"][name]
            rows.append([name, f"{f['fixed_ms']:.2f}", f"{f['gflops_per_second']:.1f}",
                         _fmt_x(f["crossover"], axis), f"{top['ops']}",
                         f"{top['flops'] / 1e9:.2f}", f"{top['bytes'] / 1e6:.0f}",
                         f"{f['gpu_model_host_ms'][-1]:.2f} / {f['gpu_model_device_ms'][-1]:.2f}",
                         f"{f['gpu_crossover_flops'] / 1e9:.0f}"])
        lines.append(markdown_table(
            ["configuration", "fixed a (ms)", "rate (GFLOP/s)", "crossover", "operators",
             "GFLOP", "MB read + written", "GPU model: host / device (ms)",
             "GPU crossover (GFLOP per step)"], rows))
    for axis, r in results["iblm"].items():
        label = "h" if axis == "width" else "rows"
        cfg = results["config"]
        fixed = (f"width ({cfg['iblm_default_rows']} rows)" if axis == "width"
                 else f"rows (h = {cfg['iblm_width']})")
        lines += ["", f"## I-BLM against {fixed}: time exponent {r['time_exponent']:.2f}, "
                  f"memory exponent {r['memory_exponent']:.2f} (upper half)", ""]
        rows = [[row[axis], f"{row['num_weights']:,}", f"{row['seconds']:.2f}",
                 f"{row['setup_peak_mb']:.0f}", f"{row['peak_mb']:.0f}",
                 f"{row['iblm_increment_mb']:.0f}"] for row in r["rows"]]
        lines.append(markdown_table([label, "weights", "I-BLM (s)", "peak after set-up (MB)",
                                     "peak after I-BLM (MB)", "I-BLM's growth (MB)"], rows))
    if results["bayesian_torch"] is None:
        lines += ["", BAYESIAN_TORCH_MISSING]
    return "\n".join(lines)


def _ticks(ax, xs):
    # plain numbers on log axes: the grid's values below, a few round values at the side
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    ax.set_xticks(xs)
    ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        axis.set_minor_formatter(NullFormatter())


def plot(results, path_steps, path_iblm):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for col, axis in enumerate(("width", "batch")):
        points = results["steps"][axis]["points"]
        xs = [p[axis] for p in points]
        for name, fit in results["steps"][axis]["fits"].items():
            ms = [p["configs"][name]["ms"] for p in points]
            mb = [max(p["configs"][name]["increment_mb"], 1e-1) for p in points]
            line, = axes[0, col].loglog(xs, ms, "o-", ms=3,
                                        label=f"{name} (∝ {axis}^{fit['time_exponent']:.2f})")
            axes[0, col].axhline(fit["fixed_ms"], color=line.get_color(), lw=0.6, ls=":")
            axes[1, col].loglog(xs, mb, "o-", ms=3, color=line.get_color(),
                                label=f"{name} (∝ {axis}^{fit['memory_exponent']:.2f})")
        cfg = results["config"]
        xlabel = (f"width w (batch {cfg['batch']})" if axis == "width"
                  else f"batch (w = {cfg['width']})")
        axes[0, col].set(xlabel=xlabel, ylabel="ms per step", title=f"step time vs {axis}")
        axes[1, col].set(xlabel=xlabel, ylabel="peak resident growth (MB)",
                         title=f"peak memory vs {axis}")
        for ax in axes[:, col]:
            ax.legend(fontsize=6)
            ax.grid(True, which="both", alpha=0.3)
            _ticks(ax, xs)
    fig.suptitle("64→w→w→10, PyTorch-native loop, TraceMeanField_ELBO, "
                 f"{results['config']['threads']} thread(s); dotted: fitted fixed cost a")
    fig.tight_layout()
    fig.savefig(path_steps, dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for ax, axis in zip(axes, ("width", "rows")):
        r = results["iblm"][axis]
        xs = [row[axis] for row in r["rows"]]
        ax.loglog(xs, [row["seconds"] for row in r["rows"]], "o-",
                  label=f"I-BLM time, s (∝ {axis}^{r['time_exponent']:.2f})")
        ax.loglog(xs, [max(row["increment_mb"], 1e-1) / 1e3 for row in r["rows"]], "s--",
                  label=f"peak memory growth, GB (∝ {axis}^{r['memory_exponent']:.2f})")
        cfg = results["config"]
        ax.set(xlabel=(f"width h ({cfg['iblm_default_rows']} rows)" if axis == "width"
                       else f"rows (h = {cfg['iblm_width']})"),
               title=f"I-BLM, MLP 20-h-h-3, vs {axis}")
        ax.legend(fontsize=7)
        ax.grid(True, which="both", alpha=0.3)
        _ticks(ax, xs)
    fig.tight_layout()
    fig.savefig(path_iblm, dpi=110)
    plt.close(fig)


def main(args):
    set_threads(args.threads)
    pyro.settings.set(module_local_params=True)
    pyro.enable_validation(False)
    host = host_info()
    # Children are forked from a server that has imported torch, Pyro and pyro_vinit once
    # (listed: Python 3.11's forkserver does not preload the main script's imports by
    # itself) and has allocated nothing else, so each starts from the same clean state.
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "pyro", "pyro_vinit"]
                               + (["bayesian_torch.layers"] if BAYESIAN_TORCH else []))
    configs = [c for c in CONFIGS if c != BT or BAYESIAN_TORCH is not None]
    if BAYESIAN_TORCH is None:
        print(BAYESIAN_TORCH_MISSING)
    results = {"config": vars(args), "bayesian_torch": BAYESIAN_TORCH, "steps": {}}
    for axis, grid in (("width", args.widths), ("batch", args.batches)):
        results["steps"][axis] = {"points": sweep(axis, grid, configs, args, ctx)}
    analyse_steps(results, configs, args)
    results["iblm"] = iblm_sweeps(args, ctx)
    text = report(results)
    end = host_info()["load_average"]
    text += (f"\n\n{args.threads} thread(s); load average (1, 5, 15 min) at the start "
             f"{tuple(host['load_average'])}, at the end {tuple(end)}, on "
             f"{host['cpu_count']} cores. GPU model: {args.gpu_tflops} TFLOP/s, "
             f"{args.gpu_bandwidth} GB/s, {args.launch_us} µs per operator launched.")
    print(text)
    out = args.out if args.out is not None else (None if args.quick else
                                                 os.path.join(HERE, "results"))
    if out is None:
        return results
    figures = args.figures or (out if args.quick else DOCS_STATIC)
    os.makedirs(figures, exist_ok=True)
    write_json(os.path.join(out, "bench_scaling.json"), results, host_start=host)
    with open(os.path.join(out, "bench_scaling.md"), "w") as f:
        f.write(text + "\n")
    try:
        plot(results, os.path.join(figures, "scaling_steps.png"),
             os.path.join(figures, "scaling_iblm.png"))
    except ImportError:
        print("matplotlib not installed: skipping the plots")
    print(f"\nwrote {out}/bench_scaling.json, .md and the figures in {figures}")
    return results


if __name__ == "__main__":
    parser = make_parser(__doc__, out=False, tag=False,
                         quick_help="tiny grids; writes files only with --out")
    parser.add_argument("--widths", type=int, nargs="+", default=[100, 200, 400, 800, 1600, 3200])
    parser.add_argument("--batches", type=int, nargs="+",
                        default=[32, 64, 128, 256, 512, 1024, 2048, 4096])
    parser.add_argument("--batch", type=int, default=128, help="batch of the width sweep")
    parser.add_argument("--width", type=int, default=400, help="width of the batch sweep")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds per point")
    parser.add_argument("--block-seconds", type=float, default=0.2,
                        help="time of one configuration's block of steps")
    parser.add_argument("--iblm-widths", type=int, nargs="+",
                        default=[125, 250, 500, 1000, 2000, 4000])
    parser.add_argument("--iblm-rows", type=int, nargs="+", default=[250, 1000, 4000, 16000])
    parser.add_argument("--iblm-width", type=int, default=1000, help="h of the rows sweep")
    parser.add_argument("--iblm-default-rows", type=int, default=500, help="rows of the h sweep")
    parser.add_argument("--gpu-tflops", type=float, default=19.5,
                        help="GPU model: peak FP32 TFLOP/s (A100's datasheet figure)")
    parser.add_argument("--gpu-bandwidth", type=float, default=1555.0,
                        help="GPU model: memory bandwidth, GB/s (A100 40GB's)")
    parser.add_argument("--launch-us", type=float, default=5.0,
                        help="GPU model: host time per operator launched, µs")
    parser.add_argument("--out", default=None,
                        help="folder of the JSON and Markdown (default benchmarks/results; "
                             "none with --quick)")
    parser.add_argument("--figures", default=None,
                        help="folder of the PNGs (default docs/_static/scaling; --out with "
                             "--quick)")
    main(parse_args(parser, quick={
        "widths": [50, 100, 200], "batches": [16, 32, 64], "rounds": 1, "block_seconds": 0.01,
        "iblm_widths": [50, 100], "iblm_rows": [200, 400], "iblm_width": 50,
        "iblm_default_rows": 200}))
