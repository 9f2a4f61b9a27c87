"""
I-BLM initialization time versus layer width, and its ratio to one SVI step.

Bayesian ReLU MLP 64→h→h→h→10 (N(0, 1/D_in) priors) on scikit-learn digits,
AutoNormal, batch 128 (each unit's minibatch for I-BLM, the SVI minibatch
for the step), h ∈ {100, 250, 500, 1000}, CPU, one thread. Rounds are
interleaved (each width runs once per round), so that machine noise hits all
widths alike. The SVI step is Trace_ELBO with Adam (lr 1e-3), the median of
20 steps after a warm-up. The machine is shared with other jobs, so each
figure is the minimum over rounds (the least disturbed one).

A hidden h→h layer has h² weights and each unit's solve reads a B×h design,
so the work per layer is ∝ h·B·h: the cost is linear in the number of
weights, i.e. linear in h per unit. The script reports seconds, seconds per
million weights, the ratio to one SVI step, and the fitted exponent of time
against h.

Usage::

    python -m benchmarks.bench_iblm_time            # full run (~2 minutes)
    python -m benchmarks.bench_iblm_time --quick    # smoke run
"""

import statistics
import time

import pyro
import torch
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoNormal

from benchmarks.harness import fit_exponent, make_parser, parse_args, result_stem, write_json
from pyro_vinit import init_guide_iblm
from pyro_vinit.data import load_digits
from pyro_vinit.nn import BayesianClassifier, bayesianize, mlp


def one_round(width, depth, x, y, batch_size, svi_steps):
    pyro.clear_param_store()
    model = BayesianClassifier(bayesianize(mlp((64,) + (width,) * depth + (10,))), num_data=len(x))
    guide = AutoNormal(model)
    guide(x[:batch_size], y[:batch_size])  # set up outside the timing
    start = time.perf_counter()
    init_guide_iblm(guide, (x, y), batch_size=batch_size)
    init_seconds = time.perf_counter() - start

    svi = SVI(model, guide, pyro.optim.Adam({"lr": 1e-3}), Trace_ELBO())
    batches = [torch.randint(0, len(x), (batch_size,)) for _ in range(svi_steps + 3)]
    for idx in batches[:3]:  # warm-up
        svi.step(x[idx], y[idx])
    times = []
    for idx in batches[3:]:
        start = time.perf_counter()
        svi.step(x[idx], y[idx])
        times.append(time.perf_counter() - start)
    num_weights = sum(v.numel() for v in guide.median().values())
    return init_seconds, statistics.median(times), num_weights


def main(args):
    torch.set_num_threads(args.threads)
    pyro.set_rng_seed(0)
    x, y, _, _ = load_digits()
    widths = args.widths
    init_times = {w: [] for w in widths}
    step_times = {w: [] for w in widths}
    num_weights = {}
    for r in range(args.rounds):
        for w in widths:
            t_init, t_step, n = one_round(w, args.depth, x, y, args.batch_size, args.svi_steps)
            init_times[w].append(t_init)
            step_times[w].append(t_step)
            num_weights[w] = n
            print(f"round {r} h={w}: init {t_init:.3f}s, SVI step {1000 * t_step:.1f} ms",
                  flush=True)
    rows = []
    for w in widths:
        t_init, t_step = min(init_times[w]), min(step_times[w])
        rows.append({
            "width": w,
            "num_weights": num_weights[w],
            "init_seconds": t_init,
            "init_seconds_per_million_weights": t_init / num_weights[w] * 1e6,
            "svi_step_seconds": t_step,
            "init_over_svi_step": t_init / t_step,
        })
    exponent = fit_exponent(widths, [r["init_seconds"] for r in rows])
    exponent_weights = fit_exponent([r["num_weights"] for r in rows],
                                    [r["init_seconds"] for r in rows])
    result = {
        "setup": {
            "model": f"ReLU MLP 64-{'-'.join(['h'] * args.depth)}-10, N(0, 1/D_in) priors",
            "data": "scikit-learn digits, 1257 training rows",
            "guide": "AutoNormal",
            "batch_size": args.batch_size,
            "threads": args.threads,
            "rounds": args.rounds,
            "svi": f"Trace_ELBO, Adam lr 1e-3, median of {args.svi_steps} steps",
        },
        "rows": rows,
        "exponent_time_vs_width": exponent,
        "exponent_time_vs_num_weights": exponent_weights,
    }
    print()
    print("| h | weights | I-BLM init (s) | s per 10⁶ weights | SVI step (ms) | init ÷ step |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['width']} | {r['num_weights']:,} | {r['init_seconds']:.2f} | "
              f"{r['init_seconds_per_million_weights']:.2f} | {1000 * r['svi_step_seconds']:.1f} | "
              f"{r['init_over_svi_step']:.0f} |")
    print(f"\ntime ∝ h^{exponent:.2f}; time ∝ (number of weights)^{exponent_weights:.2f}")
    if args.quick:
        return
    stem = result_stem(args, "bench_iblm_time")
    write_json(stem + ".json", result)
    plot(rows, stem + ".png")


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    h = [r["width"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    t = [r["init_seconds"] for r in rows]
    axes[0].loglog(h, t, "o-", label="I-BLM init")
    for power, style in [(1, ":"), (2, "--")]:
        axes[0].loglog(h, [t[0] * (v / h[0]) ** power for v in h], "k" + style,
                       label=f"∝ h^{power}", alpha=0.5)
    axes[0].set_xlabel("width h")
    axes[0].set_ylabel("seconds")
    axes[0].legend()
    axes[1].semilogx(h, [r["init_over_svi_step"] for r in rows], "o-")
    axes[1].set_xlabel("width h")
    axes[1].set_ylabel("init time ÷ one SVI step")
    axes[1].set_ylim(bottom=0)
    fig.suptitle("I-BLM on digits, MLP 64-h-h-h-10, batch 128")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    parser = make_parser(__doc__, tag=False, quick_help="one small round, no files")
    parser.add_argument("--widths", type=int, nargs="+", default=[100, 250, 500, 1000])
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--svi-steps", type=int, default=20)
    main(parse_args(parser, quick={"widths": [50, 100], "rounds": 1, "svi_steps": 3}))
