"""
How close can a Pyro model get to bayesian-torch? The step time of
``AutoKTiedNormal(rank=2)`` + ``local_reparam()`` split into the
estimator's arithmetic, Pyro's per-site machinery and this library's own
overhead, to tell which of issue 16's targets are reachable.

Four configurations are timed side by side (interleaved rounds,
``benchmarks/harness.py``), in Pyro's PyTorch-native loop with
validation off:

* ``bayesian-torch``: its ``LinearReparameterization`` layers (one shared
  weight sample per step, closed-form KL);
* ``pure PyTorch, our estimator``: the arithmetic of AutoKTiedNormal + LRT +
  TraceMeanField_ELBO written out in plain PyTorch (``_steps.pure_ktied_lrt_step``;
  its loss equals the Pyro step's under the same seed, a test checks it);
* ``minimal Pyro``: a hand-written functional model (``pyro.sample`` +
  ``F.linear``) and guide (``pyro.param`` + ``Normal`` per site), the
  least a Pyro program with these sites pays, without LRT;
* ``ours``: ``AutoKTiedNormal(rank=2)`` + ``local_reparam()``.

On a tiny network (8→8→8→3, batch 2) the arithmetic is negligible, so the
differences there are fixed costs per step: *Pyro's machinery* is minimal
Pyro − bayesian-torch (both sample weights and use a closed-form KL), *our
overhead* is ours − pure − Pyro's machinery. On 64→400→400→10 at batch 128
and 1000 the *floor* of any Pyro implementation of this estimator is pure +
Pyro's machinery, and the floor ratio is floor ÷ bayesian-torch: a target
below it cannot be met by changing this library.

Usage::

    python -m benchmarks.bench_floor --threads 1      # about a minute on an idle host
    python -m benchmarks.bench_floor --quick          # smoke run, no files
"""

import pyro
import pyro.distributions as dist
import torch
import torch.nn.functional as F
from pyro.infer import TraceMeanField_ELBO

from benchmarks._steps import (
    BAYESIAN_TORCH,
    BAYESIAN_TORCH_MISSING,
    LinearReparameterization,
    bayesian_torch_step,
    make_model,
    native_step,
    pure_ktied_lrt_step,
)
from benchmarks.harness import (
    host_info,
    make_parser,
    markdown_table,
    parse_args,
    result_stem,
    set_threads,
    time_interleaved,
    write_report,
)
from pyro_vinit import AutoKTiedNormal, LocalReparamMessenger

NUM_DATA = 1437  # the digits training set of the other benchmarks
BT, PURE, MINIMAL, OURS = ("bayesian-torch", "pure PyTorch, our estimator", "minimal Pyro",
                           "ours")
# name: (sizes, batch)
SETTINGS = {
    "tiny 8-8-8-3, batch 2": ((8, 8, 8, 3), 2),
    "64-400-400-10, batch 128": ((64, 400, 400, 10), 128),
    "64-400-400-10, batch 1000": ((64, 400, 400, 10), 1000),
}
TINY = "tiny 8-8-8-3, batch 2"


def minimal_pyro_step(sizes, x, y, num_data, lr=1e-3):
    """A functional Pyro model and a hand-written mean-field guide (no autoguide,
    no PyroModule), trained in the native loop: Pyro's per-site cost and nothing
    else."""
    shapes = [(n_out, n_in) for n_in, n_out in zip(sizes[:-1], sizes[1:])]

    def model(x, y):
        h = x
        for i, (n_out, n_in) in enumerate(shapes):
            w = pyro.sample(f"w{i}", dist.Normal(0.0, n_in ** -0.5).expand([n_out, n_in])
                            .to_event(2))
            b = pyro.sample(f"b{i}", dist.Normal(0.0, 1.0).expand([n_out]).to_event(1))
            h = F.linear(h, w, b)
            if i < len(shapes) - 1:
                h = torch.relu(h)
        with pyro.plate("data", num_data, subsample_size=len(x)):
            pyro.sample("obs", dist.Categorical(logits=h), obs=y)

    prefix = f"minimal{id(shapes)}."  # its own parameters beside other configurations'

    def guide(x, y):
        for i, (n_out, n_in) in enumerate(shapes):
            for name, shape in ((f"w{i}", (n_out, n_in)), (f"b{i}", (n_out,))):
                loc = pyro.param(prefix + name + "_loc", 0.1 * torch.randn(shape))
                scale = pyro.param(prefix + name + "_scale", torch.full(shape, 0.1),
                                   constraint=dist.constraints.softplus_positive)
                pyro.sample(name, dist.Normal(loc, scale).to_event(len(shape)))

    loss_fn = TraceMeanField_ELBO()(model, guide)
    loss_fn(x, y)
    store = pyro.get_param_store()
    params = [store.get_param(k).unconstrained() for k in store.keys() if k.startswith(prefix)]
    opt = torch.optim.Adam(params, lr=lr)

    def step():
        opt.zero_grad()
        loss_fn(x, y).backward()
        opt.step()

    step()
    return step


def configurations(sizes, batch):
    x = torch.randn(batch, sizes[0])
    y = torch.randint(0, sizes[-1], (batch,))
    model = make_model(sizes, NUM_DATA)
    guide = AutoKTiedNormal(model, rank=2)
    configs = {OURS: native_step(model, guide, x, y, handler=LocalReparamMessenger())}
    configs[PURE] = pure_ktied_lrt_step(model, guide, x, y, NUM_DATA)[0]
    configs[MINIMAL] = minimal_pyro_step(sizes, x, y, NUM_DATA)
    if BAYESIAN_TORCH is not None:
        configs[BT] = bayesian_torch_step(LinearReparameterization, sizes, x, y, NUM_DATA)
    return configs


def analyse(medians):
    """The fixed costs from the tiny setting and each setting's floor ratio (ms)."""
    tiny = medians[TINY]
    out = {}
    if BT in tiny:
        machinery = tiny[MINIMAL] - tiny[BT]
        out["pyro_machinery_ms"] = machinery
        out["our_overhead_ms"] = tiny[OURS] - tiny[PURE] - machinery
        out["floor_ratio"] = {s: (m[PURE] + machinery) / m[BT] for s, m in medians.items()}
        out["ratio"] = {s: m[OURS] / m[BT] for s, m in medians.items()}
    out["ours_minus_pure_ms"] = {s: m[OURS] - m[PURE] for s, m in medians.items()}
    return out


def report(medians, analysis, args, host, load_end):
    names = [BT, PURE, MINIMAL, OURS]
    rows = [[s] + [f"{m[n]:.2f}" if n in m else "—" for n in names] for s, m in medians.items()]
    lines = ["## Step time (ms, median over interleaved rounds, native loop, validation off)",
             "", markdown_table(["setting"] + names, rows), ""]
    if "floor_ratio" not in analysis:
        lines += [BAYESIAN_TORCH_MISSING]
    else:
        lines += [
            f"Fixed costs per step (tiny setting): Pyro's per-site machinery "
            f"{analysis['pyro_machinery_ms']:.2f} ms (minimal Pyro − bayesian-torch), this "
            f"library's overhead {analysis['our_overhead_ms']:.2f} ms (ours − pure − Pyro's "
            "machinery).", "",
            markdown_table(
                ["setting", "ours ÷ bayesian-torch", "floor ÷ bayesian-torch",
                 "ours − pure (ms)"],
                [[s, f"{analysis['ratio'][s]:.2f}", f"{analysis['floor_ratio'][s]:.2f}",
                  f"{analysis['ours_minus_pure_ms'][s]:.2f}"] for s in medians]),
        ]
    lines += ["", f"{args.threads} thread(s), {args.rounds} rounds × {args.block} steps; torch "
              f"{host['torch']}, Pyro {host['pyro']}, bayesian-torch "
              f"{BAYESIAN_TORCH or 'not installed'}; load average (1, 5, 15 min) at the start "
              f"{tuple(host['load_average'])}, at the end {tuple(load_end)}, on "
              f"{host['cpu_count']} cores."]
    return "\n".join(lines)


def main(args):
    set_threads(args.threads)
    pyro.enable_validation(False)
    pyro.settings.set(module_local_params=True)
    pyro.set_rng_seed(0)
    host = host_info()
    medians = {}
    for setting, (sizes, batch) in SETTINGS.items():
        if args.quick:
            sizes, batch = sizes[:1] + tuple(min(s, 16) for s in sizes[1:]), min(batch, 8)
        t = time_interleaved(configurations(sizes, batch), rounds=args.rounds,
                             block=args.block, warmup=args.warmup)
        medians[setting] = t.medians_ms()
        print(f"  {setting} done", flush=True)
    analysis = analyse(medians)
    text = report(medians, analysis, args, host, host_info()["load_average"])
    print(text)
    results = {"config": vars(args), "settings": {s: list(v) for s, v in SETTINGS.items()},
               "bayesian_torch": BAYESIAN_TORCH, "median_ms": medians, "analysis": analysis}
    if not args.quick:
        path = result_stem(args, "bench_floor")
        write_report(path, results, text, host_start=host)
    return results


if __name__ == "__main__":
    main(parse_args(make_parser(__doc__, timing=(10, 10, 3)),
                    quick={"rounds": 2, "block": 1, "warmup": 1}))
