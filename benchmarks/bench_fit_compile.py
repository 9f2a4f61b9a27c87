"""
When :func:`~pyro_vinit.fit` compiles its captured step (issue 25): the cost
model of ``capture=None`` (``pyro_vinit/training/_inductor.py``) against
measurements, one thread, side by side in one run.

For each step (``AutoKTiedNormal(rank=2)`` under ``fit_config``'s handlers,
``GroupedAdam``, as fit takes it): the race's three problems
(``bench_time_to_quality``) and the performance page's MLP 64→400→400→10 on
digits at batch 128 and 1000, it measures

* the traced graph's size: operators and the elements they write;
* the replayed and the compiled (``CapturedSVI(compile=True)``) step, in
  interleaved rounds, and the compile (trace, compile and first replay;
  inductor's caches in a fresh folder; its start-up in the process, timed
  first on a trivial function, is added to each);
* the measured break-even, the steps after which the compile has paid for
  itself, :math:`S^* = C / (s_\\mathrm{replay} - s_\\mathrm{compiled})`,
  against the number of steps from which fit compiles, where the model's
  projected saving is twice its projected cost.

Then one end-to-end check: ``fit(capture=None)`` against
``fit(capture=True)`` on the digits 5×100 MLP at the first number of steps
at which fit compiles, each in a fresh process (its inductor start-up on the
clock), I-BLM included.

Usage::

    python -m benchmarks.bench_fit_compile            # full run (about 6 minutes)
    python -m benchmarks.bench_fit_compile --quick    # smoke run, no files
"""

import math
import multiprocessing
import os
import tempfile
import time

import pyro
import torch

from benchmarks.bench_time_to_quality import PROBLEMS
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
from pyro_vinit import AutoKTiedNormal, CapturedSVI, fit, fit_config
from pyro_vinit.data import load_digits
from pyro_vinit.nn import BayesianClassifier, bayesianize, mlp
from pyro_vinit.training import _inductor

#: name: (race problem or None for the digits MLP 64-400-400-10, batch size)
STEPS = {
    "digits_mlp": ("digits_mlp", 128),
    "digits_cnn": ("digits_cnn", 128),
    "mnist_mlp": ("mnist_mlp", 128),
    "mlp400_b128": (None, 128),
    "mlp400_b1000": (None, 1000),
}


def _data_and_net(problem):
    if problem is None:
        x, y = load_digits()[:2]
        return x, y, mlp((64, 400, 400, 10))
    spec = PROBLEMS[problem]
    x, y = spec["data"]()[:2]
    return x, y, spec["net"]()


def fits_from(graph):
    """The fewest steps left for which fit compiles ``graph``."""
    low, high = 1, 1
    while not _inductor.compile_pays(graph, high):
        low, high = high, 2 * high
    while low < high:
        mid = (low + high) // 2
        low, high = (low, mid) if _inductor.compile_pays(graph, mid) else (mid + 1, high)
    return low


def fit_length(captured_left, num_data, batch):
    """The fewest steps of a ``fit`` call on ``num_data`` rows that leave
    ``captured_left`` captured steps after the trace (its second step): an
    epoch's partial last batch takes the eager step."""
    per_epoch, full = math.ceil(num_data / batch), max(1, num_data // batch)
    return 2 + -(-captured_left * per_epoch // full)


def measure(name, args):
    problem, batch = STEPS[name]
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    x, y, net = _data_and_net(problem)
    model = BayesianClassifier(bayesianize(net), num_data=len(x))
    guide = AutoKTiedNormal(model, rank=2)
    fit(model, guide, (x, y), steps=1, batch_size=batch, capture=False, progress=False)
    config = fit_config(guide)
    optim = config.optimizer()
    rows = torch.randint(len(x), (batch,))
    xb, yb = x[rows], y[rows]
    svis, setup = {}, {}
    for kind in ("replay", "compiled"):
        svi = CapturedSVI(model, guide, optim, config.elbo(), compile=kind == "compiled")
        with config.handlers():
            svi.step(xb, yb)  # eager
        start = time.perf_counter()
        with config.handlers():
            svi.step(xb, yb)  # traced (and compiled)
        setup[kind] = time.perf_counter() - start
        svis[kind] = svi
    (graph,) = svis["replay"]._graphs()
    operators, elements = _inductor.graph_size(graph)

    def stepper(svi):
        def step():
            with config.handlers():
                svi.step(xb, yb)
        return step

    timings = time_interleaved({k: stepper(v) for k, v in svis.items()}, rounds=args.rounds,
                               block=args.block, warmup=3)
    replay, compiled = timings.median_ms("replay") / 1e3, timings.median_ms("compiled") / 1e3
    cost = setup["compiled"] + args.startup
    saved = replay - compiled
    model = _inductor._COST_MODELS["cpu"]  # (this benchmark runs on the CPU)
    predicted_saved = model.saved_per_operator * operators + model.saved_per_element * elements
    predicted_cost = model.compile_seconds + model.compile_per_operator * operators
    return {
        "step": name, "batch": batch, "operators": operators, "elements": elements,
        "replay_ms": 1e3 * replay, "compiled_ms": 1e3 * compiled,
        "ratio": timings.ratio("compiled", "replay").median,
        "trace_s": setup["replay"], "compile_s": cost,
        "saved_ms": 1e3 * saved, "predicted_saved_ms": 1e3 * predicted_saved,
        "predicted_compile_s": predicted_cost,
        "break_even": cost / saved if saved > 0 else math.inf,
        "fit_compiles_from": fits_from(graph),
        "fit_call_compiles_from": fit_length(fits_from(graph), len(x), batch),
    }


def _end_to_end(capture, steps, threads):
    set_threads(threads)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-")
    x, y = load_digits()[:2]
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    model = BayesianClassifier(bayesianize(PROBLEMS["digits_mlp"]["net"]()), num_data=len(x))
    start = time.perf_counter()
    history = fit(model, AutoKTiedNormal(model, rank=2), (x, y), steps=steps, capture=capture,
                  progress=False)
    return time.perf_counter() - start, history.compiled


def end_to_end(steps, threads):
    """fit's wall time, in a fresh process, with capture=None and capture=True."""
    out = {}
    context = multiprocessing.get_context("spawn")
    for capture in (None, True):
        with context.Pool(1) as pool:
            seconds, compiled = pool.apply(_end_to_end, (capture, steps, threads))
        out[f"capture={capture}"] = {"seconds": seconds, "compiled": compiled}
    return out


def startup_seconds():
    """inductor's start-up in this process, on a trivial function."""
    start = time.perf_counter()
    torch.compile(lambda a: (a * 2).sin())(torch.randn(3))
    return time.perf_counter() - start


def report(results):
    lines = ["fit(capture=None)'s compile: measured against its cost model (one thread; "
             f"inductor's start-up {results['startup_s']:.1f} s, added to each compile)", ""]
    rows = [[r["step"], r["batch"], r["operators"], f"{r['elements'] / 1e6:.2f}M",
             f"{r['replay_ms']:.2f}", f"{r['compiled_ms']:.2f}", f"{r['ratio']:.2f}",
             f"{r['saved_ms']:.2f} / {r['predicted_saved_ms']:.2f}",
             f"{r['compile_s']:.1f} / {r['predicted_compile_s']:.1f}",
             f"{r['break_even']:.0f}", r["fit_compiles_from"],
             f"{r['fit_compiles_from'] / r['break_even']:.1f}"]
            for r in results["steps"]]
    lines.append(markdown_table(
        ["step", "batch", "operators", "elements", "replay (ms)", "compiled (ms)",
         "compiled ÷ replay", "saved ms/step (measured / model)",
         "compile s (measured / model)", "break-even steps",
         "fit compiles from (captured steps left)",
         "÷ break-even"], rows))
    e2e = results.get("end_to_end")
    if e2e:
        auto, plain = e2e["capture=None"], e2e["capture=True"]
        lines += ["", f"End to end, digits 5×100 MLP, fit(steps={results['end_to_end_steps']}) "
                  "in a fresh process each (I-BLM and inductor's start-up included):", "",
                  markdown_table(["fit", "seconds", "compiled"],
                                 [["capture=None", f"{auto['seconds']:.1f}", auto["compiled"]],
                                  ["capture=True", f"{plain['seconds']:.1f}", plain["compiled"]],
                                  ["None ÷ True", f"{auto['seconds'] / plain['seconds']:.2f}",
                                   ""]])]
    return "\n".join(lines)


def main(args):
    set_threads(args.threads)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-")
    host = host_info()
    results = {"startup_s": startup_seconds(), "steps": []}
    args.startup = results["startup_s"]
    for name in args.steps:
        row = measure(name, args)
        print(f"{name}: replay {row['replay_ms']:.2f} ms, compiled {row['compiled_ms']:.2f} "
              f"ms, break-even {row['break_even']:.0f}, fit from {row['fit_compiles_from']}",
              flush=True)
        results["steps"].append(row)
    if args.end_to_end:
        digits = next((r for r in results["steps"] if r["step"] == "digits_mlp"), None)
        steps = digits["fit_call_compiles_from"] if digits else args.end_to_end_steps
        results["end_to_end_steps"] = steps
        results["end_to_end"] = end_to_end(steps, args.threads)
    text = report(results)
    print("\n" + text)
    if not args.quick:
        write_report(result_stem(args, "bench_fit_compile"), results, text, host_start=host)


if __name__ == "__main__":
    parser = make_parser(__doc__)
    parser.add_argument("--steps", nargs="+", default=list(STEPS), choices=list(STEPS))
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--block", type=int, default=20)
    parser.add_argument("--no-end-to-end", dest="end_to_end", action="store_false")
    parser.add_argument("--end-to-end-steps", type=int, default=30,
                        help="steps of the end-to-end check without the digits_mlp row")
    main(parse_args(parser, quick={"steps": ["digits_cnn"], "rounds": 2, "block": 3,
                                   "end_to_end": True}))
