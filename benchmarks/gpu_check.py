"""
``make gpu-check``: the library on one accelerator, in one script meant to take
under 8 minutes on one H100: (a) the test suite's device-aware tests (those
taking the ``device`` fixture: ``pytest -m device --device cuda``); (b) the step
times of a Bayesian ReLU MLP 64→w→w→10 on the device: a deterministic network,
bayesian-torch ``LinearReparameterization``, ``AutoKTiedNormal(rank=2)`` +
``local_reparam()`` with fit's optimizer (``GroupedAdam``) through ``SVI``
(eager), through :class:`~pyro_vinit.CapturedSVI` replayed operator by operator
(``cuda_graph=False``) and replayed as a CUDA graph (its default on CUDA), and
NumPyro's ``AutoNormal`` with a ``jax.jit`` step where NumPyro is installed, at
batch 128 and 1024 and widths 400 and 2000, plus the capture's cost (the tracing
step's time and the graph's memory) and I-BLM's initialization time; (c) the
float32 agreement of the captured and eager steps under the same seed (loss and
gradients, largest relative difference over four steps). Last, where time is
left, an exploratory row: the traced graph compiled by ``torch.compile``
(inductor, ``mode="reduce-overhead"``) at width 400, batch 128.

Synthetic data (no download); the timings are interleaved rounds
(``benchmarks/harness.py``), each step ending in a device synchronization.
Prints tables and writes ``gpu_check.json`` / ``.md`` into ``--out``.

Usage::

    python -m benchmarks.gpu_check --device cuda          # what `make gpu-check` runs
    python -m benchmarks.gpu_check --device cpu --quick   # smoke run of every part
"""

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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DETERMINISTIC = "nn (deterministic)"
BT = "bayesian-torch LinearReparameterization"
EAGER = "AutoKTiedNormal(2) + LRT, SVI (eager)"
REPLAYED = "AutoKTiedNormal(2) + LRT, CapturedSVI (op by op)"
CAPTURED = "AutoKTiedNormal(2) + LRT, CapturedSVI (CUDA graph)"
COMPILED = "the traced graph through torch.compile (reduce-overhead)"
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


def run_tests(device, quick):
    """The device-aware tests on ``device``: their exit status and last line."""
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
    return {"command": " ".join(command[1:]), "returncode": done.returncode,
            "summary": lines[-1] if lines else "", "seconds": time.perf_counter() - start}


def _make_svi(kind, sizes, num_data, device):
    model = make_model(sizes, num_data).to(device)
    guide = AutoKTiedNormal(model, rank=2)
    optim, elbo = GroupedAdam({"lr": 1e-3}), TraceMeanField_ELBO()
    if kind == EAGER:
        return SVI(model, guide, optim, elbo)
    return CapturedSVI(model, guide, optim, elbo, cuda_graph=False if kind == REPLAYED else None)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _pyro_steps(sizes, x, y, num_data, device):
    """Our three steps, and the capture's cost: the tracing step's seconds and the
    memory it keeps (CUDA: allocated bytes after it, less before it)."""
    steps, cost = {}, {}
    for name in (EAGER, REPLAYED, CAPTURED):
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
        step()  # the captured steps trace here
        _sync(device)
        if name != EAGER:
            cost[name] = {"trace_seconds": time.perf_counter() - start, "memory_mib": None,
                          "peak_memory_mib": None}
            if device.type == "cuda":  # kept by the graph (its pool), and the peak
                cost[name]["memory_mib"] = (torch.cuda.memory_allocated(device)
                                            - before) / 2**20
                cost[name]["peak_memory_mib"] = (torch.cuda.max_memory_allocated(device)
                                                 - before) / 2**20
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
            ours, cost = _pyro_steps(sizes, x, y, num_data, device)
            configs.update(ours)
            jit = numpyro_step(sizes, batch)
            if jit is not None:
                configs[NUMPYRO] = jit
            configs = {name: _synced(step, device) for name, step in configs.items()}
            t = time_interleaved(configs, rounds=args.rounds, block=args.block,
                                 warmup=args.warmup)
            ms = {name: t.median(name) * 1e3 for name in t.names}
            row = {"width": width, "batch": batch, "ms": ms, "capture_cost": cost}
            if BT in ms:
                row["captured_over_bt"] = t.ratio(CAPTURED, BT).median
            if NUMPYRO in ms:
                row["captured_over_numpyro"] = t.ratio(CAPTURED, NUMPYRO).median
            row["captured_over_eager"] = t.ratio(CAPTURED, EAGER).median
            rows.append(row)
            print(f"  width {width}, batch {batch} done", flush=True)
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


def agreement(device, width, batch, steps=4):
    """Largest relative difference of the captured and eager steps' losses and
    gradients (float32, the same seed)."""
    x, y = _data(batch, device, seed=2)
    recorded = []
    for cls in (SVI, CapturedSVI):  # CapturedSVI: a CUDA graph on CUDA
        pyro.clear_param_store()
        pyro.set_rng_seed(0)
        model = make_model((64, width, width, 10), 10 * batch).to(device)
        guide = AutoKTiedNormal(model, rank=2)
        grads = []
        svi = cls(model, guide, _Recorder(torch.optim.Adam, {"lr": 1e-3}, grads, guide),
                  TraceMeanField_ELBO())
        with LocalReparamMessenger():
            losses = [svi.step(x, y) for _ in range(steps)]
        recorded.append((losses, grads))
    (l_e, g_e), (l_c, g_c) = recorded
    worst = max(abs(a - b) / max(abs(a), 1e-30) for a, b in zip(l_e, l_c))
    for step_e, step_c in zip(g_e, g_c):
        if step_e.keys() != step_c.keys():
            return {"max_relative_difference": float("inf"), "rtol": AGREEMENT_RTOL,
                    "agree": False, "note": "different parameters got gradients"}
        for name, a in step_e.items():
            b = step_c[name]
            worst = max(worst, ((a - b).abs().max() / a.abs().max().clamp_min(1e-30)).item())
    return {"max_relative_difference": worst, "rtol": AGREEMENT_RTOL,
            "agree": worst <= AGREEMENT_RTOL}


def compiled_step(device, width, batch, args):
    """Exploratory: the traced graph through ``torch.compile(mode="reduce-overhead")``
    (inductor's fused kernels in a CUDA graph), timed beside our CUDA-graph step."""
    x, y = _data(batch, device)
    sizes, num_data = (64, width, width, 10), 10 * batch
    ours, _ = _pyro_steps(sizes, x, y, num_data, device)
    svi = _make_svi(REPLAYED, sizes, num_data, device)
    handler = LocalReparamMessenger()
    for _ in range(2):
        with handler:
            svi.step(x, y)
    (capture,) = svi._captures.values()
    compiled = torch.compile(capture.graph, mode="reduce-overhead")
    start = time.perf_counter()
    with torch.no_grad():  # as CapturedSVI calls its graph: nothing for autograd
        for _ in range(3):  # compiling, recording, replaying
            compiled(capture.params, [x, y])
    _sync(device)
    compile_seconds = time.perf_counter() - start
    capture.graph = compiled

    def step():
        with handler:
            svi.step(x, y)

    configs = {name: _synced(f, device) for name, f in
               ((CAPTURED, ours[CAPTURED]), (COMPILED, step))}
    t = time_interleaved(configs, rounds=args.rounds, block=args.block, warmup=args.warmup)
    return {"width": width, "batch": batch, "compile_seconds": compile_seconds,
            "ms": {name: t.median(name) * 1e3 for name in t.names},
            "compiled_over_captured": t.ratio(COMPILED, CAPTURED).median}


def _compiled_lines(compiled):
    if not compiled:
        return []
    if "error" in compiled:
        return [f"torch.compile of the traced graph: failed ({compiled['error']}).", ""]
    ms, ratio = compiled["ms"], compiled["compiled_over_captured"]
    return [f"Exploratory, width {compiled['width']}, batch {compiled['batch']}: the traced "
            f"graph through torch.compile (reduce-overhead) {ms[COMPILED]:.2f} ms a step against "
            f"the CUDA graph's {ms[CAPTURED]:.2f} ms (ratio {ratio:.2f}), "
            f"after {compiled['compile_seconds']:.0f} s of compiling.", ""]


def report(results, host):
    lines = [f"# gpu-check on {results['device']}", "",
             f"Device-aware tests: {results['tests']['summary']} "
             f"(exit status {results['tests']['returncode']}, "
             f"{results['tests']['seconds']:.0f} s)", ""]
    names = [DETERMINISTIC, BT, EAGER, REPLAYED, CAPTURED, NUMPYRO]
    table, costs = [], []
    for row in results["steps"]:
        ms = row["ms"]
        table.append([row["width"], row["batch"],
                      *[f"{ms[n]:.2f}" if n in ms else "—" for n in names],
                      f"{row.get('captured_over_bt', float('nan')):.2f}",
                      f"{row.get('captured_over_numpyro', float('nan')):.2f}",
                      f"{row['captured_over_eager']:.2f}"])
        for name, cost in row["capture_cost"].items():
            memory = cost["memory_mib"]
            peak = cost["peak_memory_mib"]
            costs.append([row["width"], row["batch"], name, f"{cost['trace_seconds']:.2f}",
                          "—" if memory is None else f"{memory:.1f}",
                          "—" if peak is None else f"{peak:.1f}"])
    lines.append(markdown_table(["width", "batch", *[f"{n} (ms)" for n in names],
                                 "CUDA graph ÷ bayesian-torch", "CUDA graph ÷ NumPyro",
                                 "CUDA graph ÷ eager"], table))
    if results["bayesian_torch"] is None:
        lines += ["", BAYESIAN_TORCH_MISSING]
    lines += ["", "The capture's cost: the tracing step's time (trace, warm-up, capture, "
              "replay) and memory (kept after it, and its peak, over what the eager first "
              "step left).", "",
              markdown_table(["width", "batch", "step", "tracing step (s)", "kept (MiB)",
                              "peak (MiB)"], costs)]
    iblm = ", ".join(f"width {w}: {s:.2f} s" for w, s in results["iblm_seconds"].items())
    a = results["agreement"]
    lines += ["", f"I-BLM initialization (batch 512): {iblm}.", "",
              f"Captured vs eager, float32, same seed: largest relative difference "
              f"{a['max_relative_difference']:.2e} (≤ {a['rtol']}: "
              f"{'agree' if a['agree'] else 'DISAGREE'}).", "",
              *_compiled_lines(results.get("compiled")),
              f"torch {host['torch']}, Pyro {host['pyro']}, bayesian-torch "
              f"{results['bayesian_torch'] or 'not installed'}; {results['seconds']:.0f} s in all."]
    return "\n".join(lines)


def main(args):
    start = time.perf_counter()
    set_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"gpu_check: --device {args.device}, but CUDA is not available here")
    pyro.settings.set(module_local_params=True)
    pyro.set_rng_seed(0)
    host = host_info()
    batches, widths = ((16,), (32,)) if args.quick else ((128, 1024), (400, 2000))
    tests = run_tests(device, args.quick)
    print(f"  tests: {tests['summary']}", flush=True)
    with pyro.validation_enabled(False):
        steps = step_times(device, batches, widths, args)
        iblm = {w: iblm_seconds(device, w, 64 if args.quick else 512) for w in widths}
        agree = agreement(device, widths[0], batches[0])
    results = {"device": str(device), "config": vars(args), "bayesian_torch": BAYESIAN_TORCH,
               "tests": tests, "steps": steps, "iblm_seconds": iblm, "agreement": agree,
               "seconds": time.perf_counter() - start}
    text = report(results, host)
    print(text, flush=True)
    write_report(result_stem(args, "gpu_check"), results, text, host_start=host)
    if device.type == "cuda" and not args.quick and not args.no_compile:
        # last, after the report is written: the compile time is not known beforehand
        try:
            with pyro.validation_enabled(False):
                results["compiled"] = compiled_step(device, widths[0], batches[0], args)
        except Exception as error:  # exploratory: record why, keep the check's verdict
            results["compiled"] = {"error": f"{type(error).__name__}: {error}"[:300]}
        results["seconds"] = time.perf_counter() - start
        text = report(results, host)
        print(_compiled_lines(results["compiled"])[0], flush=True)
        write_report(result_stem(args, "gpu_check"), results, text, host_start=host)
    ok = tests["returncode"] == 0 and agree["agree"]
    return results if ok else sys.exit(1)


if __name__ == "__main__":
    parser = make_parser(__doc__, timing=(5, 10, 3))
    parser.add_argument("--device", default="cuda", help="torch device (default cuda)")
    parser.add_argument("--no-compile", action="store_true",
                        help="skip the exploratory torch.compile row")
    main(parse_args(parser, quick={"rounds": 1, "block": 1, "warmup": 1}))
