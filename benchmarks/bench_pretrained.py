"""
Starting from a trained network (issue 22, item 7): ``init_guide_pretrained``
with I-BLM's standard deviations against MOPED's δ|w| (δ = 0.1, 0.5), the
same deterministically pre-trained network for every start, on digits
(ReLU MLP 64-100-10) and the 5,000 MNIST digits (784-200-200-10).

For each start: test error and MNLL of the Monte Carlo predictive
(``--num-samples`` guide draws) right after the start, and after
``pyro_vinit.fit(..., init=None, steps=--steps)``; the pre-trained network's
own figures beside them. Guide ``AutoKTiedNormal(rank=2)`` (the recipe's)
and ``AutoNormal`` (which holds δ|w| exactly). Medians over ``--seeds``.

Usage::

    python -m benchmarks.bench_pretrained               # full run (a few minutes)
    python -m benchmarks.bench_pretrained --quick       # smoke run, no files
"""

import copy
import statistics

import pyro
import torch
import torch.nn.functional as F
from pyro.infer import Predictive
from pyro.infer.autoguide import AutoNormal

import pyro_vinit
from benchmarks import _peers
from benchmarks.harness import (
    host_info,
    make_parser,
    markdown_table,
    parse_args,
    result_stem,
    set_threads,
    write_report,
)
from pyro_vinit import AutoKTiedNormal, init_guide_pretrained
from pyro_vinit.data import load_digits, load_mnist
from pyro_vinit.nn import BayesianClassifier, bayesianize, mlp

PROBLEMS = {
    "digits_mlp": dict(data=load_digits, net=lambda: mlp((64, 100, 10)), pretrain_epochs=20),
    "mnist_mlp": dict(data=load_mnist, net=lambda: mlp((784, 200, 200, 10)), pretrain_epochs=5),
}
STARTS = {
    "I-BLM stds (ρ=1)": dict(scale="iblm", noise_ratio=1.0),
    "I-BLM stds (ρ=0.3)": dict(scale="iblm", noise_ratio=0.3),
    "MOPED δ=0.1": dict(scale="moped", delta=0.1),
    "MOPED δ=0.5": dict(scale="moped", delta=0.5),
}
GUIDES = {"AutoKTiedNormal(2)": lambda model: AutoKTiedNormal(model, rank=2),
          "AutoNormal": AutoNormal}


@torch.no_grad()
def evaluate(model, guide, x, y, num_samples):
    logits = Predictive(model, guide=guide, num_samples=num_samples,
                        return_sites=["_RETURN"])(x)["_RETURN"]
    probs = logits.softmax(-1).mean(0)
    return {"error": float((probs.argmax(-1) != y).double().mean()),
            "mnll": float(-probs[torch.arange(len(y)), y].clamp_min(1e-12).log().mean())}


def run(problem, seed, args):
    spec = PROBLEMS[problem]
    x, y, x_test, y_test = spec["data"]()
    torch.manual_seed(seed)
    net = _peers.pretrain(spec["net"](), x, y, spec["pretrain_epochs"], 128)
    with torch.no_grad():
        logits = net(x_test)
    rows = {"trained net": {"error": float((logits.argmax(-1) != y_test).double().mean()),
                            "mnll": float(F.cross_entropy(logits, y_test))}}
    for guide_name, make_guide in GUIDES.items():
        for start, options in STARTS.items():
            pyro.clear_param_store()
            pyro.set_rng_seed(seed)
            model = BayesianClassifier(bayesianize(copy.deepcopy(net), keep_weights=True),
                                       num_data=len(x))
            guide = make_guide(model)
            init_guide_pretrained(guide, (x, y), **options)
            row = {f"init {k}": v for k, v in
                   evaluate(model, guide, x_test, y_test, args.num_samples).items()}
            pyro_vinit.fit(model, guide, (x, y), steps=args.steps, init=None, progress=False)
            row.update({f"fit {k}": v for k, v in
                        evaluate(model, guide, x_test, y_test, args.num_samples).items()})
            rows[f"{guide_name}, {start}"] = row
    return rows


def main(args):
    set_threads(args.threads)
    host = host_info()
    results = {"config": vars(args), "problems": {}}
    lines = []
    columns = ["init error", "init mnll", "fit error", "fit mnll"]
    for problem in args.problems:
        runs = [run(problem, seed, args) for seed in range(args.seeds)]
        summary = {name: {k: statistics.median(r[name][k] for r in runs) for k in runs[0][name]}
                   for name in runs[0]}
        results["problems"][problem] = {"runs": runs, "median": summary}
        trained = summary["trained net"]
        table = [[name] + [f"{summary[name][c]:.3f}" for c in columns]
                 for name in summary if name != "trained net"]
        lines += [f"\n{problem}: trained net error {trained['error']:.3f}, "
                  f"MNLL {trained['mnll']:.3f} (median of {args.seeds} seeds; "
                  f"fit: {args.steps} steps)\n",
                  markdown_table(["start"] + columns, table)]
    text = "\n".join(lines)
    print(text)
    if not args.quick:
        write_report(result_stem(args, "bench_pretrained"), results, text, host_start=host)
    return results


if __name__ == "__main__":
    parser = make_parser(__doc__)
    parser.add_argument("--problems", nargs="+", default=list(PROBLEMS), choices=list(PROBLEMS))
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--num-samples", type=int, default=32)
    main(parse_args(parser, quick={"problems": ["digits_mlp"], "seeds": 1, "steps": 5,
                                   "num_samples": 4}))
