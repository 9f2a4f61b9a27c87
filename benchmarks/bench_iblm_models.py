"""
I-BLM on the models Pyro users write (:mod:`pyro_vinit.testing.user_models`):
the test metric right after initialization and after SVI, for I-BLM and
every baseline initializer, on each model.

Models: a functional 3-hidden-layer tanh net with ``pyro.deterministic``
records (iris), matrix-product layers with a learned noise (``Uniform(0,
10)``, ``HalfNormal(1)`` or a ``pyro.param``; standardized diabetes), a
heteroscedastic net with mean and scale heads (diabetes), a ResNet-style CNN
with BatchNorm (digits images), an MLP under a subsampled plate and a
Transformer layer (digits). AutoNormal guide, N(0, 1/D_in)-style priors as
each model declares them; SVI with Adam (lr 1e-3), minibatches of 128,
Trace_ELBO and the library's training recipe for every initialization alike:
the KL term weighted by ``--kl-weight`` (0.1) throughout
(:class:`~pyro_vinit.poutine.KLAnnealingMessenger`), and I-BLM's stds capped
at ``--scale-cap`` (0.1) times the prior's (``max_scale_ratio``). With
``--full-elbo`` the protocol before the recipe: no cap, the KL term warmed up
linearly over the first half of the run, the full ELBO after. The metric is the test
error of the guide's median network (classification) or its test RMSE
(regression), in the model's eval mode. MAP runs for as long (wall time) as
I-BLM took on the same model and seed: equal initialization cost, as in [1].

Usage::

    python -m benchmarks.bench_iblm_models             # full run (~10 minutes)
    python -m benchmarks.bench_iblm_models --full-elbo # without the recipe
    python -m benchmarks.bench_iblm_models --quick     # smoke run

[1] Rossi, Michiardi, Filippone (2019) "Good Initializations of Variational
Bayes for Deep Models"
"""

import math
import time
import warnings

import pyro
import pyro.poutine as poutine
import torch
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoNormal
from tqdm import tqdm

from benchmarks.harness import make_parser, parse_args, result_stem, write_json
from pyro_vinit import init_guide, update_batch_norm
from pyro_vinit.initialization.baselines import METHODS
from pyro_vinit.poutine import KLAnnealingMessenger
from pyro_vinit.schedules import LinearWarmup
from pyro_vinit.testing.user_models import USER_MODELS


def metric(um, model, guide, x, y, mode="eval") -> float:
    """The median network's test error (or RMSE) with the model in ``mode``; a
    train-mode pass leaves BatchNorm's running statistics as they were."""
    with torch.no_grad():
        was_training = getattr(model, "training", None)
        buffers = ({k: b.clone() for k, b in model.named_buffers()}
                   if isinstance(model, torch.nn.Module) else {})
        if was_training is not None:
            model.train(mode == "train")
        predict = (lambda: um.predict(model, x)) if um.predict else (lambda: model(x))
        out = poutine.condition(predict, data=guide.median())()
        if was_training is not None:
            model.train(was_training)
            for k, b in model.named_buffers():
                b.copy_(buffers[k])
    if um.task == "classification":
        return (out.argmax(-1) != y).float().mean().item()
    return (out - y).pow(2).mean().sqrt().item()


def run(um, method, seed, steps, eval_every, batch_size, args, map_seconds=2.0):
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    x, y, xt, yt = um.data()
    model = um.make(len(x))
    guide = AutoNormal(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # e.g. the Transformer's uncovered attention sites
        options = {}
        if method == "iblm" and not args.full_elbo:
            options["max_scale_ratio"] = args.scale_cap
        if method == "map":  # equal cost: as long as I-BLM took on this model and seed
            options["map_seconds"] = map_seconds
        start = time.process_time()
        wall = time.perf_counter()
        init_guide(guide, (x, y), method=method, **options)
        seconds = time.process_time() - start
        wall = time.perf_counter() - wall
    def point(step):  # eval mode (how users predict) beside train mode
        if step:  # BatchNorm's running statistics for the trained posterior, as fit does
            update_batch_norm(model, guide, (x, y))
        return (step, metric(um, model, guide, xt, yt),
                metric(um, model, guide, xt, yt, mode="train"))

    curve = [point(0)]
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 1e-3}), Trace_ELBO())
    if args.full_elbo:
        annealing = KLAnnealingMessenger(LinearWarmup(max(1, steps // 2)))
    else:
        annealing = KLAnnealingMessenger(args.kl_weight)
    for step in range(1, steps + 1):
        idx = torch.randint(len(x), (min(batch_size, len(x)),))
        with annealing:
            svi.step(x[idx], y[idx])
        annealing.step()
        if step % eval_every == 0:
            curve.append(point(step))
    return curve, seconds, wall


def main(args):
    torch.set_num_threads(1)
    names = args.models or list(USER_MODELS)
    results, cpu, iblm_wall = {}, {}, {}
    # I-BLM first on each model and seed: MAP gets its wall time
    methods = sorted(args.methods, key=lambda m: m != "iblm")
    jobs = [(n, s, m) for n in names for s in range(args.seeds) for m in methods]
    for name, seed, method in tqdm(jobs, desc="runs"):
        try:
            curve, seconds, wall = run(USER_MODELS[name], method, seed, args.steps,
                                       args.eval_every, args.batch_size, args,
                                       map_seconds=iblm_wall.get((name, seed), 2.0))
        except ValueError as e:  # a baseline that cannot handle the model
            curve, seconds, wall = [(0, math.nan, math.nan)], math.nan, math.nan
            tqdm.write(f"{name} {method}: {e}")
        results.setdefault(name, {}).setdefault(method, []).append(curve)
        cpu.setdefault(name, {}).setdefault(method, []).append(seconds)
        if method == "iblm":
            iblm_wall[(name, seed)] = wall
    rows = []
    for name in names:
        means = {}
        for method, curves in results[name].items():
            start = sum(c[0][1] for c in curves) / len(curves)
            end = sum(c[-1][1] for c in curves) / len(curves)
            means[method] = (start, end)
        baselines = {m: v for m, v in means.items() if m != "iblm" and math.isfinite(v[1])}
        best = min(baselines, key=lambda m: baselines[m][1]) if baselines else None
        curves = results[name]["iblm"]
        train_mode = (sum(c[0][2] for c in curves) / len(curves),
                      sum(c[-1][2] for c in curves) / len(curves))
        rows.append({"model": name, "task": USER_MODELS[name].task, "methods": means,
                     "iblm_train_mode": train_mode,
                     "best_baseline": best,
                     "cpu_seconds": {m: sum(v) / len(v) for m, v in cpu[name].items()}})
    what = {"classification": "test error", "regression": "test RMSE"}
    protocol = ("full ELBO (KL warmed up over the first half)" if args.full_elbo else
                f"recipe (KL weight {args.kl_weight}, I-BLM stds capped at {args.scale_cap}"
                " x prior)")
    print(f"\nAutoNormal, {args.steps} SVI steps, {protocol}, mean of {args.seeds} seeds\n")
    print("Eval mode, as users predict; I-BLM's train-mode figures (BatchNorm with batch "
          "statistics) beside them.\n")
    print("| model | metric | I-BLM at init | I-BLM after | (train mode: at init, after) | "
          "best baseline | at init | after | I-BLM CPU s | baseline CPU s |")
    print("|---|---|---:|---:|---:|---|---:|---:|---:|---:|")
    for r in rows:
        i0, i1 = r["methods"]["iblm"]
        b = r["best_baseline"]
        b0, b1 = r["methods"][b] if b else (math.nan, math.nan)
        c = r["cpu_seconds"]
        t0, t1 = r["iblm_train_mode"]
        print(f"| {r['model']} | {what[r['task']]} | {i0:.3f} | {i1:.3f} | {t0:.3f}, {t1:.3f} | "
              f"{b} | {b0:.3f} | {b1:.3f} | {c['iblm']:.2f} | {c.get(b, math.nan):.2f} |")
    if args.quick:
        return
    tag = "_full_elbo" if args.full_elbo else ""
    write_json(result_stem(args, f"bench_iblm_models{tag}") + ".json",
               {"setup": vars(args), "rows": rows, "curves": results})


if __name__ == "__main__":
    parser = make_parser(__doc__, threads=False, tag=False, quick_help="tiny run, no files")
    parser.add_argument("--models", nargs="+", choices=list(USER_MODELS))
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--kl-weight", type=float, default=0.1,
                        help="the recipe's constant KL weight")
    parser.add_argument("--scale-cap", type=float, default=0.1,
                        help="the recipe's cap on I-BLM's stds, a multiple of the prior's")
    parser.add_argument("--full-elbo", action="store_true",
                        help="the protocol without the recipe")
    args = parse_args(parser, quick={"seeds": 1, "steps": 4, "eval_every": 2,
                                     "methods": ["iblm", "xavier"]})
    if args.quick:
        args.models = args.models or ["tanh_depth3", "matmul_halfnormal_noise"]
    main(args)
