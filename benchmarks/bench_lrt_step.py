"""
Step time of local reparameterization (LRT) and Flipout against ordinary
weight sampling with the same guide, and of AutoKTiedNormal's low-rank
variance path against the dense one, side by side in one run.

1. *SVI step* on a Bayesian MLP 64→400→400→400→10 (N(0, 1/D_in) priors),
   digits, batch 128, TraceMeanField_ELBO, Pyro's validation off: a
   fully factorized Normal guide at each site (closed-form KL) with ordinary
   sampling, ``LocalReparamMessenger`` and ``FlipoutMessenger``, and
   ``AutoKTiedNormal(rank=2)`` with ordinary sampling and LRT through the
   low-rank and the dense variance path. Ratios are to ordinary sampling
   with the same guide (target: LRT ≤ 1.3×).
2. *The variance term* f(x², S∘S) alone, forward and backward, for one
   400×400 k-tied weight (k = 2) at batches 128 and 1000: the dense
   ``x² (UVᵀ)²ᵀ`` against the low-rank form, whose rank is k(k+1)/2.

Configurations are timed in interleaved rounds
(``benchmarks/harness.py``); ratios are medians of per-round ratios,
with their range.

Usage::

    python -m benchmarks.bench_lrt_step --threads 1    # full run (about a minute)
    python -m benchmarks.bench_lrt_step --quick        # smoke run, no files
"""

import pyro
import torch
import torch.nn.functional as F

from benchmarks._steps import make_model, svi_step
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
from pyro_vinit import AutoKTiedNormal, AutoMeanFieldNormal, FlipoutMessenger, LocalReparamMessenger
from pyro_vinit.data import load_digits

SIZES = (64, 400, 400, 400, 10)

# name: (guide, guide kwargs, handler, the ordinary configuration it is compared with)
CONFIGS = {
    "mean-field ordinary": (AutoMeanFieldNormal, {}, None, None),
    "mean-field LRT": (AutoMeanFieldNormal, {}, LocalReparamMessenger, "mean-field ordinary"),
    "mean-field Flipout": (AutoMeanFieldNormal, {}, FlipoutMessenger, "mean-field ordinary"),
    "k-tied ordinary": (AutoKTiedNormal, {"rank": 2}, None, None),
    "k-tied LRT low-rank": (AutoKTiedNormal, {"rank": 2},
                            lambda: LocalReparamMessenger(low_rank=True), "k-tied ordinary"),
    "k-tied LRT dense": (AutoKTiedNormal, {"rank": 2},
                         lambda: LocalReparamMessenger(low_rank=False), "k-tied ordinary"),
}


def step_times(x, y, args):
    xb, yb = x[:128], y[:128]
    configs = {}
    for name, (guide_cls, kwargs, handler, _) in CONFIGS.items():
        model = make_model(SIZES, len(x))
        configs[name] = svi_step(model, guide_cls(model, **kwargs), xb, yb,
                                 handler=None if handler is None else handler())
    with pyro.validation_enabled(False):
        return time_interleaved(configs, rounds=args.rounds, block=args.block,
                                warmup=args.warmup)


def variance_term_times(args, m=400, n=400, rank=2):
    """f(x², S∘S) with S = UVᵀ, forward and backward: dense against low-rank."""
    u = torch.rand(m, rank, requires_grad=True)
    v = torch.rand(n, rank, requires_grad=True)
    a, b = torch.triu_indices(rank, rank)
    coef = torch.where(a == b, 1.0, 2.0)
    out = {}
    for batch in (128, 1000):
        x2 = torch.rand(batch, n)

        def dense(x2=x2):
            F.linear(x2, (u @ v.t()).pow(2)).sum().backward()

        def low_rank(x2=x2):
            # (UVᵀ)² = Σ_{a≤b} c_ab (u_a u_b)(v_a v_b)ᵀ: rank k(k+1)/2
            u2, v2 = u[:, a] * u[:, b] * coef, v[:, a] * v[:, b]
            F.linear(F.linear(x2, v2.t()), u2).sum().backward()

        out[batch] = time_interleaved({"dense": dense, "low-rank": low_rank},
                                      rounds=args.rounds, block=5 * args.block,
                                      warmup=args.warmup)
    return out


def report(step, term):
    lines = ["## SVI step time, 64→400→400→400→10, batch 128 (ms, validation off)", ""]
    rows = []
    for name, (*_, reference) in CONFIGS.items():
        if reference is None:
            rows.append([name, f"{step.median_ms(name):.2f}", "1.00× (reference)"])
            continue
        r = step.ratio(name, reference)
        rows.append([name, f"{step.median_ms(name):.2f}",
                     f"{r.median:.2f}× ({r.low:.2f}–{r.high:.2f})"])
    lines.append(markdown_table(["configuration", "ms", "÷ ordinary, same guide"], rows))
    lines += ["", "## Variance term f(x², S∘S) alone, 400×400, k = 2 (ms, forward + backward)",
              ""]
    rows = []
    for batch, t in term.items():
        r = t.ratio("low-rank", "dense")
        rows.append([batch, f"{t.median_ms('dense'):.3f}", f"{t.median_ms('low-rank'):.3f}",
                     f"{r.median:.2f} ({r.low:.2f}–{r.high:.2f})"])
    lines.append(markdown_table(["batch", "dense", "low-rank", "low-rank ÷ dense"], rows))
    return lines


def main(args):
    set_threads(args.threads)
    pyro.settings.set(module_local_params=True)
    pyro.set_rng_seed(0)
    host = host_info()
    x, y, _, _ = load_digits()
    step = step_times(x, y, args)
    print("  step times done", flush=True)
    term = variance_term_times(args)
    lines = report(step, term)
    end = host_info()["load_average"]
    lines += ["", f"{args.threads} thread(s), {args.rounds} rounds × {args.block} steps; "
              f"load average (1, 5, 15 min) at the start {tuple(host['load_average'])}, "
              f"at the end {tuple(end)}, on {host['cpu_count']} cores."]
    text = "\n".join(lines)
    print(text)
    if args.quick:
        return
    results = {
        "config": vars(args),
        "sizes": SIZES,
        "step_times": step.medians_ms(),
        "step_ratios": {name: step.ratio(name, ref).to_dict()
                        for name, (*_, ref) in CONFIGS.items() if ref is not None},
        "step_rounds": step.to_dict(),
        "variance_term": {batch: t.medians_ms() for batch, t in term.items()},
        "variance_term_ratio": {batch: t.ratio("low-rank", "dense").to_dict()
                                for batch, t in term.items()},
    }
    path = result_stem(args, "bench_lrt_step")
    write_report(path, results, text, host_start=host)


if __name__ == "__main__":
    main(parse_args(make_parser(__doc__, timing=(15, 10, 3)),
                    quick={"rounds": 2, "block": 1, "warmup": 1}))
