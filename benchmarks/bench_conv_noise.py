"""
Per-example noise on convolutions: the step of :func:`~pyro_vinit.fit` on
the race's digits CNN (``bench_time_to_quality``), with local
reparameterization on every layer (``local_reparam()``) against fit's
default, ``local_reparam(conv=False)`` (the convolutions on their weight
sample, the linear layer with per-example noise), and the same for
``AutoRadialNormal`` under ``flipout()`` and ``flipout(conv=False)``, side
by side with bayesian-torch and IVON where installed.

Each configuration is the race's runner after its set-up (I-BLM, then
:class:`~pyro_vinit.CapturedSVI` with fit's optimizer and ELBO, minibatches
of 128), timed in interleaved rounds (:func:`benchmarks.harness.time_interleaved`)
on one thread. Prints the step times and the ratios, and writes JSON.
What the choice does to time-to-quality is the race's (run it with
``--problems digits_cnn``).

Usage::

    python -m benchmarks.bench_conv_noise            # 10 rounds of 50 steps
    python -m benchmarks.bench_conv_noise --quick    # smoke run, no files
"""

import dataclasses
import warnings

import pyro

from benchmarks import _peers
from benchmarks.bench_time_to_quality import BATCH_SIZE, PROBLEMS, Ours
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
from pyro_vinit import AutoRadialNormal
from pyro_vinit.poutine import flipout, local_reparam

LRT_ALL = "fit's step, LRT on every layer (local_reparam())"
FIT = "fit's step, convolutions on their weight sample (local_reparam(conv=False))"
RADIAL_ALL = "AutoRadialNormal, Flipout on every layer (flipout())"
RADIAL_FIT = "AutoRadialNormal, fit's step (flipout(conv=False))"
BT = "bayesian-torch Conv2d/LinearReparameterization"
IVON = "IVON"


def runners(x, y):
    """Each configuration's runner, set up (its captured step traced by the warm-up)."""
    made = {}
    for name, weight_noise, make_guide in ((LRT_ALL, local_reparam, None), (FIT, None, None),
                                           (RADIAL_ALL, flipout, AutoRadialNormal),
                                           (RADIAL_FIT, None, AutoRadialNormal)):
        pyro.set_rng_seed(0)
        runner = Ours(PROBLEMS["digits_cnn"]["net"], x, y, BATCH_SIZE, use_fit=True,
                      make_guide=make_guide)
        runner.setup()
        if weight_noise is not None:
            runner.config = dataclasses.replace(runner.config, weight_noise=weight_noise)
        made[name] = runner
    if _peers.BAYESIAN_TORCH is not None:
        made[BT] = _peers.BayesianTorch(PROBLEMS["digits_cnn"]["net"], x, y, BATCH_SIZE)
        made[BT].setup()
    if _peers.IVON is not None:
        made[IVON] = _peers.IVONRunner(PROBLEMS["digits_cnn"]["net"], x, y, BATCH_SIZE)
        made[IVON].setup()
    return made


def main(argv=None):
    parser = make_parser(__doc__, timing=(10, 50, 10))
    args = parse_args(parser, argv, quick={"rounds": 2, "block": 3, "warmup": 3})
    set_threads(args.threads)
    host = host_info()
    x, y = PROBLEMS["digits_cnn"]["data"]()[:2]
    made = runners(x, y)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fit's handlers name nothing here; IVON's own
        timings = time_interleaved({name: r.step for name, r in made.items()},
                                   rounds=args.rounds, block=args.block, warmup=args.warmup)
    rows = [[name, f"{timings.median_ms(name):.2f}"] for name in made]
    ratios = {f"{LRT_ALL} ÷ {FIT}": timings.ratio(LRT_ALL, FIT),
              f"{RADIAL_ALL} ÷ {RADIAL_FIT}": timings.ratio(RADIAL_ALL, RADIAL_FIT)}
    for peer in (BT, IVON):
        if peer in made:
            ratios[f"{FIT} ÷ {peer}"] = timings.ratio(FIT, peer)
            ratios[f"{LRT_ALL} ÷ {peer}"] = timings.ratio(LRT_ALL, peer)
    text = "\n".join([
        f"## digits CNN, batch {BATCH_SIZE}, {args.threads} thread(s): step time "
        f"(median of {args.rounds} rounds of {args.block} steps)", "",
        markdown_table(["configuration", "ms per step"], rows), "",
        markdown_table(["ratio", "median", "range"],
                       [[k, f"{r.median:.2f}", f"{r.low:.2f}–{r.high:.2f}"]
                        for k, r in ratios.items()]), "",
        f"load average at the start {host['load_average']}",
    ])
    print(text)
    if args.quick:
        return
    results = {
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "step_ms": timings.medians_ms(),
        "timings": timings.to_dict(),
        "ratios": {k: r.to_dict() for k, r in ratios.items()},
        "versions": {"bayesian-torch": _peers.BAYESIAN_TORCH, "ivon-opt": _peers.IVON},
    }
    write_report(result_stem(args, "bench_conv_noise"), results, text, host_start=host)


if __name__ == "__main__":
    main()
