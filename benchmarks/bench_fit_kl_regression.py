"""
Does :func:`~pyro_vinit.fit`'s KL weight of 0.01 (chosen on classification)
serve a regression with a learned noise? Test MNLL and RMSE of ``fit`` at KL
weights 0.01, 0.1 and 1 on two regressions: scikit-learn's diabetes (354
training rows, standardized, ReLU MLP 10-50-50-1) and the toy regression of
:func:`~pyro_vinit.data.toy_regression` (500 rows, tanh MLP 1-50-50-1).

Each run: ``BayesianRegressor(bayesianize(net), learn_noise=True)``,
``AutoKTiedNormal(rank=2)``, ``fit(steps=S, kl_weight=λ, capture=False)``
(I-BLM, then fit's recipe otherwise), the test set evaluated (32 guide
draws) right after I-BLM and every S/10 steps. Per problem and λ: medians
over seeds of the test MNLL at the start, its best and last value, and the
last RMSE, with the learned noise scale at the end.

Usage::

    python -m benchmarks.bench_fit_kl_regression          # 2 problems, 3 weights, 3 seeds
    python -m benchmarks.bench_fit_kl_regression --quick  # smoke run, files under /tmp
"""

import os
import statistics
import tempfile
import warnings

import pyro
from torch import nn
from tqdm.auto import tqdm

from benchmarks.harness import (
    host_info,
    make_parser,
    markdown_table,
    parse_args,
    result_stem,
    set_threads,
    write_report,
)
from pyro_vinit import AutoKTiedNormal, fit
from pyro_vinit.data import load_diabetes, toy_regression
from pyro_vinit.nn import BayesianRegressor, bayesianize, mlp

PROBLEMS = {
    "diabetes": dict(data=lambda: load_diabetes(test_fraction=0.2, seed=0),
                     sizes=(10, 50, 50, 1), activation=nn.ReLU),
    "toy": dict(data=toy_regression, sizes=(1, 50, 50, 1), activation=nn.Tanh),
}


def run(name, kl_weight, seed, steps, num_samples):
    """One fit of ``name`` at ``kl_weight``: its test curve and end noise scale."""
    spec = PROBLEMS[name]
    x, y, x_test, y_test = spec["data"]()
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    model = BayesianRegressor(bayesianize(mlp(spec["sizes"], spec["activation"])),
                              num_data=len(x), learn_noise=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        history = fit(model, AutoKTiedNormal(model, rank=2), (x, y), steps=steps,
                      kl_weight=kl_weight, capture=False, validation=(x_test, y_test),
                      eval_every=max(1, steps // 10), num_samples=num_samples, progress=False)
    curve = [{"step": int(v["step"]), "mnll": v["mnll"], "rmse": v["rmse"]}
             for v in history.validation]
    return {"problem": name, "kl_weight": kl_weight, "seed": seed, "curve": curve,
            "start_mnll": curve[0]["mnll"], "best_mnll": min(c["mnll"] for c in curve),
            "last_mnll": curve[-1]["mnll"], "last_rmse": curve[-1]["rmse"],
            "noise_scale": float(model.noise_scale.detach())}


def summarize(rows):
    """Medians over seeds, per (problem, KL weight)."""
    out = {}
    for row in rows:
        out.setdefault((row["problem"], row["kl_weight"]), []).append(row)
    keys = ("start_mnll", "best_mnll", "last_mnll", "last_rmse", "noise_scale")
    return {key: {k: statistics.median(r[k] for r in runs) for k in keys}
            for key, runs in out.items()}


def main(args):
    set_threads(args.threads)
    host = host_info()
    jobs = [(name, lam, seed) for name in args.problems for lam in args.kl_weights
            for seed in args.seeds]
    rows = []
    for name, lam, seed in tqdm(jobs, desc="fit_kl_regression", disable=args.quick):
        rows.append(run(name, lam, seed, args.steps, args.num_samples))
    summary = summarize(rows)
    table = [[name, f"{lam:g}"] + [f"{s[k]:.3f}" for k in ("start_mnll", "best_mnll",
                                                            "last_mnll", "last_rmse",
                                                            "noise_scale")]
             for (name, lam), s in summary.items()]
    text = "\n".join([
        f"## fit on regressions with a learned noise: test MNLL / RMSE by KL weight "
        f"(medians over seeds {args.seeds}, {args.steps} steps)", "",
        markdown_table(["problem", "KL weight", "MNLL after I-BLM", "best MNLL", "last MNLL",
                        "last RMSE", "noise scale at the end"], table),
        "", f"{args.num_samples} guide draws per evaluation, every {max(1, args.steps // 10)} "
        f"steps; {args.threads} thread(s)."])
    print(text)
    write_report(result_stem(args, "bench_fit_kl_regression"),
                 {"config": vars(args),
                  "summary": [{"problem": n, "kl_weight": lam, **s}
                              for (n, lam), s in summary.items()],
                  "runs": rows}, text, host_start=host)


if __name__ == "__main__":
    parser = make_parser(__doc__, quick_help="smoke run: a few steps, files under /tmp")
    parser.add_argument("--problems", nargs="+", choices=list(PROBLEMS), default=list(PROBLEMS))
    parser.add_argument("--kl-weights", nargs="+", type=float, default=[0.01, 0.1, 1.0])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--num-samples", type=int, default=32)
    main(parse_args(parser, quick={
        "kl_weights": [0.01, 1.0], "seeds": [0], "steps": 10, "num_samples": 4,
        "out": os.path.join(tempfile.gettempdir(), "bench_fit_kl_regression_quick")}))
