"""
Does :func:`~pyro_vinit.fit`'s KL weight of 0.01 (chosen on classification)
serve a regression with a learned noise? Held-out test MNLL and RMSE of
``fit`` at KL weights 0.01, 0.03, 0.1, 0.2, 0.3 and 1 on eight regressions that
install offline: scikit-learn's diabetes (354 training rows, standardized,
ReLU MLP 10-50-50-1), the toy regression of
:func:`~pyro_vinit.data.toy_regression` (500 rows, tanh MLP 1-50-50-1),
scikit-learn's generators ``make_friedman1`` (10 inputs, noise 1, at 200 and
2000 rows), ``make_friedman2`` and ``make_friedman3`` (noise half the signal's
standard deviation), ``make_regression`` (a linear target with noise, fit by
a nonlinear MLP anyway), and a heteroscedastic sine written here (noise
standard deviation from 0.1 to 0.7 against the model's one learned scale).
The generated problems are standardized on their training rows and tested on
1000 fresh rows from the same generator. Four probes of a rule change one
thing of those: the toy regression with ReLU, Friedman 1 (200 rows) with tanh
or with a narrower MLP 10-20-20-1, and the sine with 9 unrelated inputs more.

Each run: ``BayesianRegressor(bayesianize(net), learn_noise=True)``,
``AutoKTiedNormal(rank=2)``, I-BLM with fit's options
(:meth:`~pyro_vinit.FitConfig.iblm_options`, called here so that the noise
scale it finds is recorded), then ``fit(steps=S, kl_weight=λ)`` with fit's
other defaults; the test set is evaluated (32 guide draws) right after I-BLM
and every S/10 steps. Per problem and λ: medians over seeds of the test MNLL
at the start, its best and last value, and the last RMSE, with the learned
noise scale at the end. Then, per λ and over problems, the excess of the last
test MNLL over the best λ's on that problem (in nats: MNLL can be negative,
so no ratios), and the problems that end worse than right after I-BLM; and,
per problem, what ``fit`` could see before training (N, inputs, weights,
I-BLM's noise scale) beside the KL weights within 0.05 nats of the best.
With ``--fixed-noise SCALE`` the noise scale is fixed at ``SCALE`` instead
(``BayesianRegressor``'s default, ``learn_noise=False``).

Usage::

    python -m benchmarks.bench_fit_kl_regression          # 12 problems, 6 weights, 5 seeds: ~1 h
    python -m benchmarks.bench_fit_kl_regression --quick  # smoke run, files under /tmp
    python -m benchmarks.bench_fit_kl_regression --resume # go on from an interrupted run
    python -m benchmarks.bench_fit_kl_regression --fixed-noise 1 --tag _fixed_noise \
        --problems diabetes friedman1_200 linear toy hetero_sine_10d --kl-weights 0.01 0.3 1
    python -m benchmarks.bench_fit_kl_regression \\
        --from-json benchmarks/results/bench_fit_kl_regression.json  # tables only
"""

import json
import math
import os
import statistics
import tempfile
import time
import warnings

import numpy as np
import pyro
import torch
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
from pyro_vinit import AutoKTiedNormal, FitConfig, fit, init_guide_iblm
from pyro_vinit.data import load_diabetes, toy_function, toy_regression
from pyro_vinit.nn import BayesianRegressor, bayesianize, mlp

NUM_TEST = 1000  # fresh test rows of the generated problems
TOLERANCE = 0.05  # nats of last test MNLL over the best KL weight's: "as good"
_HALF_LOG_2PI = 0.5 * math.log(2 * math.pi)


def _nll(y, mean, scale):
    """Mean Gaussian negative log-likelihood (numpy)."""
    return float(np.mean(_HALF_LOG_2PI + np.log(scale) + 0.5 * ((y - mean) / scale) ** 2))


def _standardized(x, y, f, scale, n_train):
    """Train/test split of a generated problem (the first ``n_train`` rows train),
    inputs and targets standardized on the training rows, as float32 tensors; with
    the test MNLL of the truth (mean ``f`` and noise ``scale``, in the same units)."""
    mx, sx = x[:n_train].mean(0), x[:n_train].std(0)
    my, sy = y[:n_train].mean(), y[:n_train].std()
    x, y, f, scale = (x - mx) / sx, (y - my) / sy, (f - my) / sy, scale / sy
    scale = np.broadcast_to(scale, y.shape)
    oracle = _nll(y[n_train:], f[n_train:], scale[n_train:])

    def t(a):
        return torch.as_tensor(np.ascontiguousarray(a), dtype=torch.float32)

    return (t(x[:n_train]), t(y[:n_train]), t(x[n_train:]), t(y[n_train:])), oracle


def friedman(which, n_train, noise):
    """scikit-learn's ``make_friedman{which}`` with ``noise``: ``n_train`` rows, then
    :data:`NUM_TEST` test rows."""
    from sklearn import datasets

    make = getattr(datasets, f"make_friedman{which}")
    n = n_train + NUM_TEST
    x, y = make(n_samples=n, noise=noise, random_state=0)
    x_clean, f = make(n_samples=n, noise=0.0, random_state=0)  # the same inputs, no noise
    assert np.array_equal(x, x_clean)
    return _standardized(x, y, f, noise, n_train)


def linear(n_train, noise):
    """scikit-learn's ``make_regression``: 10 inputs, 5 of them informative, a linear
    target with Gaussian ``noise``."""
    from sklearn.datasets import make_regression

    x, y, coef = make_regression(n_samples=n_train + NUM_TEST, n_features=10, n_informative=5,
                                 noise=noise, shuffle=False, coef=True, random_state=0)
    return _standardized(x, y, x @ coef, noise, n_train)


def hetero_sine(n_train, distractors=0):
    """:math:`x \\sim U[-3, 3]`, :math:`y = \\sin 2x + (0.1 + 0.2|x|)\\,\\varepsilon`: the
    noise standard deviation grows sevenfold across the inputs; the model has one. With
    ``distractors``, that many inputs more, :math:`U[-3, 3]` and unrelated to ``y`` (the
    same ``x`` and ``y`` otherwise)."""
    rng = np.random.RandomState(0)
    x = rng.uniform(-3, 3, size=(n_train + NUM_TEST, 1))
    f, scale = np.sin(2 * x[:, 0]), 0.1 + 0.2 * np.abs(x[:, 0])
    y = f + scale * rng.standard_normal(f.shape)
    if distractors:
        extra = np.random.RandomState(1).uniform(-3, 3, size=(len(x), distractors))
        x = np.concatenate([x, extra], axis=1)
    return _standardized(x, y, f, scale, n_train)


def diabetes():
    return load_diabetes(test_fraction=0.2, seed=0), None


def toy():
    split = toy_regression()
    x_test, y_test = split[2].double().numpy()[:, 0], split[3].double().numpy()
    return split, _nll(y_test, toy_function(torch.as_tensor(x_test)).numpy(), math.exp(-1))


# Friedman 2 and 3: noise half the signal's standard deviation (377.9 and 0.316 over
# 1e5 draws), an R² of 0.8 for the truth; make_regression's signal sd is 148.
PROBLEMS = {
    "diabetes": dict(data=diabetes, sizes=(10, 50, 50, 1), activation=nn.ReLU),
    "toy": dict(data=toy, sizes=(1, 50, 50, 1), activation=nn.Tanh),
    "friedman1_200": dict(data=lambda: friedman(1, 200, 1.0), sizes=(10, 50, 50, 1),
                          activation=nn.ReLU),
    "friedman1_2000": dict(data=lambda: friedman(1, 2000, 1.0), sizes=(10, 50, 50, 1),
                           activation=nn.ReLU),
    "friedman2": dict(data=lambda: friedman(2, 500, 190.0), sizes=(4, 50, 50, 1),
                      activation=nn.ReLU),
    "friedman3": dict(data=lambda: friedman(3, 500, 0.16), sizes=(4, 50, 50, 1),
                      activation=nn.Tanh),
    "linear": dict(data=lambda: linear(300, 70.0), sizes=(10, 50, 50, 1), activation=nn.ReLU),
    "hetero_sine": dict(data=lambda: hetero_sine(300), sizes=(1, 50, 50, 1),
                        activation=nn.Tanh),
    # PROBES of a rule: each changes one thing of a problem above (the activation, the
    # width, or 9 unrelated inputs more)
    "toy_relu": dict(data=toy, sizes=(1, 50, 50, 1), activation=nn.ReLU),
    "friedman1_200_tanh": dict(data=lambda: friedman(1, 200, 1.0), sizes=(10, 50, 50, 1),
                               activation=nn.Tanh),
    "friedman1_200_narrow": dict(data=lambda: friedman(1, 200, 1.0), sizes=(10, 20, 20, 1),
                                 activation=nn.ReLU),
    "hetero_sine_10d": dict(data=lambda: hetero_sine(300, distractors=9),
                            sizes=(10, 50, 50, 1), activation=nn.Tanh),
}
PROBES = ("toy_relu", "friedman1_200_tanh", "friedman1_200_narrow", "hetero_sine_10d")


def _noise(model):
    return float(torch.as_tensor(model.noise_scale).detach())


def run(name, kl_weight, seed, steps, num_samples, fixed_noise=None):
    """One fit of ``name`` at ``kl_weight``: its test curve, I-BLM's and the end's
    noise scale (a learned one, or ``fixed_noise`` throughout)."""
    spec = PROBLEMS[name]
    (x, y, x_test, y_test), _ = spec["data"]()
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    net = mlp(spec["sizes"], spec["activation"])
    num_weights = sum(p.numel() for p in net.parameters())
    model = (BayesianRegressor(bayesianize(net), num_data=len(x), learn_noise=True)
             if fixed_noise is None else
             BayesianRegressor(bayesianize(net), noise_scale=fixed_noise, num_data=len(x)))
    guide = AutoKTiedNormal(model, rank=2)
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # fit's own I-BLM (its options, the whole training pair), run here to read the
        # noise scale it sets; fit then sees an initialized guide and only trains
        init_guide_iblm(guide, (x, y), **FitConfig().iblm_options(len(x)))
        iblm_noise = _noise(model)
        history = fit(model, guide, (x, y), steps=steps, kl_weight=kl_weight,
                      validation=(x_test, y_test), eval_every=max(1, steps // 10),
                      num_samples=num_samples, progress=False)
    curve = [{"step": int(v["step"]), "mnll": v["mnll"], "rmse": v["rmse"]}
             for v in history.validation]
    return {"problem": name, "kl_weight": kl_weight, "seed": seed, "curve": curve,
            "num_data": len(x), "input_dim": spec["sizes"][0], "num_weights": num_weights,
            "iblm_noise": iblm_noise, "captured": history.captured,
            "start_mnll": curve[0]["mnll"], "best_mnll": min(c["mnll"] for c in curve),
            "last_mnll": curve[-1]["mnll"], "last_rmse": curve[-1]["rmse"],
            "noise_scale": _noise(model),
            "seconds": time.perf_counter() - start}


def summarize(rows):
    """Medians over seeds, per (problem, KL weight), and the spread of the last MNLL."""
    out = {}
    for row in rows:
        out.setdefault((row["problem"], row["kl_weight"]), []).append(row)
    keys = ("start_mnll", "best_mnll", "last_mnll", "last_rmse", "noise_scale", "iblm_noise")
    return {key: {**{k: statistics.median(r[k] for r in runs) for k in keys},
                  "last_mnll_range": max(r["last_mnll"] for r in runs)
                  - min(r["last_mnll"] for r in runs),
                  "runs_worse": sum(r["last_mnll"] > r["start_mnll"] for r in runs),
                  "seeds": len(runs)}
            for key, runs in out.items()}


def per_problem(rows, summary):
    """Per problem: what fit sees before training, the truth's MNLL, and the excess of
    each KL weight's (median) last test MNLL over the best weight's, in nats."""
    out = {}
    for name in dict.fromkeys(r["problem"] for r in rows):
        lams = sorted(lam for (n, lam) in summary if n == name)
        last = {lam: summary[name, lam]["last_mnll"] for lam in lams}
        best = min(last.values())
        first = next(r for r in rows if r["problem"] == name)
        out[name] = {
            "num_data": first["num_data"], "input_dim": first["input_dim"],
            "num_weights": first["num_weights"],
            "iblm_noise": statistics.median(r["iblm_noise"] for r in rows
                                            if r["problem"] == name),
            "oracle_mnll": first.get("oracle_mnll"),
            "best_last_mnll": best,
            "best_kl_weight": min(lams, key=last.get),
            "excess": {lam: last[lam] - best for lam in lams},
        }
    return out


def per_weight(problems, summary, names):
    """Per KL weight, over the problems ``names``: the mean and worst excess (nats), the
    problems within :data:`TOLERANCE`, and those whose median run ends worse than after
    I-BLM."""
    lams = sorted({lam for p in problems.values() for lam in p["excess"]})
    out = {}
    for lam in lams:
        excess = {n: problems[n]["excess"][lam] for n in names if lam in problems[n]["excess"]}
        worst = max(excess, key=excess.get)
        cells = [summary[n, lam] for n in excess]
        out[lam] = {"mean_excess": statistics.mean(excess.values()),
                    "worst_excess": excess[worst], "worst_problem": worst,
                    "within": sum(e <= TOLERANCE for e in excess.values()),
                    "problems": len(excess),
                    "ends_worse": sorted(n for n in excess
                                         if summary[n, lam]["last_mnll"]
                                         > summary[n, lam]["start_mnll"]),
                    "runs_worse": sum(c["runs_worse"] for c in cells),
                    "runs": sum(c["seeds"] for c in cells)}
    return out


def report(rows, config):
    summary = summarize(rows)
    problems = per_problem(rows, summary)
    groups = {"problems": [n for n in problems if n not in PROBES]}
    if any(n in PROBES for n in problems):
        groups["problems and probes"] = list(problems)
    weights = {group: per_weight(problems, summary, names) for group, names in groups.items()}
    lams = sorted(weights["problems"])
    detail = [[name, f"{lam:g}"] + [f"{s[k]:.3f}" for k in ("start_mnll", "best_mnll",
                                                             "last_mnll", "last_mnll_range",
                                                             "last_rmse", "noise_scale")]
              for (name, lam), s in summary.items()]
    excess = [[name, p["num_data"], p["input_dim"], p["num_weights"],
               f"{p['num_data'] / p['num_weights']:.2f}", f"{p['iblm_noise']:.3f}",
               "–" if p["oracle_mnll"] is None else f"{p['oracle_mnll']:.3f}",
               f"{p['best_last_mnll']:.3f}"]
              + [f"**{p['excess'][lam]:.3f}**" if p["excess"][lam] <= TOLERANCE
                 else f"{p['excess'][lam]:.3f}" for lam in lams]
              for name, p in problems.items()]
    per_lam = [[group, f"{lam:g}", f"{w['mean_excess']:.3f}",
                f"{w['worst_excess']:.3f} ({w['worst_problem']})",
                f"{w['within']}/{w['problems']}",
                f"{len(w['ends_worse'])}/{w['problems']}"
                + (f" ({', '.join(w['ends_worse'])})" if w["ends_worse"] else ""),
                f"{w['runs_worse']}/{w['runs']}"]
               for group, by_lam in weights.items() for lam, w in by_lam.items()]
    seeds, steps = config["seeds"], config["steps"]
    every = max(1, steps // 10)
    fixed = config.get("fixed_noise")
    noise = "learned noise" if fixed is None else f"fixed noise {fixed:g}"
    text = "\n".join([
        f"## fit on regressions with a {noise}: test MNLL / RMSE by KL weight "
        f"(medians over seeds {seeds}, {steps} steps)", "",
        markdown_table(["problem", "KL weight", "MNLL after I-BLM", "best MNLL", "last MNLL",
                        "last MNLL range over seeds", "last RMSE", "noise scale at the end"],
                       detail),
        "", f"{config['num_samples']} guide draws per evaluation, every {every} steps; "
        f"{config['threads']} thread(s). RMSE and noise scale in the standardized units "
        f"of the target (toy: raw). {len(rows)} runs, "
        f"{sum(r['seconds'] for r in rows) / 60:.0f} min of I-BLM and fitting"
        + (" (made in parts with --resume: the JSON's host and load average are the last "
           "part's)." if config.get("resume") else "."), "",
        "## Per KL weight, over problems: excess of the last test MNLL over the best KL "
        "weight's on the problem", "",
        "The excess is in nats (last MNLL minus the lowest last MNLL among the KL weights on "
        "that problem, medians over seeds), not a ratio: MNLL can be negative. "
        f"\"Within {TOLERANCE}\" counts the problems whose excess is at most {TOLERANCE} "
        "nats; \"ends worse than after I-BLM\" the problems whose median last MNLL is "
        "above their median MNLL right after I-BLM, and the runs (problem × seed) that do. "
        f"Over the {len(groups['problems'])} problems, then with the "
        f"{len(problems) - len(groups['problems'])} probes ({', '.join(PROBES)}).",
        "",
        markdown_table(["over", "KL weight", "mean excess (nats)", "worst excess (nats)",
                        f"problems within {TOLERANCE}", "problems ending worse than after "
                        "I-BLM", "runs ending worse than after I-BLM"], per_lam),
        "",
        "## Per problem: what fit sees before training, and each KL weight's excess (nats)",
        "",
        "N training rows, D inputs, W network weights, I-BLM's noise scale (median over "
        "seeds, standardized units); the truth's test MNLL (the generator's mean and noise) "
        f"where known; in bold the KL weights within {TOLERANCE} nats of the best.", "",
        markdown_table(["problem", "N", "D", "W", "N/W", "I-BLM noise", "truth's MNLL",
                        "best last MNLL"] + [f"λ={lam:g}" for lam in lams], excess),
    ])
    return text, summary, problems, weights


def _for_json(summary, problems, weights):
    return {"summary": [{"problem": n, "kl_weight": lam, **s}
                        for (n, lam), s in summary.items()],
            "problems": {n: {**p, "excess": {f"{lam:g}": v for lam, v in p["excess"].items()}}
                         for n, p in problems.items()},
            "per_kl_weight": {group: {f"{lam:g}": w for lam, w in by_lam.items()}
                              for group, by_lam in weights.items()}}


def rereport(args):
    """The tables of a saved run (``--from-json``), rewritten without training."""
    with open(args.from_json) as f:
        saved = json.load(f)
    text, *tables = report(saved["runs"], saved["config"])
    print(text)
    stem = result_stem(args, "bench_fit_kl_regression")
    os.makedirs(os.path.dirname(stem), exist_ok=True)
    with open(stem + ".json", "w") as f:  # the run's host, not this one's
        json.dump({**saved, **_for_json(*tables)}, f, indent=2)
        f.write("\n")
    with open(stem + ".md", "w") as f:
        f.write(text + "\n")
    print(f"\nwrote {stem}.json and .md")


def main(args):
    if args.from_json:
        return rereport(args)
    set_threads(args.threads)
    host = host_info()
    stem = result_stem(args, "bench_fit_kl_regression")
    partial = stem + "_partial.json"  # every finished run, for --resume
    rows = []
    if args.resume and os.path.exists(partial):
        with open(partial) as f:
            rows = json.load(f)
    done = {(r["problem"], r["kl_weight"], r["seed"]) for r in rows}
    oracle = {name: PROBLEMS[name]["data"]()[1] for name in args.problems}
    # seed by seed, so that an interrupted run has every problem and weight at some seeds
    jobs = [(name, lam, seed) for seed in args.seeds for name in args.problems
            for lam in args.kl_weights if (name, lam, seed) not in done]
    os.makedirs(os.path.dirname(stem), exist_ok=True)
    with tqdm(jobs, desc="fit_kl_regression", disable=args.quick) as bar:
        for name, lam, seed in bar:
            bar.set_postfix_str(f"{name} λ={lam:g} seed={seed}")
            rows.append({**run(name, lam, seed, args.steps, args.num_samples,
                               args.fixed_noise),
                         "oracle_mnll": oracle[name]})
            with open(partial, "w") as f:
                json.dump(rows, f)
    wanted = {(n, lam, s) for n in args.problems for lam in args.kl_weights for s in args.seeds}
    rows = [r for r in rows if (r["problem"], r["kl_weight"], r["seed"]) in wanted]
    config = vars(args)
    text, *tables = report(rows, config)
    print(text)
    write_report(stem, {"config": config, **_for_json(*tables), "runs": rows}, text,
                 host_start=host)
    os.remove(partial)


if __name__ == "__main__":
    parser = make_parser(__doc__, quick_help="smoke run: a few steps, files under /tmp")
    parser.add_argument("--problems", nargs="+", choices=list(PROBLEMS), default=list(PROBLEMS))
    parser.add_argument("--kl-weights", nargs="+", type=float,
                        default=[0.01, 0.03, 0.1, 0.2, 0.3, 1.0])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4])
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--num-samples", type=int, default=32)
    parser.add_argument("--fixed-noise", type=float, default=None, metavar="SCALE",
                        help="a fixed noise scale instead of a learned one")
    parser.add_argument("--resume", action="store_true",
                        help="skip the runs an interrupted run of these options saved")
    parser.add_argument("--from-json", default=None,
                        help="rewrite the tables of this saved run's JSON (no training)")
    main(parse_args(parser, quick={
        "kl_weights": [0.01, 1.0], "seeds": [0], "steps": 10, "num_samples": 4,
        "out": os.path.join(tempfile.gettempdir(), "bench_fit_kl_regression_quick")}))
