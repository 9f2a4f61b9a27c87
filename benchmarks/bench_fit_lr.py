"""
Does :func:`~pyro_vinit.fit`'s best learning rate follow
:math:`0.015\\sqrt{N/W}` on problems that were not used to find that rule? A
held-out check: test MNLL of fit's recipe over a grid of learning rates, on
six problems of N training rows and W latent weights, against the rule's
rate and the constant 3e-3.

Problems (80/20 train/test split with seed 0, inputs standardized on the
training rows; images by one mean and scale over all pixels, tabular data
per feature; MNIST-1D is standardized by its generator): digits with MLPs
64-50-10 and 64-400-400-10; MNIST-5k (``load_mnist(image=True)``) with a
CNN Conv2d(1, 16, 5, stride 2)-ReLU-Conv2d(16, 32, 5, stride 2)-ReLU-Linear(512,
10); breast cancer with 30-100-100-2; MNIST-1D (``load_mnist1d``) with
40-100-100-10; diabetes regression with 10-50-50-1 and a learned noise scale
(``BayesianRegressor(learn_noise=True)``). Each run: ``bayesianize`` (N(0,
1/D_in) priors), ``AutoKTiedNormal(rank=2)``, then
``fit(steps=S, batch_size=128, lr=lr, capture=False)`` (I-BLM, GroupedAdam
with its warm-up, KL weight 0.01, ``local_reparam(conv=False)``), the test
set evaluated (32 guide draws) right after I-BLM and every S/10 steps. W is
the number of elements of the guide's latent sample sites.

Per problem and learning rate: the median over seeds of the best test MNLL
over the evaluations after I-BLM, and of the final one. Per problem: the
test MNLL right after I-BLM, and the grid's best rate against the rule's
nearest grid point and against 3e-3 (always run, as the control: fit's
default when this was written), with the number of seeds on which the
rule's point beats 3e-3 (paired: a seed gives both the same I-BLM start).
Time is judged by steps only: S per problem is about 10 s of eager steps
on one thread of a shared host (``PROBLEMS``).

Usage::

    python -m benchmarks.bench_fit_lr                 # 6 problems, 6 rates, 3 seeds (~18 min)
    python -m benchmarks.bench_fit_lr --quick         # smoke run, files under /tmp
    python -m benchmarks.bench_fit_lr --problems mnist_cnn --lrs 2e-3 8e-3 --seeds 0
    python -m benchmarks.bench_fit_lr --from-json benchmarks/results/bench_fit_lr.json
"""

import json
import math
import os
import statistics
import tempfile
import time
import warnings

import pyro
import torch
from torch import nn
from tqdm.auto import tqdm

from benchmarks.harness import (
    host_info,
    iblm_options,
    make_parser,
    markdown_table,
    parse_args,
    result_stem,
    set_threads,
    write_report,
)
from pyro_vinit import AutoKTiedNormal, fit
from pyro_vinit.data import load_diabetes, load_digits, load_mnist, load_mnist1d
from pyro_vinit.nn import BayesianClassifier, BayesianRegressor, bayesianize, mlp

#: The rule under test: lr = RULE_COEF * sqrt(N / W).
RULE_COEF = 0.015
#: The constant it would replace, always run as the control.
CONTROL_LR = 3e-3
BATCH_SIZE = 128
TEST_FRACTION = 0.2
SPLIT_SEED = 0


def _standardize_images(split):
    x, y, xt, yt = split
    mean, scale = x.mean(), x.std()
    return (x - mean) / scale, y, (xt - mean) / scale, yt


def _breast_cancer():
    from sklearn.datasets import load_breast_cancer

    data = load_breast_cancer()
    x = torch.as_tensor(data.data, dtype=torch.float32)
    y = torch.as_tensor(data.target, dtype=torch.long)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(SPLIT_SEED))
    n_test = round(TEST_FRACTION * len(x))
    test, train = perm[:n_test], perm[n_test:]
    mean, scale = x[train].mean(0), x[train].std(0)
    return (x[train] - mean) / scale, y[train], (x[test] - mean) / scale, y[test]


def _cnn():
    # 28 -> 12 -> 4 pixels a side
    return nn.Sequential(nn.Conv2d(1, 16, 5, stride=2), nn.ReLU(),
                         nn.Conv2d(16, 32, 5, stride=2), nn.ReLU(),
                         nn.Flatten(), nn.Linear(32 * 4 * 4, 10))


#: Per problem: its data, its network, a regression or not, and its steps S (about
#: 10 s of eager training on one thread of the host the results were taken on).
PROBLEMS = {
    "digits_50": dict(
        data=lambda: _standardize_images(load_digits(test_fraction=TEST_FRACTION,
                                                     seed=SPLIT_SEED)),
        net=lambda: mlp((64, 50, 10)), regression=False, steps=2000),
    "digits_400x2": dict(
        data=lambda: _standardize_images(load_digits(test_fraction=TEST_FRACTION,
                                                     seed=SPLIT_SEED)),
        net=lambda: mlp((64, 400, 400, 10)), regression=False, steps=1000),
    "mnist_cnn": dict(
        data=lambda: _standardize_images(load_mnist(test_fraction=TEST_FRACTION,
                                                    seed=SPLIT_SEED, image=True)),
        net=_cnn, regression=False, steps=800),
    "breast_cancer": dict(data=_breast_cancer, net=lambda: mlp((30, 100, 100, 2)),
                          regression=False, steps=1500),
    "mnist1d": dict(
        data=lambda: load_mnist1d(test_fraction=TEST_FRACTION, seed=SPLIT_SEED),
        net=lambda: mlp((40, 100, 100, 10)), regression=False, steps=1500),
    "diabetes": dict(
        data=lambda: load_diabetes(test_fraction=TEST_FRACTION, seed=SPLIT_SEED),
        net=lambda: mlp((10, 50, 50, 1)), regression=True, steps=1500),
}


def rule_lr(num_data, num_weights):
    """The rule's learning rate, unclipped."""
    return RULE_COEF * math.sqrt(num_data / num_weights)


def nearest(grid, lr):
    """The rate of ``grid`` nearest to ``lr`` on a log scale."""
    return min(grid, key=lambda g: abs(math.log(g / lr)))


def latent_numel(guide):
    """W: the elements of the guide's latent sample sites (its prototype trace)."""
    return sum(site["value"].numel() for _, site in guide.prototype_trace.iter_stochastic_nodes())


def run(name, lr, seed, steps, num_samples, iblm_kl_weight=None, average=None,
        iblm_options_json=None):
    """One fit: the test metrics at each evaluation, W, the time and the warnings
    (``average``: fit's decay of the parameters' moving average, if not its default)."""
    spec = PROBLEMS[name]
    x, y, xt, yt = spec["data"]()
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    net = bayesianize(spec["net"]())
    if spec["regression"]:
        model = BayesianRegressor(net, num_data=len(x), learn_noise=True)
    else:
        model = BayesianClassifier(net, num_data=len(x))
    guide = AutoKTiedNormal(model, rank=2)
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = fit(model, guide, (x, y), steps=steps, batch_size=BATCH_SIZE, lr=lr,
                      validation=(xt, yt), eval_every=max(1, steps // 10),
                      num_samples=num_samples, progress=False, capture=False,
                      init_options=iblm_options(iblm_kl_weight, iblm_options_json),
                      **({} if average is None else {"average": average}))
    seconds = time.perf_counter() - start
    seen = sorted({f"{w.category.__name__}: {w.message}" for w in caught})
    second = "rmse" if spec["regression"] else "error_rate"
    curve = {"step": [int(v["step"]) for v in history.validation],
             "mnll": [v["mnll"] for v in history.validation],
             second: [v[second] for v in history.validation]}
    trained = [m for s, m in zip(curve["step"], curve["mnll"]) if s > 0]
    return {"problem": name, "lr": lr, "seed": seed, "steps": steps, "num_data": len(x),
            "num_weights": latent_numel(guide), "seconds": seconds, "warnings": seen,
            "best_mnll": min(trained, default=math.nan), "final_mnll": curve["mnll"][-1],
            "final_" + second: curve[second][-1], "curve": curve,
            "nonfinite_loss": sum(not math.isfinite(v) for v in history.loss)}


def summarize(name, rows, grid):
    """The per-rate medians and the comparison of the grid's best with the rule and 3e-3."""
    def med(lr, key):
        return statistics.median(r[key] for r in rows if r["lr"] == lr)

    n, w = rows[0]["num_data"], rows[0]["num_weights"]
    rates = sorted({r["lr"] for r in rows})
    per_lr = {lr: {"best_mnll": med(lr, "best_mnll"), "final_mnll": med(lr, "final_mnll"),
                   "seconds": med(lr, "seconds")} for lr in rates}
    best = min(rates, key=lambda lr: per_lr[lr]["best_mnll"])
    rule = rule_lr(n, w)
    near = nearest(grid, rule)
    clipped = nearest(grid, min(max(rule, 1e-3), 1e-2))
    by_seed = {(r["lr"], r["seed"]): r["best_mnll"] for r in rows}
    seeds = sorted({r["seed"] for r in rows})
    # paired by seed (same I-BLM start and batches): seeds where the rule's grid rate wins
    wins = (None if CONTROL_LR not in per_lr or near == CONTROL_LR else
            sum(by_seed[near, s] < by_seed[CONTROL_LR, s] for s in seeds))
    start = statistics.median({r["seed"]: r["curve"]["mnll"][0] for r in rows}.values())
    return {"num_data": n, "num_weights": w, "ratio": n / w, "rule_lr": rule, "start_mnll": start,
            "rule_grid_lr": near, "rule_clipped_grid_lr": clipped, "best_lr": best,
            "per_lr": per_lr, "rule_wins": wins, "seeds": len(seeds),
            "mnll_at": {"control": per_lr.get(CONTROL_LR, {}).get("best_mnll"),
                        "rule": per_lr[near]["best_mnll"],
                        "rule_clipped": per_lr[clipped]["best_mnll"],
                        "best": per_lr[best]["best_mnll"]}}


def _f(v, digits=3):
    return "–" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.{digits}f}"


def report(summaries, rows, args):
    lines = ["## Per problem and learning rate: test MNLL, median over seeds "
             f"{args.seeds} (best after I-BLM / final)", ""]
    table = []
    for name, s in summaries.items():
        for lr, m in s["per_lr"].items():
            second = [r.get("final_error_rate", r.get("final_rmse")) for r in rows
                      if r["problem"] == name and r["lr"] == lr]
            marks = "".join([" (best)" if lr == s["best_lr"] else "",
                             " (rule)" if lr == s["rule_grid_lr"] else "",
                             " (3e-3)" if lr == CONTROL_LR else ""])
            table.append([name, f"{lr:.3g}{marks}", _f(m["best_mnll"]), _f(m["final_mnll"]),
                          _f(statistics.median(second)), f"{m['seconds']:.1f}"])
    lines += [markdown_table(["problem", "lr", "best MNLL", "final MNLL",
                              "final error / RMSE", "s per run"], table), ""]
    lines += ["## Per problem: the rule lr = 0.015·√(N/W) against the grid's best and 3e-3", ""]
    table = []
    for name, s in summaries.items():
        m = s["mnll_at"]
        table.append([name, s["num_data"], s["num_weights"], f"{s['ratio']:.3g}",
                      f"{s['rule_lr']:.2e}", f"{s['rule_grid_lr']:.3g}", f"{s['best_lr']:.3g}",
                      _f(s["start_mnll"]), _f(m["control"]), _f(m["rule"]), _f(m["best"]),
                      "–" if s["rule_wins"] is None else f"{s['rule_wins']}/{s['seeds']}"])
    lines += [markdown_table(["problem", "N", "W", "N/W", "rule lr", "rule's grid lr",
                              "best grid lr", "MNLL after I-BLM", "best MNLL at 3e-3",
                              "at rule's grid lr",
                              "at best", "seeds rule < 3e-3"], table), ""]
    if all(s["mnll_at"]["control"] is not None for s in summaries.values()):
        at = [s["mnll_at"] for s in summaries.values()]
        excess = {k: statistics.mean(m[k] - m["best"] for m in at) for k in ("rule", "control")}
        relative = {k: statistics.mean(m[k] / m["best"] - 1 for m in at)
                    for k in ("rule", "control")}
        lines += [f"Mean excess best MNLL over the grid's best: rule's grid lr "
                  f"{excess['rule']:.4f} ({100 * relative['rule']:.1f}%), 3e-3 "
                  f"{excess['control']:.4f} ({100 * relative['control']:.1f}%).", ""]
    warned = sorted({(r["problem"], w) for r in rows for w in r["warnings"]})
    lines += ["Warnings raised by fit: " + ("none" if not warned else "")]
    lines += [f"- {name}: {w}" for name, w in warned]
    lines += ["", f"fit(steps=S, batch_size={BATCH_SIZE}, lr=lr, capture=False), "
              f"AutoKTiedNormal(rank=2), {args.num_samples} guide draws per evaluation, "
              f"evaluated every S/10 steps; S per problem: "
              + ", ".join(f"{n} {next(r['steps'] for r in rows if r['problem'] == n)}"
                          for n in summaries)
              + f"; {args.threads} thread(s)."]
    return "\n".join(lines)


def _summaries(rows, problems, grid):
    return {name: summarize(name, [r for r in rows if r["problem"] == name], grid)
            for name in problems}


def _for_json(summaries):
    return {n: {**s, "per_lr": {f"{lr:g}": v for lr, v in s["per_lr"].items()}}
            for n, s in summaries.items()}


def rereport(args):
    """The tables of a saved run (``--from-json``), rewritten without training."""
    with open(args.from_json) as f:
        saved = json.load(f)
    rows, config = saved["runs"], saved["config"]
    args.seeds, args.num_samples = config["seeds"], config["num_samples"]
    args.threads = config["threads"]
    problems = list(dict.fromkeys(r["problem"] for r in rows))
    summaries = _summaries(rows, problems, sorted(set(config["lrs"])))
    text = report(summaries, rows, args)
    print(text)
    stem = result_stem(args, "bench_fit_lr")
    os.makedirs(os.path.dirname(stem), exist_ok=True)
    with open(stem + ".json", "w") as f:  # the run's host, not this one's
        json.dump({**saved, "summaries": _for_json(summaries)}, f, indent=2)
        f.write("\n")
    with open(stem + ".md", "w") as f:
        f.write(text + "\n")
    print(f"\nwrote {stem}.json and .md")


def main(args):
    if args.from_json:
        return rereport(args)
    set_threads(args.threads)
    host = host_info()
    grid = sorted(set(args.lrs))
    rates = sorted(set(grid) | {CONTROL_LR})
    jobs = [(name, lr, seed) for name in args.problems for lr in rates for seed in args.seeds]
    rows = []
    with tqdm(jobs, desc="fit_lr", disable=args.quick) as bar:
        for name, lr, seed in bar:
            bar.set_postfix_str(f"{name} lr={lr:.3g} seed={seed}")
            steps = PROBLEMS[name]["steps"] if args.steps is None else args.steps
            row = run(name, lr, seed, steps, args.num_samples, args.iblm_kl_weight,
                      iblm_options_json=args.iblm_options)
            rows.append(row)
            if args.quick:
                print(f"{name} lr={lr:.3g} seed {seed}: best MNLL {row['best_mnll']:.3f}, "
                      f"W {row['num_weights']}, {row['seconds']:.1f} s", flush=True)
    summaries = _summaries(rows, args.problems, grid)
    text = report(summaries, rows, args)
    print(text)
    write_report(result_stem(args, "bench_fit_lr"),
                 {"config": {**vars(args), "rule_coef": RULE_COEF, "control_lr": CONTROL_LR,
                             "batch_size": BATCH_SIZE,
                             "steps": {n: PROBLEMS[n]["steps"] if args.steps is None
                                       else args.steps for n in args.problems}},
                  "summaries": _for_json(summaries),
                  "runs": rows}, text, host_start=host)


if __name__ == "__main__":
    parser = make_parser(__doc__, quick_help="smoke run: one tiny problem, files under /tmp")
    parser.add_argument("--problems", nargs="+", choices=list(PROBLEMS), default=list(PROBLEMS))
    parser.add_argument("--lrs", nargs="+", type=float, default=[1e-3, 2e-3, 4e-3, 8e-3, 1.6e-2],
                        help="the grid (3e-3 is always run too, as the control)")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=None,
                        help="SVI steps of every problem (default: each problem's own)")
    parser.add_argument("--num-samples", type=int, default=32)
    parser.add_argument("--iblm-kl-weight", type=float, default=None,
                        help="init_guide_iblm's kl_weight (the output layer at the tempered "
                             "objective, e.g. 0.01; default: fit's, the exact posterior)")
    parser.add_argument("--iblm-options", default=None, metavar="JSON",
                        help="further init_guide_iblm options over fit's, e.g. "
                             "'{\"standardize_hidden\": false}'")
    parser.add_argument("--from-json", default=None,
                        help="rewrite the tables of this saved run's JSON (no training)")
    main(parse_args(parser, quick={
        "problems": ["digits_50"], "lrs": [3e-3, 8e-3], "seeds": [0], "steps": 20,
        "num_samples": 4, "out": os.path.join(tempfile.gettempdir(), "bench_fit_lr_quick")}))
