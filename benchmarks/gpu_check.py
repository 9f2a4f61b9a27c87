"""
``make gpu-check``: the library on one accelerator, in one script meant to take
under 8 minutes on one H100: (a) the test suite's device-aware tests (those
taking the ``device`` fixture: ``pytest -m device --device cuda``); (b) the step
times of a Bayesian ReLU MLP 64→w→w→10 on the device: a deterministic network,
bayesian-torch ``LinearReparameterization``, ``AutoKTiedNormal(rank=2)`` +
``local_reparam()`` with fit's optimizer (``GroupedAdam``) through ``SVI``
(eager), through :class:`~pyro_vinit.CapturedSVI` replayed operator by operator
(``cuda_graph=False``), replayed as a CUDA graph (its default on CUDA) and
compiled by inductor and replayed as a CUDA graph (``compile=True``), and
NumPyro's ``AutoNormal`` with a ``jax.jit`` step where NumPyro is installed, at
batch 128 and 1024 and widths 400 and 2000, plus the capture's cost (the tracing
step's time, the compile's included, and the graph's memory) and I-BLM's
initialization time; (c) the float32 agreement of the captured step with the
eager step under the same seed (loss and gradients, largest relative difference
over four steps), and of the compiled step's draws (on CUDA inductor orders
independent draws its own way): its mean loss and gradients over 198 replays at
fixed parameters against the eager step's, each from a seed of its own, in
standard errors.

Synthetic data (no download); the timings are interleaved rounds
(``benchmarks/harness.py``), each step ending in a device synchronization.
Prints tables and writes ``gpu_check.json`` / ``.md`` into ``--out``.

Usage::

    python -m benchmarks.gpu_check --device cuda          # what `make gpu-check` runs
    python -m benchmarks.gpu_check --device cpu --quick   # smoke run of every part
"""

import functools
import os
import subprocess
import sys
import time

import pyro
import torch
from pyro.infer import SVI, TraceMeanField_ELBO

from benchmarks._steps import (
    BAYESIAN_TORCH,
    BAYESIAN_TORCH_MISSING,
    LinearReparameterization,
    bayesian_torch_step,
    deterministic_step,
    make_model,
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
from pyro_vinit import (
    AutoKTiedNormal,
    CapturedSVI,
    GroupedAdam,
    LocalReparamMessenger,
    init_guide_iblm,
)
from pyro_vinit.training._inductor import graph_size

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DETERMINISTIC = "nn (deterministic)"
BT = "bayesian-torch LinearReparameterization"
EAGER = "AutoKTiedNormal(2) + LRT, SVI (eager)"
REPLAYED = "AutoKTiedNormal(2) + LRT, CapturedSVI (op by op)"
CAPTURED = "AutoKTiedNormal(2) + LRT, CapturedSVI (CUDA graph)"
COMPILED = "AutoKTiedNormal(2) + LRT, CapturedSVI(compile=True) (inductor, CUDA graph)"
NUMPYRO = "NumPyro AutoNormal, jax.jit"
#: float32 agreement of the captured and eager steps (relative, largest over 4 steps)
AGREEMENT_RTOL = 1e-4


def _synced(step, device):
    if device.type != "cuda":
        return step

    def synced():
        step()
        torch.cuda.synchronize(device)

    return synced


def _data(batch, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 64, generator=g)
    y = torch.randint(0, 10, (batch,), generator=g)
    return x.to(device), y.to(device)


def run_tests(device, quick, out=None):
    """The device-aware tests on ``device``: their exit status and last line (and
    their whole output in ``out``/gpu_check_tests.log where ``out`` is given)."""
    paths = ["tests/test_devices.py", "tests/test_captured.py"] if quick else ["tests"]
    command = [sys.executable, "-m", "pytest", "-q", "-m", "device", "--device", str(device),
               "-p", "no:cacheprovider", *paths]
    if quick:
        command += ["-k", "fit or metrics or mlp"]
    start = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(
                              [ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(
                                  os.pathsep) if p])})
    lines = (done.stdout + done.stderr).strip().splitlines()
    if out is not None:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "gpu_check_tests.log"), "w") as f:
            f.write("\n".join(lines) + "\n")
    return {"command": " ".join(command[1:]), "returncode": done.returncode,
            "summary": lines[-1] if lines else "", "seconds": time.perf_counter() - start}


def _make_svi(kind, sizes, num_data, device):
    model = make_model(sizes, num_data).to(device)
    guide = AutoKTiedNormal(model, rank=2)
    optim, elbo = GroupedAdam({"lr": 1e-3}), TraceMeanField_ELBO()
    if kind == EAGER:
        return SVI(model, guide, optim, elbo)
    return CapturedSVI(model, guide, optim, elbo, cuda_graph=False if kind == REPLAYED else None,
                       compile=kind == COMPILED)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _pyro_steps(sizes, x, y, num_data, device, compiled=True):
    """Our steps, and the capture's cost: the tracing step's seconds (the
    compile's included) and the memory it keeps (CUDA: allocated bytes after
    it, less before it)."""
    steps, cost = {}, {}
    for name in (EAGER, REPLAYED, CAPTURED, *([COMPILED] if compiled else [])):
        svi = _make_svi(name, sizes, num_data, device)
        handler = LocalReparamMessenger()

        def step(svi=svi, handler=handler):
            with handler:
                svi.step(x, y)

        step()  # the eager first step (creates the parameters)
        _sync(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
        start = time.perf_counter()
        step()  # the captured steps trace (and compile) here
        _sync(device)
        if name == COMPILED and svi.compile_failure is not None:
            print(f"  not compiled: {svi.compile_failure}", flush=True)
            continue
        if name != EAGER:
            cost[name] = {"trace_seconds": time.perf_counter() - start, "memory_mib": None,
                          "peak_memory_mib": None}
            if device.type == "cuda":  # kept by the graph (its pool), and the peak
                cost[name]["memory_mib"] = (torch.cuda.memory_allocated(device)
                                            - before) / 2**20
                cost[name]["peak_memory_mib"] = (torch.cuda.max_memory_allocated(device)
                                                 - before) / 2**20
        if name == REPLAYED:  # the traced graph's size, for a model of the compile's saving
            (capture,) = svi._captures.values()
            cost[name]["operators"], cost[name]["elements"] = graph_size(capture.graph)
        steps[name] = step
    return steps, cost


def numpyro_step(sizes, batch):
    """A jitted NumPyro ``AutoNormal`` SVI step on jax's default device, or None."""
    try:
        import jax
        import numpyro
        import numpyro.distributions as ndist
        from numpyro.infer import SVI as NSVI
        from numpyro.infer import Trace_ELBO as NTrace_ELBO
        from numpyro.infer.autoguide import AutoNormal as NAutoNormal
    except ImportError:
        return None

    def model(x, y):
        h = x
        for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
            s = a ** -0.5
            w = numpyro.sample(f"w{i}", ndist.Normal(0.0, s).expand((a, b)).to_event(2))
            c = numpyro.sample(f"b{i}", ndist.Normal(0.0, s).expand((b,)).to_event(1))
            h = h @ w + c
            if i < len(sizes) - 2:
                h = jax.nn.relu(h)
        with numpyro.plate("data", x.shape[0], subsample_size=x.shape[0]):
            numpyro.sample("obs", ndist.Categorical(logits=h), obs=y)

    key = jax.random.PRNGKey(0)
    x = jax.random.normal(key, (batch, sizes[0]))
    y = jax.random.randint(key, (batch,), 0, sizes[-1])
    svi = NSVI(model, NAutoNormal(model), numpyro.optim.Adam(1e-3), NTrace_ELBO())
    state = [svi.init(key, x, y)]
    update = jax.jit(svi.update)

    def step():
        state[0], loss = update(state[0], x, y)
        loss.block_until_ready()

    step()
    return step


def step_times(device, batches, widths, args):
    rows = []
    for width in widths:
        sizes = (64, width, width, 10)
        for batch in batches:
            x, y = _data(batch, device)
            num_data = 10 * batch
            with torch.device(device):  # the networks' parameters made on the device
                configs = {DETERMINISTIC: deterministic_step(sizes, x, y)}
            if BAYESIAN_TORCH is not None:
                configs[BT] = _on_device_bt(sizes, x, y, num_data, device)
            ours, cost = _pyro_steps(sizes, x, y, num_data, device,
                                     compiled=not args.no_compile)
            configs.update(ours)
            jit = numpyro_step(sizes, batch)
            if jit is not None:
                configs[NUMPYRO] = jit
            configs = {name: _synced(step, device) for name, step in configs.items()}
            t = time_interleaved(configs, rounds=args.rounds, block=args.block,
                                 warmup=args.warmup)
            ms = {name: t.median(name) * 1e3 for name in t.names}
            row = {"width": width, "batch": batch, "ms": ms, "capture_cost": cost}
            for mine, label in ((CAPTURED, "captured"), (COMPILED, "compiled")):
                if mine not in ms:
                    continue
                if BT in ms:
                    row[f"{label}_over_bt"] = t.ratio(mine, BT).median
                if NUMPYRO in ms:
                    row[f"{label}_over_numpyro"] = t.ratio(mine, NUMPYRO).median
                row[f"{label}_over_eager"] = t.ratio(mine, EAGER).median
            rows.append(row)
            print(f"  width {width}, batch {batch}: "
                  + ", ".join(f"{name} {value:.2f} ms" for name, value in ms.items()),
                  flush=True)
    return rows


def _on_device_bt(sizes, x, y, num_data, device):
    with torch.device(device):
        return bayesian_torch_step(LinearReparameterization, sizes, x, y, num_data)


def iblm_seconds(device, width, batch):
    x, y = _data(batch, device, seed=1)
    model = make_model((64, width, width, 10), batch).to(device)
    guide = AutoKTiedNormal(model, rank=2)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    init_guide_iblm(guide, (x, y), batch_size=min(512, batch))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


class _Recorder(pyro.optim.PyroOptim):
    """A Pyro optimizer that records the gradients it is called with, by the guide's
    parameter names."""

    def __init__(self, optim, args, grads, guide):
        super().__init__(optim, args)
        self.grads = grads
        self.guide = guide

    def __call__(self, params, *args, **kwargs):
        params = list(params)
        names = {id(p): n for n, p in self.guide.named_parameters()}  # made at the first step
        self.grads.append({names.get(id(p), str(id(p))): p.grad.detach().clone()
                           for p in params if p.grad is not None})
        super().__call__(params, *args, **kwargs)


def _recorded_steps(make_svi, device, width, batch, steps, lr, draw_seed=None):
    """The losses and gradients (by step, by parameter) of ``steps`` steps from
    seed 0, float32, Adam at ``lr``; with ``draw_seed``, the steps after the first
    (which sets the guide's parameters up) draw from it."""
    x, y = _data(batch, device, seed=2)
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    model = make_model((64, width, width, 10), 10 * batch).to(device)
    guide = AutoKTiedNormal(model, rank=2)
    grads = []
    svi = make_svi(model, guide, _Recorder(torch.optim.Adam, {"lr": lr}, grads, guide),
                   TraceMeanField_ELBO())
    losses = []
    with LocalReparamMessenger():
        for step in range(steps):
            losses.append(svi.step(x, y))
            if step == 0 and draw_seed is not None:
                pyro.set_rng_seed(draw_seed)
    if getattr(svi, "compile_failure", None) is not None:
        print(f"  not compiled: {svi.compile_failure}", flush=True)
        return None  # replayed uncompiled: no figures of the compiled step
    return losses, grads


def _same_run(eager, other):
    """Largest relative difference of ``other``'s losses and gradients from
    ``eager``'s, step by step."""
    (l_e, g_e), (l_c, g_c) = eager, other
    worst = max(abs(a - b) / max(abs(a), 1e-30) for a, b in zip(l_e, l_c))
    for step_e, step_c in zip(g_e, g_c):
        if step_e.keys() != step_c.keys():
            return float("inf")  # different parameters got gradients
        for key, a in step_e.items():
            b = step_c[key]
            worst = max(worst, ((a - b).abs().max() / a.abs().max().clamp_min(1e-30)).item())
    return worst


def _same_distribution(eager, other):
    """How far ``other``'s mean loss and mean gradients (over its replays, at fixed
    parameters) lie from ``eager``'s, in standard errors: the loss's z, and the
    mean and largest |z| over the gradients' elements (each about N(0, 1) where the
    two steps draw from one distribution: E|z| = 0.80)."""
    def stacked(run):
        losses, grads = run
        rows = [torch.cat([g[k].flatten() for k in sorted(g)]).double() for g in grads[2:]]
        return torch.tensor(losses[2:], dtype=torch.float64)[:, None], torch.stack(rows)

    def z(a, b):
        se = (a.var(0) / len(a) + b.var(0) / len(b)).sqrt().clamp_min(1e-300)
        return ((a.mean(0) - b.mean(0)) / se).abs()

    (l_e, g_e), (l_c, g_c) = stacked(eager), stacked(other)
    zs = z(g_c, g_e)
    return {"loss_z": z(l_c, l_e).item(), "mean_abs_z": zs.mean().item(),
            "max_abs_z": zs.max().item(), "elements": zs.numel()}


def agreement(device, width, batch, steps=4, compiled=True, draws=200):
    """The captured step against the eager one, float32, the same seed: the largest
    relative difference of their losses and gradients over ``steps`` steps. The
    compiled step, whose draws inductor may order its own way on CUDA: its mean
    loss and gradients over ``draws`` replays at fixed parameters (lr 0) against
    the eager step's, each drawing from a seed of its own after the first step
    (:func:`_same_distribution`)."""
    eager = _recorded_steps(SVI, device, width, batch, steps, 1e-3)
    captured = _recorded_steps(CapturedSVI, device, width, batch, steps, 1e-3)
    worst = _same_run(eager, captured)
    found = {CAPTURED: {"max_relative_difference": worst, "rtol": AGREEMENT_RTOL,
                        "agree": worst <= AGREEMENT_RTOL}}
    if compiled:
        make = functools.partial(CapturedSVI, compile=True)
        # independent draws (the parameters alike): where inductor keeps the eager
        # order, shared draws would pull every z to 0
        other = _recorded_steps(make, device, width, batch, draws, 0.0, draw_seed=2)
        if other is None:
            found[COMPILED] = {"agree": False, "not_compiled": True}
        else:
            eager_draws = _recorded_steps(SVI, device, width, batch, draws, 0.0, draw_seed=1)
            result = _same_distribution(eager_draws, other)
            result["draws"] = draws - 2  # the replays
            result["agree"] = (result["loss_z"] < 4 and result["mean_abs_z"] < 0.9
                               and result["max_abs_z"] < 6.5)
            found[COMPILED] = result
    return found


def report(results, host):
    lines = [f"# gpu-check on {results['device']}", "",
             f"Device-aware tests: {results['tests']['summary']} "
             f"(exit status {results['tests']['returncode']}, "
             f"{results['tests']['seconds']:.0f} s)", ""]
    names = [DETERMINISTIC, BT, EAGER, REPLAYED, CAPTURED, COMPILED, NUMPYRO]
    table, costs = [], []
    nan = float("nan")
    for row in results["steps"]:
        ms = row["ms"]
        table.append([row["width"], row["batch"],
                      *[f"{ms[n]:.2f}" if n in ms else "—" for n in names],
                      *[f"{row.get(f'{label}_over_{peer}', nan):.2f}"
                        for label in ("captured", "compiled")
                        for peer in ("bt", "numpyro", "eager")]])
        for name, cost in row["capture_cost"].items():
            memory = cost["memory_mib"]
            peak = cost["peak_memory_mib"]
            costs.append([row["width"], row["batch"], name, f"{cost['trace_seconds']:.2f}",
                          "—" if memory is None else f"{memory:.1f}",
                          "—" if peak is None else f"{peak:.1f}"])
    lines.append(markdown_table(
        ["width", "batch", *[f"{n} (ms)" for n in names],
         *[f"{label} ÷ {peer}" for label in ("CUDA graph", "compiled")
           for peer in ("bayesian-torch", "NumPyro", "eager")]], table))
    if results["bayesian_torch"] is None:
        lines += ["", BAYESIAN_TORCH_MISSING]
    lines += ["", "The capture's cost: the tracing step's time (trace, compile where "
              "compiled, warm-up, capture, replay) and memory (kept after it, and its peak, "
              "over what the eager first step left).", "",
              markdown_table(["width", "batch", "step", "tracing step (s)", "kept (MiB)",
                              "peak (MiB)"], costs)]
    iblm = ", ".join(f"width {w}: {s:.2f} s" for w, s in results["iblm_seconds"].items())
    lines += ["", f"I-BLM initialization (batch 512): {iblm}.", ""]
    a = results["agreement"][CAPTURED]
    lines += [f"{CAPTURED} vs eager, float32, same seed: largest relative difference "
              f"{a['max_relative_difference']:.2e} (≤ {a['rtol']}: "
              f"{'agree' if a['agree'] else 'DISAGREE'}).", ""]
    c = results["agreement"].get(COMPILED)
    if c is not None and c.get("not_compiled"):
        lines += [f"{COMPILED}: not compiled (see the output above): no agreement figures.", ""]
    elif c is not None:
        lines += [f"{COMPILED} vs eager, float32, {c['draws']} draws each at fixed "
                  f"parameters: mean loss {c['loss_z']:.2f} standard errors apart; gradients' "
                  f"means: |z| {c['mean_abs_z']:.2f} on average (0.80 expected), largest "
                  f"{c['max_abs_z']:.2f} over {c['elements']} elements "
                  f"({'the same distribution' if c['agree'] else 'DIFFERENT'}).", ""]
    lines += [f"torch {host['torch']}, Pyro {host['pyro']}, bayesian-torch "
              f"{results['bayesian_torch'] or 'not installed'}; {results['seconds']:.0f} s in all."]
    return "\n".join(lines)


def main(args):
    start = time.perf_counter()
    set_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"gpu_check: --device {args.device}, but CUDA is not available here")
    # jax beside torch on one GPU: allocate as needed, not three quarters of it at start
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    pyro.settings.set(module_local_params=True)
    pyro.set_rng_seed(0)
    host = host_info()
    batches, widths = ((16,), (32,)) if args.quick else ((128, 1024), (400, 2000))
    tests = run_tests(device, args.quick, None if args.quick else args.out)
    print(f"  tests: {tests['summary']}", flush=True)
    with pyro.validation_enabled(False):
        steps = step_times(device, batches, widths, args)
        iblm = {w: iblm_seconds(device, w, 64 if args.quick else 512) for w in widths}
        agree = agreement(device, widths[0], batches[0], compiled=not args.no_compile)
    results = {"device": str(device), "config": vars(args), "bayesian_torch": BAYESIAN_TORCH,
               "tests": tests, "steps": steps, "iblm_seconds": iblm, "agreement": agree,
               "seconds": time.perf_counter() - start}
    text = report(results, host)
    print(text, flush=True)
    write_report(result_stem(args, "gpu_check"), results, text, host_start=host)
    ok = tests["returncode"] == 0 and all(a["agree"] for a in agree.values())
    return results if ok else sys.exit(1)


if __name__ == "__main__":
    parser = make_parser(__doc__, timing=(5, 10, 3))
    parser.add_argument("--device", default="cuda", help="torch device (default cuda)")
    parser.add_argument("--no-compile", action="store_true",
                        help="leave out CapturedSVI(compile=True)")
    main(parse_args(parser, quick={"rounds": 1, "block": 1, "warmup": 1}))
