"""
The break-even of :func:`~pyro_vinit.fit`'s captured step: ``fit(...,
capture=False)`` against ``fit(..., capture=True)`` on the race's problems
(``bench_time_to_quality``: digits_mlp, digits_cnn, mnist_mlp), side by side
in one run.

Each problem's guide (``AutoKTiedNormal(rank=2)``, I-BLM off the clock) is
trained by calls of ``fit(..., init=None, steps=S)`` sharing one
optimizer, eager and captured, for a short and a long ``S``, in interleaved
rounds (the order rotating); a call's time is the median over rounds. Each
mode's per-step time is the slope between the two lengths, its fixed cost the
rest (a captured call's includes its tracing step); the break-even is the
number of steps at which the captured call's extra fixed cost is paid back:

.. math::

    S^* = \\frac{F_\\mathrm{captured} - F_\\mathrm{eager}}
               {s_\\mathrm{eager} - s_\\mathrm{captured}}.

``fit``'s ``capture=None`` takes the captured step from a threshold of
steps chosen from this table. A third mode, ``captured, per-op fake modes``,
traces as ``make_fx`` does on its own (a fake tensor mode made per operator,
each recording the Python stack; ``pyro_vinit.training._trace`` holds one for
the whole graph): its extra fixed cost beside the captured one's is what that
saves.

Usage::

    python -m benchmarks.bench_fit_capture --threads 1          # full run (a few minutes)
    python -m benchmarks.bench_fit_capture --quick              # smoke run, no files
    python -m benchmarks.bench_fit_capture --device cuda --out /tmp/gpu
"""

import contextlib
import math
import statistics
import time
from unittest import mock

import pyro
import torch

from benchmarks.bench_time_to_quality import BATCH_SIZE, PROBLEMS
from benchmarks.harness import (
    host_info,
    make_parser,
    markdown_table,
    parse_args,
    result_stem,
    schedule,
    set_threads,
    write_report,
)
from pyro_vinit import AutoKTiedNormal, GroupedAdam, fit
from pyro_vinit.nn import BayesianClassifier, bayesianize
from pyro_vinit.training import _trace

MODES = ("eager", "captured", "per-op fake modes")


def problem(name, device):
    """A model and an I-BLM-initialized guide of the problem ``name``, and its data."""
    spec = PROBLEMS[name]
    data = spec["data"]()
    x, y = data[0].to(device), data[1].to(device)
    model = BayesianClassifier(bayesianize(spec["net"]()), num_data=len(x)).to(device)
    guide = AutoKTiedNormal(model, rank=2)
    optim = GroupedAdam({"lr": 1e-3})
    fit(model, guide, (x, y), steps=1, batch_size=BATCH_SIZE, optim=optim, progress=False,
        capture=False)
    return model, guide, optim, (x, y)


def time_calls(name, lengths, rounds, device):
    """Seconds of each ``fit`` call, by ``(mode, steps)``, over ``rounds``."""
    model, guide, optim, data = problem(name, device)
    configs = [(mode, steps) for steps in lengths for mode in MODES]
    seconds = {config: [] for config in configs}
    for order in schedule([f"{m}:{s}" for m, s in configs], rounds):
        for key in order:
            mode, steps = key.split(":")
            if device.type == "cuda":
                torch.cuda.synchronize()
            plain = mode == "per-op fake modes"  # make_fx's own tracing
            patch = (mock.patch.object(_trace, "_one_fake_mode", contextlib.nullcontext)
                     if plain else contextlib.nullcontext())
            start = time.perf_counter()
            with patch:
                history = fit(model, guide, data, steps=int(steps), batch_size=BATCH_SIZE,
                              optim=optim, init=None, progress=False,
                              capture=mode != "eager")
            if device.type == "cuda":
                torch.cuda.synchronize()
            seconds[(mode, int(steps))].append(time.perf_counter() - start)
            assert history.captured == (mode != "eager")
    return seconds


def summarize(seconds, short, long):
    median = {config: statistics.median(v) for config, v in seconds.items()}
    out = {}
    for mode in MODES:
        slope = (median[(mode, long)] - median[(mode, short)]) / (long - short)
        out[mode] = {"ms_per_step": 1e3 * slope, "fixed_s": median[(mode, short)] - short * slope,
                     "call_s": {str(s): median[(mode, s)] for s in (short, long)}}
    saved = out["eager"]["ms_per_step"] - out["captured"]["ms_per_step"]
    extra = out["captured"]["fixed_s"] - out["eager"]["fixed_s"]
    out["step_ratio"] = out["captured"]["ms_per_step"] / out["eager"]["ms_per_step"]
    out["long_call_ratio"] = median[("captured", long)] / median[("eager", long)]
    out["extra_fixed_s"] = extra
    out["break_even_steps"] = 1e3 * extra / saved if saved > 0 else math.inf
    out["extra_fixed_s_per_op_fake_modes"] = (out["per-op fake modes"]["fixed_s"]
                                              - out["eager"]["fixed_s"])
    return out


def report(results, host, end, args):
    rows = []
    for name, r in results.items():
        even = r["break_even_steps"]
        rows.append([name, f"{r['eager']['ms_per_step']:.2f}",
                     f"{r['captured']['ms_per_step']:.2f}",
                     f"{r['step_ratio']:.2f}", f"{r['extra_fixed_s']:.2f}",
                     "never" if math.isinf(even) else f"{even:.0f}",
                     f"{r['long_call_ratio']:.2f}",
                     f"{r['extra_fixed_s_per_op_fake_modes']:.2f}"])
    lines = [f"## fit, captured against eager ({args.device}, batch {BATCH_SIZE})", "",
             markdown_table(["problem", "eager ms/step", "captured ms/step", "step ratio",
                             "captured extra fixed s", "break-even steps",
                             f"captured ÷ eager, {args.long} steps",
                             "extra fixed s, per-op fake modes"], rows), "",
             f"Calls of {args.short} and {args.long} steps, {args.rounds} interleaved rounds, "
             f"{args.threads} thread(s), AutoKTiedNormal(2), GroupedAdam, Pyro's validation "
             f"{'on' if args.validation else 'off'}; torch {host['torch']}, Pyro {host['pyro']}; "
             f"load average (1, 5, 15 min) at the start {tuple(host['load_average'])}, at the "
             f"end {tuple(end)}, on {host['cpu_count']} cores."]
    return "\n".join(lines)


def main(args):
    set_threads(args.threads)
    device = torch.device(args.device)
    host = host_info()
    results = {}
    with pyro.validation_enabled(args.validation):
        for name in args.problems:
            pyro.clear_param_store()
            pyro.set_rng_seed(0)
            seconds = time_calls(name, (args.short, args.long), args.rounds, device)
            results[name] = summarize(seconds, args.short, args.long)
            results[name]["seconds"] = {f"{m}:{s}": v for (m, s), v in seconds.items()}
            print(f"  {name} done", flush=True)
    text = report(results, host, host_info()["load_average"], args)
    print(text)
    if not args.quick:
        write_report(result_stem(args, "bench_fit_capture"), {"config": vars(args),
                                                              "results": results},
                     text, host_start=host)
    return results


if __name__ == "__main__":
    parser = make_parser(__doc__)
    parser.add_argument("--problems", nargs="+", default=list(PROBLEMS), choices=list(PROBLEMS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--short", type=int, default=25, help="steps of a short call")
    parser.add_argument("--long", type=int, default=400, help="steps of a long call")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--validation", action="store_true", help="Pyro's validation on")
    main(parse_args(parser, quick={"rounds": 1, "short": 5, "long": 15,
                                   "problems": ["digits_mlp"]}))
