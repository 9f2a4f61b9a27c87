"""
Local reparameterization and Flipout: gradient variance (Kingma et al. 2015,
Table 1, in spirit), SVI step time, the low-rank k-tied variance path, and
pure-PyTorch peers, all measured in one run.

1. *Gradient variance.* A Bayesian MLP 64→400→400→400→10 (N(0, 1/D_in)
   priors) on scikit-learn digits, with a fully factorized Normal guide at
   each site (closed-form KL, so the noise is the likelihood's; means
   initialized by a prior draw), is trained with LRT for 10 and for 100
   epochs, with the KL weighted by N/60 000 (the per-example KL weight of
   [1]'s MNIST runs; with the full KL, 1437 images cannot pull 370k weights
   off their prior and the network stays at chance). Then, for minibatches
   of 128 and 1000 drawn at random from the training set, the gradient of the
   same loss with respect to the means of the bottom (64→400) and top
   (400→10) weights is drawn many times for each estimator: ordinary (one
   weight sample per minibatch), LRT, Flipout, and the weights at their
   posterior mean (no weight noise: the floor set by the choice of
   minibatch). The table gives the variance over draws averaged over the
   weight's elements, and each estimator's ratio to the ordinary one
   (target for LRT ≤ 1/3).
2. *Step time* of SVI on the same network, batch 128: LRT and Flipout as
   ratios to ordinary sampling with the same guide (target LRT ≤ 1.3×), and
   AutoKTiedNormal(k=2) + LRT with the low-rank variance path against the
   dense one, plus the variance term f(x², S∘S) alone.
3. *Peers* on 64→400→400→10, batch 128: a deterministic ``nn`` Adam step,
   bayesian-torch's ``LinearReparameterization`` and ``LinearFlipout``
   layers (closed-form KL; a benchmark-only dependency, ``pip install
   --no-deps bayesian-torch``; its rows are skipped when it is not
   installed), Pyro's AutoNormal, and AutoKTiedNormal with and without LRT
   (targets: AutoKTiedNormal + LRT ≤ 1.5× bayesian-torch's Reparameterization
   and ≤ 0.7× AutoNormal), and the cost of a TorchFunctionMode
   interception (a mode doing nothing), which the handlers avoid.

Timings are interleaved (each configuration runs a block of steps per round)
and each is the median over rounds of the per-step time, so that machine
noise hits all alike. Pyro's validation is off for the timings (as for any
Pyro timing); the peers are also timed with it on, Pyro's default.

Usage::

    python benchmarks/bench_lrt.py            # full run (~2 minutes on 2 idle cores)
    python benchmarks/bench_lrt.py --threads 1 --tag _1thread
    python benchmarks/bench_lrt.py --quick    # smoke run

[1] Kingma, Salimans, Welling (2015) "Variational Dropout and the Local
Reparameterization Trick"
"""

import argparse
import json
import os
import statistics
import time

import pyro
import pyro.distributions as dist
import torch
import torch.nn.functional as F
from pyro.infer import SVI, Trace_ELBO, TraceMeanField_ELBO
from pyro.infer.autoguide import AutoNormal, init_to_sample
from torch.overrides import TorchFunctionMode

from pyro_vinit import AutoKTiedNormal, FlipoutMessenger, LocalReparamMessenger
from pyro_vinit.data import load_digits
from pyro_vinit.guides import AutoSiteGuide
from pyro_vinit.nn import BayesianClassifier, bayesianize, mlp
from pyro_vinit.poutine import KLAnnealingMessenger
from pyro_vinit.testing.gradient_variance import ESTIMATORS as GRADIENT_ESTIMATORS
from pyro_vinit.testing.gradient_variance import gradient_variance as gradient_variance_draws

try:
    from bayesian_torch.layers import LinearFlipout, LinearReparameterization
except ImportError:  # benchmark-only dependency
    LinearFlipout = LinearReparameterization = None

HANDLERS = {
    "ordinary": None,
    "LRT": LocalReparamMessenger,
    "Flipout": FlipoutMessenger,
}


# The three estimators and the floor no weight-sampling scheme goes below.
ESTIMATORS = dict(GRADIENT_ESTIMATORS)

# The KL weight per training example of [1]'s MNIST runs (KL / 60 000 per
# datum): on 1437 digits the full KL of 370k weights keeps the posterior at
# the prior and the network at chance accuracy, which is no regime to
# compare gradient estimators in.
MNIST_SIZE = 60000


class AutoMeanFieldNormal(AutoSiteGuide):
    """AutoNormal's fully factorized Normal, placed at the site itself (so
    TraceMeanField_ELBO uses the closed-form KL)."""

    def _setup_scales(self):
        self._setup_normal_scales(self._event_dims)

    def _unconstrained_posterior(self, name):
        loc, scale = self._get_loc_and_scale(name)
        return dist.Normal(loc, scale).to_event(self._event_dims[name])


def make_svi(
    guide_cls, sizes, num_data, lr=1e-3, prior_scale=None, elbo=TraceMeanField_ELBO, **kwargs
):
    net = bayesianize(mlp(sizes), prior_scale=prior_scale)
    model = BayesianClassifier(net, num_data=num_data)
    guide = guide_cls(model, **kwargs)
    return model, guide, SVI(model, guide, pyro.optim.Adam({"lr": lr}), elbo())


def run(handler_cls, fn, *args, **kwargs):
    if handler_cls is None:
        return fn(*args, **kwargs)
    with handler_cls(**kwargs.pop("_handler_kwargs", {})):
        return fn(*args, **kwargs)


# ------------------------------------------------------------ gradient variance


SIZES = (64, 400, 400, 400, 10)


def gradient_variance(
    x, y, *, sizes=SIZES, epochs=(10, 100), batch_sizes=(128, 1000), draws=100,
    train_batch_size=128, lr=1e-3, prior_scale=None, kl_weight=1.0, guide_kwargs=None,
    handlers=None, evaluate=None, log=print,
):
    """
    The gradient-variance measurement of part 1 (``examples/gradient_variance.py``
    makes the same measurement).

    Fits a mean-field Normal guide of ``mlp(sizes)`` (N(0, 1/D_in) priors by
    default) with LRT and Adam on minibatches of ``train_batch_size``; at each
    checkpoint in ``epochs`` (cumulative), draws ``draws`` gradients of the
    TraceMeanField_ELBO loss with respect to the means of the bottom and top
    weights for every estimator in ``handlers`` and batch size in
    ``batch_sizes`` (each draw a new minibatch without replacement and new
    weight noise), at the fixed parameters.

    :param float prior_scale: A N(0, prior_scale²) prior for every weight
        instead of N(0, 1/D_in).
    :param float kl_weight: A factor on the KL term, in training and in the
        gradient draws (:class:`~pyro_vinit.poutine.KLAnnealingMessenger`
        with a constant scale).
    :param dict guide_kwargs: Keyword arguments of the guide (e.g.
        ``init_loc_fn``, ``init_scale``).
    :param dict handlers: The estimators, by name: a messenger class, or None
        for ordinary sampling (default: :data:`HANDLERS`).
    :param callable evaluate: Optional ``evaluate(model, guide) -> dict``,
        called at each checkpoint; its result is stored as ``"metrics"``.
    :param callable log: Progress messages (None: silent).
    :return: A list of rows ``{"epochs", "batch", "ordinary": {"bottom",
        "top", "ms_per_draw"}, "LRT": {...}, ...}``, one entry per estimator:
        the variance over draws averaged over the weight's elements, and the
        mean wall time of one draw.
    """
    handlers = HANDLERS if handlers is None else handlers
    model, guide, svi = make_svi(AutoMeanFieldNormal, sizes, len(x), lr=lr,
                                 prior_scale=prior_scale, **(guide_kwargs or {}))
    svi.step(x[:train_batch_size], y[:train_batch_size])
    params = dict(guide.named_parameters())
    bottom = params["locs.net.0.weight_unconstrained"]
    top = params[f"locs.net.{2 * (len(sizes) - 2)}.weight_unconstrained"]
    elbo = TraceMeanField_ELBO()
    rows, done = [], 0
    steps_per_epoch = max(1, len(x) // train_batch_size)
    kl = KLAnnealingMessenger(kl_weight)
    step = kl(LocalReparamMessenger()(svi.step))
    for epoch in epochs:
        for _ in range((epoch - done) * steps_per_epoch):
            idx = torch.randint(0, len(x), (train_batch_size,))
            step(x[idx], y[idx])
        done = epoch
        metrics = None if evaluate is None else evaluate(model, guide)
        for batch in batch_sizes:
            row = {"epochs": epoch, "batch": batch}
            if metrics is not None:
                row["metrics"] = metrics
            row.update(gradient_variance_draws(
                lambda xb, yb: elbo.differentiable_loss(model, guide, xb, yb),
                {"bottom": bottom, "top": top}, x, y, batch=batch, draws=draws,
                estimators=handlers, context=lambda: kl))
            rows.append(row)
            if log is not None:
                log(f"  variance: {epoch} epochs, batch {batch} done")
    return rows


def train_accuracy(x, y, num_samples=16):
    """The ``evaluate`` of :func:`gradient_variance`: accuracy of the posterior
    predictive on the training set, to show that the network is not at its
    prior."""

    @torch.no_grad()
    def evaluate(model, guide):
        logits = pyro.infer.Predictive(model, guide=guide, num_samples=num_samples,
                                       return_sites=["_RETURN"])(x)["_RETURN"]
        return {"accuracy": (logits.softmax(-1).mean(0).argmax(-1) == y).float().mean().item()}

    return evaluate


# ------------------------------------------------------------------- timings


def interleaved(configs, rounds, block):
    for fn in configs.values():  # warm-up
        for _ in range(max(3, block // 2)):
            fn()
    times = {name: [] for name in configs}
    for _ in range(rounds):
        for name, fn in configs.items():
            start = time.perf_counter()
            for _ in range(block):
                fn()
            times[name].append((time.perf_counter() - start) / block * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def svi_step(svi, x, y, handler=None):
    if handler is None:
        return lambda: svi.step(x, y)
    return handler(svi.step)


def step_times(args, x, y):
    sizes = SIZES
    xb, yb = x[:128], y[:128]
    configs = {}
    _, _, mf = make_svi(AutoMeanFieldNormal, sizes, len(x))
    _, _, kt = make_svi(AutoKTiedNormal, sizes, len(x), rank=2)
    for svi in (mf, kt):
        svi.step(xb, yb)
    configs["mean-field ordinary"] = lambda: mf.step(xb, yb)
    lrt, flip = LocalReparamMessenger()(mf.step), FlipoutMessenger()(mf.step)
    configs["mean-field LRT"] = lambda: lrt(xb, yb)
    configs["mean-field Flipout"] = lambda: flip(xb, yb)
    configs["k-tied ordinary"] = lambda: kt.step(xb, yb)
    low = LocalReparamMessenger(low_rank=True)(kt.step)
    dense = LocalReparamMessenger(low_rank=False)(kt.step)
    configs["k-tied LRT low-rank"] = lambda: low(xb, yb)
    configs["k-tied LRT dense"] = lambda: dense(xb, yb)
    return interleaved(configs, args.rounds, args.block)


def variance_term_times(args):
    # f(x², S∘S) alone, forward and backward, for a 400×400 k-tied weight.
    out = {}
    m = n = 400
    u = torch.rand(m, 2, requires_grad=True)
    v = torch.rand(n, 2, requires_grad=True)
    for batch in (128, 1000):
        x2 = torch.rand(batch, n)

        def dense(x2=x2):
            F.linear(x2, (u @ v.t()).pow(2)).sum().backward()

        def low_rank(x2=x2):
            a, b = torch.triu_indices(2, 2)
            coef = torch.where(a == b, 1.0, 2.0)
            u2, v2 = u[:, a] * u[:, b] * coef, v[:, a] * v[:, b]
            F.linear(F.linear(x2, v2.t()), u2).sum().backward()

        t = interleaved({"dense": dense, "low-rank": low_rank}, args.rounds, args.block * 5)
        out[batch] = t
    return out


def bayesian_torch_step(layer_cls, sizes, x, y, num_data):
    layers = torch.nn.ModuleList(layer_cls(a, b) for a, b in zip(sizes[:-1], sizes[1:]))
    opt = torch.optim.Adam(layers.parameters(), lr=1e-3)

    def step():
        opt.zero_grad()
        h, kl = x, 0.0
        for i, layer in enumerate(layers):
            h, k = layer(h)
            kl = kl + k
            if i < len(layers) - 1:
                h = torch.relu(h)
        loss = F.cross_entropy(h, y, reduction="sum") * (num_data / len(x)) + kl
        loss.backward()
        opt.step()

    return step


def native_step(sizes, num_data, x, y):
    """AutoKTiedNormal + LRT trained the PyTorch way that Pyro documents: the ELBO
    as an ``nn.Module`` and one ``torch.optim.Adam`` over all its parameters,
    instead of SVI with one Pyro-managed optimizer per parameter."""
    model, guide, _ = make_svi(AutoKTiedNormal, sizes, num_data, rank=2)
    loss_fn = TraceMeanField_ELBO()(model, guide)
    with LocalReparamMessenger():
        loss_fn(x, y)  # creates the parameters
    opt = torch.optim.Adam(loss_fn.parameters(), lr=1e-3)
    handler = LocalReparamMessenger()

    def step():
        opt.zero_grad()
        with handler:
            loss = loss_fn(x, y)
        loss.backward()
        opt.step()

    return step


class _NoOpMode(TorchFunctionMode):
    # A Python call on every torch function of the step, and nothing else.
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def peer_times(args, x, y, validate):
    pyro.enable_validation(validate)
    sizes = (64, 400, 400, 10)
    xb, yb = x[:128], y[:128]
    configs = {}
    net = mlp(sizes)
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)

    def deterministic():
        opt.zero_grad()
        F.cross_entropy(net(xb), yb).backward()
        opt.step()

    configs["nn (deterministic) Adam"] = deterministic
    if LinearReparameterization is not None:
        configs["bayesian-torch LinearReparameterization"] = bayesian_torch_step(
            LinearReparameterization, sizes, xb, yb, len(x)
        )
        configs["bayesian-torch LinearFlipout"] = bayesian_torch_step(
            LinearFlipout, sizes, xb, yb, len(x)
        )
    _, _, an = make_svi(AutoNormal, sizes, len(x))
    # Pyro's default ELBO too: AutoNormal has no closed-form KL to gain from the mean-field one.
    _, _, an_trace = make_svi(AutoNormal, sizes, len(x), elbo=Trace_ELBO)
    _, _, kt = make_svi(AutoKTiedNormal, sizes, len(x), rank=2)
    for svi in (an, an_trace, kt):
        svi.step(xb, yb)
    configs["Pyro AutoNormal"] = lambda: an.step(xb, yb)
    configs["Pyro AutoNormal, Trace_ELBO"] = lambda: an_trace.step(xb, yb)
    an_lrt = LocalReparamMessenger()(an.step)
    configs["Pyro AutoNormal + LRT"] = lambda: an_lrt(xb, yb)
    configs["AutoKTiedNormal"] = lambda: kt.step(xb, yb)
    lrt = LocalReparamMessenger()(kt.step)
    configs["AutoKTiedNormal + LRT"] = lambda: lrt(xb, yb)
    configs["AutoKTiedNormal + LRT, PyTorch-native loop"] = native_step(sizes, len(x), xb, yb)

    def under_mode():
        with _NoOpMode():
            kt.step(xb, yb)

    configs["AutoKTiedNormal under a no-op TorchFunctionMode handler"] = under_mode
    try:
        return interleaved(configs, args.rounds, args.block)
    finally:
        pyro.enable_validation(True)


# --------------------------------------------------------------------- report


KT_LRT = "AutoKTiedNormal + LRT"


def report(results):
    lines = []
    if "variance" in results:
        lines += _report_variance(results)
    lines += _report_peers(results)
    return "\n".join(lines)


def _report_variance(results):
    lines = ["## Gradient variance (mean over elements of the variance over draws)", ""]
    lines.append(
        "| epochs | train acc. | batch | layer | ordinary | LRT | Flipout | no weight noise "
        "| LRT / ordinary | Flipout / ordinary | no noise / ordinary |"
    )
    lines.append("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for row in results["variance"]:
        acc = row["metrics"]["accuracy"]
        for layer in ("bottom", "top"):
            o, lr_, fl, nn_ = (row[k][layer] for k in ESTIMATORS)
            lines.append(
                f"| {row['epochs']} | {acc:.3f} | {row['batch']} | {layer} | {o:.3g} | {lr_:.3g} "
                f"| {fl:.3g} | {nn_:.3g} | {lr_ / o:.2g} | {fl / o:.2g} | {nn_ / o:.2g} |"
            )
    t = results["step_times"]
    lines += ["", "## SVI step time, 64→400→400→400→10, batch 128 (ms, validation off)", ""]
    lines += ["| configuration | ms | ratio |", "| --- | --- | --- |"]
    for name, ms in t.items():
        ref = t["k-tied ordinary"] if name.startswith("k-tied") else t["mean-field ordinary"]
        lines.append(f"| {name} | {ms:.2f} | {ms / ref:.2f}× |")
    lines += ["", "## Variance term f(x², S∘S) alone, 400×400, k = 2 (ms, forward + backward)", ""]
    lines += ["| batch | dense | low-rank | low-rank / dense |", "| --- | --- | --- | --- |"]
    for batch, v in results["variance_term"].items():
        ratio = v["low-rank"] / v["dense"]
        lines.append(f"| {batch} | {v['dense']:.3f} | {v['low-rank']:.3f} | {ratio:.2f} |")
    return lines


def _report_peers(results):
    lines = []
    bt = "bayesian-torch LinearReparameterization"
    for validate in ("validation off", "validation on"):
        p = results["peers"][validate]
        repeats = results["peer_repeats"] if validate == "validation off" else [p]
        how = f", median of {len(repeats)} repeats" if len(repeats) > 1 else ""
        lines += ["", f"## Peers, 64→400→400→10, batch 128 (ms, Pyro {validate}{how})", ""]
        lines += ["| configuration | ms | / AutoNormal |", "| --- | --- | --- |"]
        for name, ms in p.items():
            lines.append(f"| {name} | {ms:.2f} | {ms / p['Pyro AutoNormal']:.2f} |")
        references = ["Pyro AutoNormal", "Pyro AutoNormal, Trace_ELBO"]
        if bt in p:
            r, r_native = (p[k] / p[bt] for k in (KT_LRT, KT_LRT + ", PyTorch-native loop"))
            lines.append(f"\n{KT_LRT} / bayesian-torch Reparameterization: {r:.2f}× "
                         f"(SVI), {r_native:.2f}× (PyTorch-native loop)")
            references.append(bt)
        else:
            lines.append("\nbayesian-torch is not installed: its rows are skipped "
                         "(benchmark-only: pip install --no-deps bayesian-torch).")
        if len(repeats) > 1:
            for ref in references:
                ratios = ", ".join(f"{t[KT_LRT] / t[ref]:.2f}" for t in repeats)
                lines.append(f"{KT_LRT} / {ref}, per repeat: {ratios}")
    return lines


def main(args):
    torch.set_num_threads(args.threads)
    # Many guides live side by side (those of one class would share parameter names in
    # Pyro's global param store): with module-local parameters each guide owns its own,
    # as an nn.Module does; SVI and its optimizer work the same.
    pyro.settings.set(module_local_params=True)
    pyro.set_rng_seed(0)
    x, y, _, _ = load_digits()
    results = {"config": vars(args), "bayesian_torch": LinearReparameterization is not None}
    results["load_average_before"] = os.getloadavg()
    if not args.peers_only:
        results["step_times"] = step_times(args, x, y)
        print("  step times done", flush=True)
        results["variance_term"] = variance_term_times(args)
    # The peers' ratios move by ±10 % from one measurement to the next on this machine
    # (more than within one): repeat it and report the median and the range.
    repeats = [peer_times(args, x, y, False) for _ in range(args.peer_repeats)]
    results["peer_repeats"] = repeats
    results["peers"] = {
        "validation off": {k: statistics.median(r[k] for r in repeats) for k in repeats[0]},
        "validation on": peer_times(args, x, y, True),
    }
    print("  peers done", flush=True)
    if not args.peers_only:
        pyro.enable_validation(False)
        results["kl_weight"] = len(x) / MNIST_SIZE
        results["variance"] = gradient_variance(
            x, y, epochs=args.epochs, draws=args.draws, kl_weight=results["kl_weight"],
            guide_kwargs=dict(init_loc_fn=init_to_sample), handlers=ESTIMATORS,
            evaluate=train_accuracy(x, y), log=lambda m: print(m, flush=True),
        )
    results["load_average_after"] = os.getloadavg()
    text = report(results)
    text += "\n\nLoad average (1, 5, 15 min) before / after the run, on {} cores: {} / {}".format(
        os.cpu_count(),
        tuple(round(v, 2) for v in results["load_average_before"]),
        tuple(round(v, 2) for v in results["load_average_after"]),
    )
    print(text)
    if not args.quick:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"bench_lrt{args.tag}.json"), "w") as f:
            json.dump(results, f, indent=2)
        with open(os.path.join(args.out, f"bench_lrt{args.tag}.md"), "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tag", default="", help="suffix of the result files")
    parser.add_argument("--peer-repeats", type=int, default=3,
                        help="measurements of the peers (validation off)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    parser.add_argument("--peers-only", action="store_true",
                        help="only the peers' step times (parts 3), e.g. before/after a change")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds per timing")
    args = parser.parse_args()
    args.epochs = [1, 2] if args.quick else [10, 100]
    args.draws = 5 if args.quick else 100
    args.rounds = args.rounds or (2 if args.quick else 15)
    args.block = 3 if args.quick else 20
    if args.quick:
        args.peer_repeats = 1
    main(args)
