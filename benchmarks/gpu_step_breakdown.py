"""
Where the time of a CUDA-graph step of :class:`~pyro_vinit.CapturedSVI` goes
(``AutoKTiedNormal(2)`` + ``local_reparam()``, fit's ``GroupedAdam``, MLP
64→w→w→10): the whole step, the graph's replay alone, the optimizer's step
alone and the host's bookkeeping between them (the rest), each timed over
``--steps`` steps ending in a device synchronization, at the widths and
batches of ``make gpu-check``. Prints a table and writes JSON.

Usage::

    python -m benchmarks.gpu_step_breakdown --device cuda
    python -m benchmarks.gpu_step_breakdown --device cpu --quick   # smoke run, no files
"""

import time

import pyro
import torch
from pyro.infer import TraceMeanField_ELBO

from benchmarks._steps import make_model
from benchmarks.harness import (
    host_info,
    make_parser,
    markdown_table,
    parse_args,
    result_stem,
    set_threads,
    write_report,
)
from pyro_vinit import AutoKTiedNormal, CapturedSVI, GroupedAdam, LocalReparamMessenger


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _seconds(fn, steps, device):
    fn()
    _sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    _sync(device)
    return (time.perf_counter() - start) / steps


def breakdown(device, width, batch, steps):
    x = torch.randn(batch, 64, device=device)
    y = torch.randint(0, 10, (batch,), device=device)
    model = make_model((64, width, width, 10), 10 * batch).to(device)
    optim = GroupedAdam({"lr": 1e-3})
    svi = CapturedSVI(model, AutoKTiedNormal(model, rank=2), optim, TraceMeanField_ELBO())
    handler = LocalReparamMessenger()

    def step():
        with handler:
            svi.step(x, y)

    for _ in range(3):
        step()
    (capture,) = svi._captures.values()
    graph = capture.graph
    params = capture.params

    def replay():
        graph(params, [x, y])

    _, grads = graph(params, [x, y])
    used = [p for p, g in zip(params, grads) if g is not None]

    def optimizer():
        for p, g in zip(params, grads):
            if g is not None:
                p.grad = g
        optim(used)

    times = {"step": _seconds(step, steps, device), "replay": _seconds(replay, steps, device),
             "optimizer": _seconds(optimizer, steps, device)}
    for p in params:
        p.grad = None
    times["rest"] = times["step"] - times["replay"] - times["optimizer"]
    return {"width": width, "batch": batch, "cuda_graph": type(graph).__name__,
            "ms": {k: v * 1e3 for k, v in times.items()}}


def main(args):
    set_threads(args.threads)
    device = torch.device(args.device)
    pyro.settings.set(module_local_params=True)
    pyro.set_rng_seed(0)
    host = host_info()
    sizes = [(400, 16)] if args.quick else [(400, 128), (400, 1024), (2000, 128), (2000, 1024)]
    with pyro.validation_enabled(False):
        rows = [breakdown(device, w, b, 5 if args.quick else args.steps) for w, b in sizes]
    table = [[r["width"], r["batch"], r["cuda_graph"],
              *(f"{r['ms'][k]:.3f}" for k in ("step", "replay", "optimizer", "rest"))]
             for r in rows]
    text = "\n".join([f"# CapturedSVI step on {device}: where the time goes", "",
                      markdown_table(["width", "batch", "replay as", "step (ms)", "replay (ms)",
                                      "optimizer (ms)", "rest (ms)"], table)])
    print(text)
    if args.quick:
        return
    write_report(result_stem(args, "gpu_step_breakdown"),
                 {"device": str(device), "rows": rows, "config": vars(args)}, text,
                 host_start=host)


if __name__ == "__main__":
    parser = make_parser(__doc__)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="torch device (default cuda where there is one)")
    parser.add_argument("--steps", type=int, default=200, help="steps per timing")
    main(parse_args(parser, quick={"steps": 5}))
