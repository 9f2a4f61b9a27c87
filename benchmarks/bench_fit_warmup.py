"""
The learning-rate warm-up of :func:`~pyro_vinit.fit`'s optimizer: test error
and MNLL right after I-BLM and along the first steps of fit's recipe, with the
warm-up of ``--warmups`` steps (0: none), on the race's problems
(``bench_time_to_quality``), a few seeds each.

Each run: ``AutoKTiedNormal(rank=2)``, ``init_guide_iblm`` with fit's options,
then ``SVI`` with fit's configuration (:func:`~pyro_vinit.fit_config`) but
``GroupedAdam(warmup_steps=W)``, minibatches of 128 drawn at random; the
predictive from 32 guide draws is evaluated at the listed steps. Prints one
table per problem (means over seeds) and writes JSON.

Usage::

    python -m benchmarks.bench_fit_warmup                  # digits CNN and MNIST-5k, 2 seeds
    python -m benchmarks.bench_fit_warmup --quick          # smoke run, no files
"""

import statistics

import pyro
import torch
from pyro.infer import SVI, Predictive
from tqdm.auto import tqdm

import pyro_vinit
from benchmarks.bench_time_to_quality import BATCH_SIZE, PROBLEMS
from benchmarks.harness import (
    host_info,
    make_parser,
    markdown_table,
    parse_args,
    result_stem,
    set_threads,
    write_report,
)
from pyro_vinit import AutoKTiedNormal, GroupedAdam, init_guide_iblm
from pyro_vinit.nn import BayesianClassifier, bayesianize


def evaluate(model, guide, x, y, num_samples):
    with torch.no_grad():
        logits = Predictive(model, guide=guide, num_samples=num_samples,
                            return_sites=["_RETURN"])(x)["_RETURN"]
        probs = logits.softmax(-1).mean(0)
        error = (probs.argmax(-1) != y).float().mean().item()
        mnll = -probs[torch.arange(len(y)), y].clamp_min(1e-12).log().mean().item()
    return error, mnll


def run(problem, warmup, seed, marks, num_samples):
    """(error, MNLL) at each of ``marks`` (steps; 0 is right after I-BLM)."""
    spec = PROBLEMS[problem]
    x, y, xt, yt = spec["data"]()[:4]
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    model = BayesianClassifier(bayesianize(spec["net"]()), num_data=len(x))
    guide = AutoKTiedNormal(model, rank=2)
    config = pyro_vinit.fit_config(guide)
    init_guide_iblm(guide, (x, y), **config.iblm_options(len(x)))
    svi = SVI(model, guide, GroupedAdam({"lr": config.lr}, warmup_steps=warmup), config.elbo())
    out = [evaluate(model, guide, xt, yt, num_samples)] if 0 in marks else []
    for step in range(1, max(marks) + 1):
        batch = torch.randint(len(x), (BATCH_SIZE,))
        with config.handlers():
            svi.step(x[batch], y[batch])
        if step in marks:
            out.append(evaluate(model, guide, xt, yt, num_samples))
    return out


def main(args):
    set_threads(args.threads)
    host = host_info()
    marks = [0, 1, 5, 10, 25, 50, 100, 200, 400, 800][: 4 if args.quick else None]
    results, text = {}, []
    with pyro.validation_enabled(False):
        for problem in args.problems:
            rows = []
            for warmup in args.warmups:
                runs = [run(problem, warmup, seed, marks, args.num_samples)
                        for seed in tqdm(args.seeds, desc=f"{problem} W={warmup}",
                                         disable=args.quick)]
                mean = [(statistics.mean(r[i][0] for r in runs),
                         statistics.mean(r[i][1] for r in runs)) for i in range(len(marks))]
                results.setdefault(problem, {})[warmup] = {"runs": runs, "mean": mean}
                rows.append([warmup, *(f"{e:.3f} / {m:.3f}" for e, m in mean)])
            text += [f"## {problem}: test error / MNLL after each number of steps "
                     f"(means of seeds {args.seeds})", "",
                     markdown_table(["warm-up steps", *map(str, marks)], rows), ""]
    text.append(f"fit's recipe (lr 3e-3, KL weight 0.01, local_reparam) after I-BLM, batch "
                f"{BATCH_SIZE}, {args.num_samples} draws per evaluation, {args.threads} "
                f"thread(s).")
    report = "\n".join(text)
    print(report)
    if not args.quick:
        write_report(result_stem(args, "bench_fit_warmup"),
                     {"marks": marks, "results": results, "config": vars(args)}, report,
                     host_start=host)


if __name__ == "__main__":
    parser = make_parser(__doc__)
    parser.add_argument("--problems", nargs="+", choices=list(PROBLEMS),
                        default=["digits_cnn", "mnist_mlp"])
    parser.add_argument("--warmups", nargs="+", type=int, default=[0, 50, 200])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--num-samples", type=int, default=32)
    main(parse_args(parser, quick={"problems": ["digits_cnn"], "warmups": [0, 50],
                                   "seeds": [0], "num_samples": 4}))
