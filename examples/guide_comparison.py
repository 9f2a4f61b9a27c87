"""
Guide comparison: AutoNormal vs AutoKTiedNormal (k = 1, 2, 3) vs AutoRadialNormal
on a Bayesian MLP for scikit-learn's digits.

In the spirit of Figure 6 of the k-tied paper [1] and Figure 4 of the radial
paper [2], this script fits the same Bayesian MLP (64-32-10, N(0, 1) priors)
with each guide, with :func:`~pyro_vinit.fit`'s recipe: I-BLM with fit's
options, then SVI with :func:`~pyro_vinit.fit_config`'s configuration (Adam
at 1e-3, TraceMeanField_ELBO, the KL term weighted by 0.01, under
:func:`~pyro_vinit.poutine.local_reparam`, or
:func:`~pyro_vinit.poutine.flipout` for the radial guide; minibatches of
128), written out as a loop so that it can be measured along the way. It
reports

- test metrics (error, MNLL, ECE, Brier) and the number of guide parameters,
  with learning curves;
- the gradient signal-to-noise ratio (SNR) of the scale parameters: for each
  scale parameter the ratio |mean| / std of its minibatch gradient over many
  draws (minibatch and weight sample) at a fixed parameter point, summarized by
  the median over the weight sites' scale parameters (AutoNormal's per-weight
  scales, the radial guide's per-weight marginal scales, the k-tied guide's
  factors U and V), with the training's KL weight and weight noise, for
  TraceMeanField_ELBO (the training's) and Trace_ELBO;
- a sensitivity study, not a recipe: the final test accuracy over a small
  grid of ``init_scale`` and learning rates, from a random start (the weight
  means drawn from the prior, the scales at ``init_scale``), trained with
  fit's configuration at each learning rate.

Usage::

    python examples/guide_comparison.py            # a few minutes on 2 cores
    python examples/guide_comparison.py --quick    # smoke run, seconds

[1] Swiatkowski et al. (2020) "The k-tied Normal Distribution: A Compact
Parameterization of Gaussian Mean Field Posteriors in Bayesian Neural Networks"

[2] Farquhar, Osborne, Gal (2020) "Radial Bayesian Neural Networks: Beyond
Discrete Support in Large-Scale Bayesian Deep Learning"
"""

import argparse
import math
import os
import time

import pyro
import torch
from pyro.infer import SVI, Predictive, Trace_ELBO, TraceMeanField_ELBO
from pyro.infer.autoguide import AutoNormal, init_to_sample
from tqdm import tqdm

from pyro_vinit import AutoKTiedNormal, AutoRadialNormal, FitConfig, fit_config, init_guide_iblm
from pyro_vinit.data import load_digits
from pyro_vinit.metrics import classification_metrics
from pyro_vinit.nn import BayesianClassifier, bayesianize, mlp

from _outputs import save_results

GUIDES = ["AutoNormal", "k-tied k=1", "k-tied k=2", "k-tied k=3", "radial"]
ELBOS = {"TraceMeanField_ELBO": TraceMeanField_ELBO, "Trace_ELBO": Trace_ELBO}
FIT = FitConfig()  # fit's defaults, which the training flags below start from


def make_model(sizes, num_data):
    # A fixed N(0, 1) prior, as in the measurements this example was tuned on.
    return BayesianClassifier(bayesianize(mlp(sizes), prior_scale=1.0), num_data=num_data)


def make_guide(name, model, init_scale):
    # init_to_sample draws the weight means from the prior: the default
    # init_to_feasible would set them all to 0 and the hidden units would stay
    # interchangeable.
    kwargs = dict(init_scale=init_scale, init_loc_fn=init_to_sample)
    if name == "AutoNormal":
        guide = AutoNormal(model, **kwargs)
    elif name.startswith("k-tied"):
        guide = AutoKTiedNormal(model, rank=int(name[-1]), **kwargs)
    elif name == "radial":
        guide = AutoRadialNormal(model, **kwargs)
    else:
        raise ValueError(f"unknown guide {name!r}, expected one of {GUIDES}")
    return guide


def count_parameters(guide):
    return sum(p.numel() for p in guide.parameters())


def weight_scale_parameters(guide):
    """The unconstrained scale parameters of the weight sites, by name:
    ``scales.*`` for AutoNormal and the radial guide, the factors
    ``scale_u.*`` and ``scale_v.*`` for the k-tied guide (biases excluded:
    they are untied in every guide)."""
    return {
        name: p
        for name, p in guide.named_parameters()
        if name.split(".")[0] in ("scales", "scale_u", "scale_v") and ".weight" in name
    }


def minibatches(x, y, batch_size):
    """Shuffled epochs of minibatches, as fit draws them."""
    while True:
        order = torch.randperm(len(x))
        for start in range(0, len(x), batch_size):
            idx = order[start:start + batch_size]
            yield x[idx], y[idx]


@torch.no_grad()
def posterior_std(guide, x, num_samples=16):
    """Mean posterior standard deviation of the weights, estimated from guide
    samples: the same public call for every guide family."""
    samples = [guide(x) for _ in range(num_samples)]
    stds = [torch.stack([s[name] for s in samples]).std(0).reshape(-1)
            for name in samples[0] if name.endswith(".weight")]
    return torch.cat(stds).mean().item()


@torch.no_grad()
def evaluate(model, guide, x, y, num_samples):
    predictive = Predictive(model, guide=guide, num_samples=num_samples, return_sites=["_RETURN"])
    metrics = classification_metrics(y, logits=predictive(x)["_RETURN"])
    metrics["accuracy"] = 1.0 - metrics["error_rate"]
    return metrics


def gradient_snr(model, guide, elbo, config, batches, num_draws):
    """
    Per-element SNR |E[g]| / std[g] of the gradient g of the minibatch loss
    (under ``config``'s KL weight and weight noise) with respect to the weight
    sites' scale parameters, estimated from ``num_draws`` independent draws of
    minibatch and weight sample at the current (fixed) parameters.
    """
    params = weight_scale_parameters(guide)
    draws = {name: [] for name in params}
    for _ in range(num_draws):
        with config.handlers():
            loss = elbo.differentiable_loss(model, guide, *next(batches))
        for name, grad in zip(params, torch.autograd.grad(loss, list(params.values()))):
            draws[name].append(grad.reshape(-1))
    snr = {}
    for name, grads in draws.items():
        grads = torch.stack(grads)
        snr[name] = grads.mean(0).abs() / grads.std(0).clamp(min=1e-30)
    return snr


def measure_snr(model, guide, config, batches, num_draws):
    # Snapshot the RNG so that measuring does not change the training run.
    state = pyro.util.get_rng_state()
    result = {}
    for name, elbo in ELBOS.items():
        by_parameter = gradient_snr(model, guide, elbo(), config, batches, num_draws)
        snr = torch.cat(list(by_parameter.values()))
        result[name] = {
            "median": snr.median().item(),
            "quartiles": [snr.quantile(0.25).item(), snr.quantile(0.75).item()],
            # e.g. the k-tied U (rows) and V (columns) factors separately
            "median_by_parameter": {n: v.median().item() for n, v in by_parameter.items()},
            "values": snr.tolist(),
        }
    pyro.util.set_rng_state(state)
    return result


def train(model, guide, data, *, steps, lr, batch_size, eval_every=0, eval_samples=16,
          snr_steps=(), snr_draws=0, desc=None):
    """Trains the (initialized) guide with fit's configuration at learning rate ``lr``;
    optionally records a learning curve and the gradient SNR at the steps in
    ``snr_steps``."""
    x_train, y_train, x_test, y_test = data
    batches = minibatches(x_train, y_train, batch_size)
    config = fit_config(guide, lr=lr)  # fit's: Adam, TraceMeanField_ELBO, KL weight, handler
    svi = SVI(model, guide, config.optimizer(), config.elbo())
    average = config.averager()  # fit's moving average of the parameters, evaluated
    curve, snr, losses, step_times = [], {}, [], []
    for step in tqdm(range(steps + 1), desc=desc, leave=False, disable=desc is None):
        if step in snr_steps:
            snr[step] = measure_snr(model, guide, config, batches, snr_draws)
        if eval_every and (step % eval_every == 0 or step == steps):
            with average.swapped():
                metrics = evaluate(model, guide, x_test, y_test, eval_samples)
                std = posterior_std(guide, x_test[:1])
            loss = sum(losses) / len(losses) if losses else math.nan
            curve.append({"step": step, "train_loss": loss / len(x_train),
                          "weight_std": std, **metrics})
            losses = []
        if step == steps:
            average.write()
            break
        start = time.perf_counter()
        with config.handlers():
            losses.append(svi.step(*next(batches)))
        step_times.append(time.perf_counter() - start)
        average.update()
    # the median ignores the first step's one-off costs and load spikes on a shared machine
    ms_per_step = 1e3 * torch.tensor(step_times).median().item() if step_times else math.nan
    return {"curve": curve, "snr": snr, "ms_per_step": ms_per_step}


def compare(args, data):
    """Each guide with fit's recipe, over ``args.seeds`` seeds."""
    sizes = (data[0].shape[1], args.width, 10)
    results = {}
    for name in GUIDES:
        runs = []
        for seed in range(args.seeds):
            pyro.clear_param_store()
            pyro.set_rng_seed(seed)
            model = make_model(sizes, len(data[0]))
            guide = make_guide(name, model, 0.1)  # the scales are I-BLM's
            # fit's start: I-BLM with fit's options
            init_guide_iblm(guide, data[:2], batch_size=min(FIT.iblm_batch_size, len(data[0])),
                            max_scale_ratio=FIT.max_scale_ratio)
            run = train(
                model, guide, data, steps=args.steps, lr=args.lr, batch_size=args.batch_size,
                eval_every=args.eval_every,
                # the SNR is measured on the first seed's run only: it is the slow part
                snr_steps=args.snr_steps if seed == 0 else (), snr_draws=args.snr_draws,
                desc=f"{name} seed {seed}",
            )
            run["final"] = evaluate(model, guide, data[2], data[3], args.num_samples)
            run["num_parameters"] = count_parameters(guide)
            runs.append(run)
        results[name] = runs
    return results


def robustness(args, data):
    """A sensitivity study, not a recipe: the final test accuracy of each guide over the
    grid init_scale × lr, from a random start trained with fit's configuration at lr."""
    sizes = (data[0].shape[1], args.width, 10)
    grid = [(s, lr) for s in args.grid_init_scales for lr in args.grid_lrs]
    results = {}
    bar = tqdm(total=len(GUIDES) * len(grid), desc="sensitivity grid")
    for name in GUIDES:
        results[name] = []
        for init_scale, lr in grid:
            pyro.clear_param_store()
            pyro.set_rng_seed(0)
            model = make_model(sizes, len(data[0]))
            guide = make_guide(name, model, init_scale)
            guide(data[0][:1], data[1][:1])  # a random start: means drawn from the prior
            train(model, guide, data, steps=args.grid_steps, lr=lr, batch_size=args.batch_size)
            final = evaluate(model, guide, data[2], data[3], args.num_samples)
            results[name].append({"init_scale": init_scale, "lr": lr, **final})
            bar.update()
    bar.close()
    return results


def summarize(args, comparison, grid):
    summary = {}
    for name in GUIDES:
        runs = comparison[name]
        finals = {k: [r["final"][k] for r in runs] for k in ("accuracy", "mnll", "ece", "brier")}
        snr = runs[0]["snr"]
        accuracies = [g["accuracy"] for g in grid[name]]
        summary[name] = {
            "num_parameters": runs[0]["num_parameters"],
            **{k: sum(v) / len(v) for k, v in finals.items()},
            **{f"{k}_std": _std(v) for k, v in finals.items()},
            "ms_per_step": sum(r["ms_per_step"] for r in runs) / len(runs),
            "weight_std": sum(r["curve"][-1]["weight_std"] for r in runs) / len(runs),
            "snr_median": {
                step: {elbo: s["median"] for elbo, s in by_elbo.items()}
                for step, by_elbo in snr.items()
            },
            "grid_good": sum(a >= args.good_accuracy for a in accuracies),
            "grid_mean_accuracy": sum(accuracies) / max(len(accuracies), 1),
        }
    return summary


def _std(values):
    if len(values) < 2:
        return 0.0
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def markdown_tables(args, summary, grid):
    seeds = f"mean ± sd over {args.seeds} seeds" if args.seeds > 1 else "1 seed"
    num_configs = len(args.grid_init_scales) * len(args.grid_lrs)
    first, report = min(args.snr_steps), args.snr_report_step
    lines = [
        f"Test metrics after {args.steps} steps ({seeds}); weight std = mean posterior std "
        f"of the weights; gradient SNR = median over the weight sites' scale parameters "
        f"({args.snr_draws} draws, TraceMeanField_ELBO with the training's KL weight and "
        f"weight noise) at steps {first} and {report}; grid = the sensitivity study (not a "
        f"recipe): a random start at {len(args.grid_init_scales)} init_scale × "
        f"{len(args.grid_lrs)} learning rates, {args.grid_steps} steps each.",
        "",
        "| guide | parameters | accuracy | MNLL | ECE | Brier | weight std "
        f"| SNR @{first} | SNR @{report} | grid acc ≥ {args.good_accuracy:g} "
        "| grid mean acc | ms/step |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, s in summary.items():
        snr = {step: by_elbo["TraceMeanField_ELBO"] for step, by_elbo in s["snr_median"].items()}
        lines.append(
            f"| {name} | {s['num_parameters']} "
            f"| {s['accuracy']:.3f} ± {s['accuracy_std']:.3f} "
            f"| {s['mnll']:.3f} ± {s['mnll_std']:.3f} | {s['ece']:.3f} | {s['brier']:.3f} "
            f"| {s['weight_std']:.3f} "
            f"| {snr.get(first, math.nan):.2f} | {snr.get(report, math.nan):.2f} "
            f"| {s['grid_good']}/{num_configs} | {s['grid_mean_accuracy']:.3f} "
            f"| {s['ms_per_step']:.1f} |"
        )
    configs = [(g["init_scale"], g["lr"]) for g in grid[GUIDES[0]]]
    lines += [
        "",
        "Sensitivity study, not a recipe: test accuracy from a random start at init_scale, "
        f"trained with fit's configuration at learning rate lr for {args.grid_steps} steps "
        "(init_scale, lr):",
        "",
        "| guide | " + " | ".join(f"{s:g}, {lr:g}" for s, lr in configs) + " |",
        "|---|" + "---:|" * len(configs),
    ]
    for name in GUIDES:
        lines.append(f"| {name} | " + " | ".join(f"{g['accuracy']:.3f}" for g in grid[name]) + " |")
    return "\n".join(lines)


def plot(args, comparison, grid, summary):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = dict(zip(GUIDES, plt.get_cmap("tab10").colors))
    written = []

    def save(fig, name):
        fig.tight_layout()
        path = os.path.join(args.out_dir, name)
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)

    # Learning curves, averaged over seeds.
    keys = ("train_loss", "error_rate", "mnll", "weight_std")
    labels = ("training loss / N (KL-weighted -ELBO)", "test error", "test MNLL",
              "posterior std of weights")
    fig, axes = plt.subplots(1, len(keys), figsize=(16, 3.6))
    for name in GUIDES:
        curves = [r["curve"] for r in comparison[name]]
        steps = [c["step"] for c in curves[0]]
        for ax, key in zip(axes, keys):
            values = [sum(c[i][key] for c in curves) / len(curves) for i in range(len(steps))]
            ax.plot(steps, values, label=name, color=colors[name])
    for ax, label in zip(axes, labels):
        ax.set_xlabel("SVI step")
        ax.set_ylabel(label)
        ax.set_yscale("log")
    axes[0].legend()
    save(fig, "learning_curves.png")

    # Gradient SNR: its median over training, and its distribution at one step.
    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(11, 3.8))
    for name in GUIDES:
        snr = comparison[name][0]["snr"]
        steps = sorted(snr)
        for elbo, style in zip(ELBOS, ("-", "--")):
            ax0.plot(steps, [snr[s][elbo]["median"] for s in steps], style, marker="o",
                     color=colors[name], label=f"{name}" if style == "-" else None)
    # |mean| / std of pure noise over n draws has median about 0.674 / sqrt(n)
    floor = 0.674 / math.sqrt(args.snr_draws)
    ax0.axhline(floor, color="gray", lw=0.8, ls=":", label="noise floor")
    ax0.set_xlabel("SVI step")
    ax0.set_ylabel("median gradient SNR")
    ax0.set_yscale("log")
    ax0.set_title("scale parameters (solid: MF ELBO, dashed: Trace_ELBO)", fontsize=9)
    ax0.legend(fontsize=8)
    report = [comparison[n][0]["snr"].get(args.snr_report_step) for n in GUIDES]
    if all(report):
        values = [r["TraceMeanField_ELBO"]["values"] for r in report]
        ax1.boxplot(values, showfliers=False)
        ax1.set_xticks(range(1, len(GUIDES) + 1), GUIDES, rotation=20, fontsize=8)
        ax1.axhline(floor, color="gray", lw=0.8, ls=":")
        ax1.set_yscale("log")
        ax1.set_ylabel("per-parameter gradient SNR")
        ax1.set_title(f"at step {args.snr_report_step}, TraceMeanField_ELBO", fontsize=9)
    save(fig, "gradient_snr.png")

    # Parameter count against test metrics.
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.4))
    for ax, key, label in zip(
        axes,
        ("num_parameters", "accuracy", "mnll"),
        ("guide parameters", "test accuracy", "test MNLL"),
    ):
        values = [summary[n][key] for n in GUIDES]
        errors = [summary[n].get(f"{key}_std", 0.0) for n in GUIDES]
        ax.bar(range(len(GUIDES)), values, yerr=errors, color=[colors[n] for n in GUIDES])
        ax.set_xticks(range(len(GUIDES)), GUIDES, rotation=20, fontsize=8)
        ax.set_ylabel(label)
        if key == "accuracy":
            ax.set_ylim(max(0.0, min(values) - 0.05), 1.0)
    save(fig, "metrics.png")

    # Robustness: one heatmap of test accuracy per guide.
    scales, lrs = args.grid_init_scales, args.grid_lrs
    fig, axes = plt.subplots(1, len(GUIDES), figsize=(2.6 * len(GUIDES) + 1, 2.9), sharey=True,
                             layout="constrained")
    for ax, name in zip(axes, GUIDES):
        acc = torch.tensor([g["accuracy"] for g in grid[name]]).reshape(len(scales), len(lrs))
        image = ax.imshow(acc, vmin=0.0, vmax=1.0, cmap="viridis", origin="lower")
        for i in range(len(scales)):
            for j in range(len(lrs)):
                ax.text(j, i, f"{acc[i, j]:.2f}", ha="center", va="center", fontsize=8,
                        color="white" if acc[i, j] < 0.6 else "black")
        ax.set_xticks(range(len(lrs)), [f"{lr:g}" for lr in lrs])
        ax.set_yticks(range(len(scales)), [f"{s:g}" for s in scales])
        ax.set_xlabel("learning rate")
        ax.set_title(name, fontsize=9)
    axes[0].set_ylabel("init_scale")
    fig.colorbar(image, ax=list(axes), label="test accuracy", shrink=0.9)
    fig.suptitle("sensitivity study, not a recipe: a random start at init_scale, fit's "
                 f"configuration at each learning rate, {args.grid_steps} steps", fontsize=9)
    fig.savefig(os.path.join(args.out_dir, "robustness.png"), dpi=100)
    plt.close(fig)
    written.append(os.path.join(args.out_dir, "robustness.png"))
    return written


def _without_snr_values(comparison):
    # the per-parameter SNRs (thousands per guide) go to the plot, not the JSON
    return {
        name: [
            {**run, "snr": {
                step: {elbo: {k: v for k, v in s.items() if k != "values"}
                       for elbo, s in by_elbo.items()}
                for step, by_elbo in run["snr"].items()
            }}
            for run in runs
        ]
        for name, runs in comparison.items()
    }


def main(args):
    torch.set_num_threads(args.threads)
    data = load_digits()
    start = time.perf_counter()
    comparison = compare(args, data)
    grid = robustness(args, data)
    summary = summarize(args, comparison, grid)
    elapsed = time.perf_counter() - start

    print(markdown_tables(args, summary, grid))
    print(f"\ntotal time {elapsed:.0f} s")

    results = {"config": vars(args), "seconds": elapsed, "summary": summary,
               "comparison": _without_snr_values(comparison), "robustness": grid}
    save_results(args.out_dir, results, lambda: plot(args, comparison, grid, summary))
    return summary


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=32, help="hidden units")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=128, help="fit's default")
    parser.add_argument("--lr", type=float, default=FIT.lr, help="Adam's (fit's default)")
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--num-samples", type=int, default=100,
                        help="posterior samples of the final test metrics")
    parser.add_argument("--snr-steps", type=int, nargs="+", default=[0, 100, 300, 1000],
                        help="training steps at which to measure the gradient SNR")
    parser.add_argument("--snr-report-step", type=int, default=100,
                        help="the SNR step reported in the table")
    parser.add_argument("--snr-draws", type=int, default=200,
                        help="gradient draws per SNR estimate")
    parser.add_argument("--grid-init-scales", type=float, nargs="+", default=[1e-2, 1e-1, 1.0],
                        help="init_scale values of the sensitivity study (a random start)")
    parser.add_argument("--grid-lrs", type=float, nargs="+", default=[1e-3, 1e-2, 1e-1],
                        help="learning rates of the sensitivity study")
    parser.add_argument("--grid-steps", type=int, default=500)
    parser.add_argument("--good-accuracy", type=float, default=0.9,
                        help="accuracy counted as a success on the grid")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out-dir", default="results/guide_comparison")
    parser.add_argument("--quick", action="store_true", help="smoke run (seconds)")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.seeds, args.eval_every, args.num_samples = 20, 1, 10, 4
        args.snr_steps, args.snr_report_step, args.snr_draws = [0, 20], 20, 4
        args.grid_init_scales, args.grid_lrs, args.grid_steps = [1e-2], [1e-2, 3e-2], 10
    if args.snr_report_step not in args.snr_steps:
        args.snr_steps = sorted(set(args.snr_steps) | {args.snr_report_step})
    args.snr_steps = [s for s in args.snr_steps if s <= args.steps]
    return args


if __name__ == "__main__":
    main(parse_args())
