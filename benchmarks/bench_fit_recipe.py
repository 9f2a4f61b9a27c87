"""
Which training recipe after I-BLM keeps its head start and ends best? The
measurements behind :func:`pyro_vinit.fit`'s defaults.

Problems: scikit-learn digits with the 5×100 ReLU MLP and the small CNN of
the I-BLM paper's comparison (``pyro_vinit.testing.paper_problems``), and
MNIST-5k (``load_mnist``: 4,000 train / 1,000 test) with a 784-200-200-10
ReLU MLP. Every model has N(0, 1/D_in) priors (``bayesianize``), an
AutoKTiedNormal(rank=2) guide started by
``init_guide_iblm(batch_size=512, max_scale_ratio=r)`` and is trained with
``TraceMeanField_ELBO`` under ``local_reparam()``, the KL term weighted by λ
(``KLAnnealingMessenger``), Adam at learning rate ``lr``, random minibatches
of 128. Test error and MNLL of the Monte Carlo predictive (32 guide draws)
right after I-BLM and at the checkpoints of ``--evals``.

A configuration is ``lr,kl_weight,max_scale_ratio[,particles]``. Time is
judged by steps only (the host is shared).

Usage::

    python benchmarks/bench_fit_recipe.py                 # every problem and configuration
    python benchmarks/bench_fit_recipe.py --quick         # smoke run (seconds, no files)
"""

import argparse
import json
import os
import platform
import sys
from typing import Any, Dict, List, Tuple

import pyro
import torch
from pyro.infer import SVI, TraceMeanField_ELBO

from pyro_vinit import AutoKTiedNormal, init_guide_iblm
from pyro_vinit.data import load_digits, load_mnist
from pyro_vinit.metrics import classification_metrics
from pyro_vinit.nn import BayesianClassifier, bayesianize, mlp
from pyro_vinit.poutine import KLAnnealingMessenger, local_reparam
from pyro_vinit.testing.paper_problems import _cnn

PROBLEMS = {
    "digits_mlp": (lambda: load_digits(), lambda: mlp((64,) + (100,) * 5 + (10,))),
    "digits_cnn": (lambda: load_digits(image=True), _cnn),
    "mnist_mlp": (lambda: load_mnist(), lambda: mlp((784, 200, 200, 10))),
}
CONFIGS = [
    "1e-3,0.1,0.1",
    "3e-3,0.1,0.1",
    "1e-2,0.1,0.1",
    "1e-3,1.0,0.1",
    "1e-3,0.03,0.1",
    "3e-3,0.03,0.1",
    "1e-3,0.1,0.03",
    "1e-3,0.01,0.1",
]


@torch.no_grad()
def evaluate(
    model: Any, guide: Any, x: torch.Tensor, y: torch.Tensor, samples: int
) -> Tuple[float, float]:
    logits = []
    for _ in range(samples):
        trace = pyro.poutine.trace(guide).get_trace(x)
        logits.append(pyro.poutine.replay(model, trace=trace)(x))
    m = classification_metrics(y, logits=torch.stack(logits))
    return float(m["error_rate"]), float(m["mnll"])


def run(problem: str, config: str, seed: int, evals: List[int], samples: int) -> Dict[str, Any]:
    parts = config.split(",")
    lr, klw, ratio = float(parts[0]), parts[1], float(parts[2])
    particles = int(parts[3]) if len(parts) > 3 else 1
    load, net_fn = PROBLEMS[problem]
    x, y, xt, yt = load()
    pyro.set_rng_seed(seed)
    pyro.clear_param_store()
    model = BayesianClassifier(bayesianize(net_fn()), num_data=len(x))
    guide = AutoKTiedNormal(model, rank=2)
    init_guide_iblm(guide, (x, y), batch_size=512, max_scale_ratio=ratio)
    weight = float(klw)
    curve = {"step": [0], "error": [], "mnll": []}
    e, n = evaluate(model, guide, xt, yt, samples)
    curve["error"].append(e)
    curve["mnll"].append(n)
    svi = SVI(model, guide, pyro.optim.Adam({"lr": lr}),
              TraceMeanField_ELBO(num_particles=particles, vectorize_particles=particles > 1))
    for step in range(1, max(evals) + 1):
        batch = torch.randint(len(x), (128,))
        with KLAnnealingMessenger(weight), local_reparam():
            svi.step(x[batch], y[batch])
        if step in evals:
            e, n = evaluate(model, guide, xt, yt, samples)
            curve["step"].append(step)
            curve["error"].append(e)
            curve["mnll"].append(n)
    return {"problem": problem, "config": config, "kl_weight": weight, "seed": seed, **curve}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--problems", nargs="+", default=list(PROBLEMS))
    parser.add_argument("--configs", nargs="+", default=CONFIGS)
    parser.add_argument("--evals", nargs="+", type=int, default=[200, 400, 800, 1500])
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args()
    if args.quick:
        args.problems, args.configs, args.evals, args.samples = ["digits_mlp"], CONFIGS[:1], [5], 2
    torch.set_num_threads(1)
    rows = []
    for problem in args.problems:
        for config in args.configs:
            for seed in range(args.seeds):
                r = run(problem, config, seed, args.evals, args.samples)
                rows.append(r)
                cells = " ".join(f"{s}:{e:.3f}/{n:.3f}" for s, e, n in
                                 zip(r["step"], r["error"], r["mnll"]))
                print(f"{problem:11s} {config:16s} λ={r['kl_weight']:.3g} seed {seed}  {cells}",
                      flush=True)
    if args.quick:
        return
    steps = " | ".join(f"@{s}" for s in [0] + args.evals)
    lines = ["| problem | lr, λ, scale cap | " + steps + " |",
             "|---|---|" + "---|" * (len(args.evals) + 1)]
    for problem in args.problems:
        for config in args.configs:
            rs = [r for r in rows if r["problem"] == problem and r["config"] == config]
            cells = []
            for i in range(len(args.evals) + 1):
                e = sum(r["error"][i] for r in rs) / len(rs)
                n = sum(r["mnll"][i] for r in rs) / len(rs)
                cells.append(f"{e:.3f} / {n:.3f}")
            lines.append(f"| {problem} | {config} | " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    print(table)
    os.makedirs(args.out, exist_ok=True)
    meta = {"torch": torch.__version__, "pyro": pyro.__version__, "python": sys.version.split()[0],
            "platform": platform.platform(), "threads": 1, "samples": args.samples,
            "seeds": args.seeds}
    with open(os.path.join(args.out, "bench_fit_recipe.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    with open(os.path.join(args.out, "bench_fit_recipe.md"), "w") as f:
        f.write("error / MNLL at each step (mean over seeds)\n\n" + table + "\n")


if __name__ == "__main__":
    main()
