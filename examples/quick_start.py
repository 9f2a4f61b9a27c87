"""
Quick start: a Bayesian MLP on scikit-learn's digits with pyro-vinit.

Converts an ``nn.Sequential`` into a Bayesian model with N(0, 1/D_in)
priors, fits it with a k-tied (or radial) autoguide and TraceMeanField_ELBO,
then prints test accuracy, MNLL and calibration, and saves the learning curve
as a PNG and the results as JSON.

Usage::

    python examples/quick_start.py                 # about a minute on 2 cores
    python examples/quick_start.py --guide radial
    python examples/quick_start.py --quick         # smoke run
"""

import argparse
import json
import os

import pyro
import torch
from pyro.infer import SVI, Predictive, TraceMeanField_ELBO
from pyro.infer.autoguide import init_to_sample
from torch import nn
from tqdm import tqdm

from pyro_vinit import AutoKTiedNormal, AutoRadialNormal
from pyro_vinit.data import load_digits
from pyro_vinit.nn import BayesianClassifier, bayesianize


def evaluate(model, guide, x, y, num_samples):
    logits = Predictive(model, guide=guide, num_samples=num_samples, return_sites=["_RETURN"])(
        x
    )["_RETURN"]
    log_probs = logits.log_softmax(-1)  # (samples, batch, classes)
    # log of the Monte Carlo predictive density, averaged over test points
    log_pred = log_probs.logsumexp(0) - torch.log(torch.tensor(float(num_samples)))
    probs = log_pred.exp()
    accuracy = (probs.argmax(-1) == y).float().mean().item()
    mnll = -log_pred[torch.arange(len(y)), y].mean().item()
    return {"accuracy": accuracy, "mnll": mnll}


def main(args):
    pyro.set_rng_seed(args.seed)
    torch.set_num_threads(args.threads)
    x_train, y_train, x_test, y_test = load_digits()

    net = nn.Sequential(nn.Linear(64, args.width), nn.ReLU(), nn.Linear(args.width, 10))
    model = BayesianClassifier(bayesianize(net, prior_scale=1.0), num_data=len(x_train))
    if args.guide == "ktied":
        guide = AutoKTiedNormal(model, rank=args.rank, init_scale=1e-2, init_loc_fn=init_to_sample)
    else:
        guide = AutoRadialNormal(model, init_scale=1e-2, init_loc_fn=init_to_sample)
    svi = SVI(model, guide, pyro.optim.Adam({"lr": args.lr}), TraceMeanField_ELBO())

    curve = []
    for step in tqdm(range(args.steps), desc=f"SVI ({args.guide})"):
        idx = torch.randint(0, len(x_train), (args.batch_size,))
        loss = svi.step(x_train[idx], y_train[idx])
        if step % max(1, args.steps // 20) == 0 or step == args.steps - 1:
            metrics = evaluate(model, guide, x_test, y_test, num_samples=8)
            curve.append({"step": step, "loss": loss, **metrics})

    final = evaluate(model, guide, x_test, y_test, num_samples=args.num_samples)
    print(f"test accuracy {final['accuracy']:.4f}, test MNLL {final['mnll']:.4f}")

    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, "quick_start.json"), "w") as f:
        json.dump({"config": vars(args), "final": final, "curve": curve}, f, indent=2)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: skipping the plot")
        return final
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot([c["step"] for c in curve], [1 - c["accuracy"] for c in curve], label="test error")
    ax.set_xlabel("SVI step")
    ax.set_ylabel("test error")
    ax.set_title(f"Bayesian MLP on digits ({args.guide})")
    fig.tight_layout()
    fig.savefig(os.path.join(args.out_dir, "quick_start.png"), dpi=100)
    return final


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="Bayesian MLP on digits with pyro-vinit")
    parser.add_argument("--guide", choices=["ktied", "radial"], default="ktied")
    parser.add_argument("--rank", type=int, default=2)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--num-samples", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out-dir", default="results/quick_start")
    parser.add_argument("--quick", action="store_true", help="smoke run (a few seconds)")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.num_samples = 30, 4
    return args


if __name__ == "__main__":
    main(parse_args())
