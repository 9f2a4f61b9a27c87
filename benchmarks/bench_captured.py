"""
Issue 25's CPU step table: :class:`~pyro_vinit.CapturedSVI` (the step traced
once and replayed) against ``SVI`` and Pyro's PyTorch-native loop, eager, and
against bayesian-torch and a deterministic network, side by side in one run.

Bayesian ReLU MLP 64→400→400→10 (N(0, 1/D_in) priors) on scikit-learn digits,
``AutoKTiedNormal(rank=2)`` under ``local_reparam()``, TraceMeanField_ELBO,
Adam (lr 1e-3), CPU, Pyro's validation on (its default: the captured step
checks it on its first, eager, step only). Each setting (batch 128, batch 1000)
is timed in interleaved rounds (``benchmarks/harness.py``); a ratio's value is
the median of its per-round ratios, the range is over the rounds. Also the
time of the tracing step (the second step of a fresh ``CapturedSVI``) and the
size of its graph.

Also *fit's step*, as :func:`~pyro_vinit.fit` runs it (the handlers of
``fit_config(guide).handlers()``, entered afresh each step: the KL weight and
``local_reparam()``), eager ``SVI`` with ``pyro.optim.Adam`` and with
:class:`~pyro_vinit.GroupedAdam` (all parameters in one fused Adam step), and
``CapturedSVI`` with ``GroupedAdam``.

Targets of issue 25 (captured ÷ bayesian-torch ``LinearReparameterization``):
≤ 0.8 at batch 128, ≤ 1.0 at batch 1000; tracing ≤ 2 s.

Usage::

    python -m benchmarks.bench_captured --threads 1     # full run (about 2 minutes)
    python -m benchmarks.bench_captured --quick         # smoke run, no files
"""

import time

import pyro
from pyro.infer import SVI, TraceMeanField_ELBO

from benchmarks._steps import (
    BAYESIAN_TORCH,
    BAYESIAN_TORCH_MISSING,
    LinearReparameterization,
    bayesian_torch_step,
    deterministic_step,
    make_model,
    native_step,
    svi_step,
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
from pyro_vinit import (
    AutoKTiedNormal,
    CapturedSVI,
    GroupedAdam,
    LocalReparamMessenger,
    fit_config,
)
from pyro_vinit.data import load_digits

SIZES = (64, 400, 400, 10)
BATCHES = (128, 1000)

DETERMINISTIC = "nn (deterministic)"
BT = "bayesian-torch LinearReparameterization"
EAGER_SVI = "AutoKTiedNormal(2) + LRT, SVI"
EAGER_NATIVE = "AutoKTiedNormal(2) + LRT, native loop"
CAPTURED = "AutoKTiedNormal(2) + LRT, CapturedSVI"
FIT_PYRO_ADAM = "fit's step, SVI + pyro.optim.Adam"
FIT_GROUPED = "fit's step, SVI + GroupedAdam"
FIT_CAPTURED = "fit's step, CapturedSVI + GroupedAdam"

# (numerator, denominator, batch, target)
TARGETS = [(CAPTURED, BT, 128, 0.8), (CAPTURED, BT, 1000, 1.0)] + [
    (CAPTURED, eager, batch, None) for batch in BATCHES for eager in (EAGER_SVI, EAGER_NATIVE)
] + [(FIT_CAPTURED, BT, 128, 0.8), (FIT_CAPTURED, BT, 1000, 1.0)] + [
    (num, FIT_PYRO_ADAM, batch, None) for batch in BATCHES
    for num in (FIT_GROUPED, FIT_CAPTURED)] + [
    (FIT_CAPTURED, FIT_GROUPED, batch, None) for batch in BATCHES]
TRACE_TARGET_S = 2.0


def captured_step(x, y, num_data, lr=1e-3):
    """A ``CapturedSVI`` step under ``local_reparam()``, its first (eager) and second
    (tracing) steps taken here; also returns the tracing step's seconds."""
    model = make_model(SIZES, num_data)
    svi = CapturedSVI(model, AutoKTiedNormal(model, rank=2), pyro.optim.Adam({"lr": lr}),
                      TraceMeanField_ELBO())
    handler = LocalReparamMessenger()

    def step():
        with handler:
            svi.step(x, y)

    step()
    start = time.perf_counter()
    step()
    traced = time.perf_counter() - start
    assert svi.num_traces == 1, svi.fallback_reason
    return step, traced


def fit_step(x, y, num_data, optim, captured=False):
    """One step as :func:`~pyro_vinit.fit` takes it: ``svi.step`` under
    ``fit_config(guide).handlers()``, with ``optim``; a captured step's first
    (eager) and second (tracing) steps are taken here."""
    model = make_model(SIZES, num_data)
    guide = AutoKTiedNormal(model, rank=2)
    config = fit_config(guide)
    svi = (CapturedSVI if captured else SVI)(model, guide, optim, config.elbo())

    def step():
        with config.handlers():
            svi.step(x, y)

    for _ in range(2 if captured else 1):
        step()
    if captured:
        assert svi.num_traces == 1, svi.fallback_reason
    return step


def configurations(batch, x, y):
    xb, yb = x[:batch], y[:batch]
    configs = {DETERMINISTIC: deterministic_step(SIZES, xb, yb)}
    if BAYESIAN_TORCH is not None:
        configs[BT] = bayesian_torch_step(LinearReparameterization, SIZES, xb, yb, len(x))
    for name, make_step in ((EAGER_SVI, svi_step), (EAGER_NATIVE, native_step)):
        model = make_model(SIZES, len(x))
        configs[name] = make_step(model, AutoKTiedNormal(model, rank=2), xb, yb,
                                  handler=LocalReparamMessenger())
    configs[CAPTURED], traced = captured_step(xb, yb, len(x))
    configs[FIT_PYRO_ADAM] = fit_step(xb, yb, len(x), pyro.optim.Adam({"lr": 1e-3}))
    configs[FIT_GROUPED] = fit_step(xb, yb, len(x), GroupedAdam({"lr": 1e-3}))
    configs[FIT_CAPTURED] = fit_step(xb, yb, len(x), GroupedAdam({"lr": 1e-3}), captured=True)
    return configs, traced


def target_rows(timings):
    rows = []
    for num, den, batch, target in TARGETS:
        t = timings[batch]
        row = {"numerator": num, "denominator": den, "batch": batch, "target": target}
        if den not in t.names:
            row["skipped"] = BAYESIAN_TORCH_MISSING
        else:
            row["ratio"] = t.ratio(num, den).to_dict()
            if target is not None:
                row["met"] = row["ratio"]["median"] <= target
        rows.append(row)
    return rows


def report(results, host, load_end):
    lines = ["## Ratios (median of per-round ratios, range over rounds)", ""]
    table = []
    for row in results["targets"]:
        name = f"{row['numerator']} ÷ {row['denominator']}, batch {row['batch']}"
        target = "—" if row["target"] is None else f"≤ {row['target']}"
        if "skipped" in row:
            table.append([name, target, "skipped", "—"])
            continue
        r = row["ratio"]
        verdict = "—" if "met" not in row else ("met" if row["met"] else "not met")
        table.append([name, target, f"{r['median']:.2f} ({r['low']:.2f}–{r['high']:.2f})",
                      verdict])
    lines.append(markdown_table(["ratio", "target", "value", "verdict"], table))
    if results["bayesian_torch"] is None:
        lines += ["", BAYESIAN_TORCH_MISSING]
    for batch, t in results["times"].items():
        ms = t["median_ms"]
        lines += ["", f"## batch {batch}: step time (ms, median over rounds)", ""]
        rows = [[name, f"{v:.2f}", f"{v / ms[DETERMINISTIC]:.2f}"] for name, v in ms.items()]
        lines.append(markdown_table(["configuration", "ms", "÷ deterministic"], rows))
    traced = ", ".join(f"batch {b}: {s:.2f} s" for b, s in results["trace_seconds"].items())
    lines += ["", f"Tracing step (target ≤ {TRACE_TARGET_S} s): {traced}.", "",
              f"MLP {'→'.join(map(str, SIZES))}, TraceMeanField_ELBO, validation on, "
              f"{results['config']['threads']} thread(s), {results['config']['rounds']} rounds × "
              f"{results['config']['block']} steps; torch {host['torch']}, Pyro {host['pyro']}, "
              f"bayesian-torch {results['bayesian_torch'] or 'not installed'}; load average "
              f"(1, 5, 15 min) at the start {tuple(host['load_average'])}, at the end "
              f"{tuple(load_end)}, on {host['cpu_count']} cores."]
    return "\n".join(lines)


def main(args):
    set_threads(args.threads)
    pyro.settings.set(module_local_params=True)  # guides side by side, as nn.Modules
    pyro.set_rng_seed(0)
    host = host_info()
    x, y, _, _ = load_digits()
    timings, trace_seconds = {}, {}
    for batch in BATCHES:
        with pyro.validation_enabled(True):
            configs, trace_seconds[batch] = configurations(batch, x, y)
            timings[batch] = time_interleaved(configs, rounds=args.rounds, block=args.block,
                                              warmup=args.warmup)
        print(f"  batch {batch} done", flush=True)
    results = {
        "config": vars(args),
        "sizes": SIZES,
        "bayesian_torch": BAYESIAN_TORCH,
        "targets": target_rows(timings),
        "trace_seconds": trace_seconds,
        "times": {batch: t.to_dict() for batch, t in timings.items()},
    }
    text = report(results, host, host_info()["load_average"])
    print(text)
    if args.quick:
        return results
    write_report(result_stem(args, "bench_captured"), results, text, host_start=host)
    return results


if __name__ == "__main__":
    parser = make_parser(__doc__, timing=(10, 10, 3))
    main(parse_args(parser, quick={"rounds": 2, "block": 1, "warmup": 1}))
