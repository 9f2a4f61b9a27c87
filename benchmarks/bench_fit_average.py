"""
Does :func:`~pyro_vinit.fit`'s moving average of the parameters
(:class:`~pyro_vinit.ParamAverage`, ``average=0.99``) end better than the
last step's parameters (``average=0``)? A held-out check on the six problems
of ``bench_fit_lr.py`` (its data, networks, steps and evaluation: fit's
recipe at its learning rate 3e-3, the test set evaluated with 32 guide draws
right after I-BLM and every tenth of the run), each seed run once per decay
from the same I-BLM start (the average draws nothing, so the trajectories
are the same).

Per problem and decay: the median over seeds of the best test MNLL over the
evaluations after I-BLM and of the final one; per problem, the seeds on
which the average's best (final) MNLL is below the last step's.

Usage::

    python -m benchmarks.bench_fit_average                # 6 problems, 3 seeds (~8 min)
    python -m benchmarks.bench_fit_average --quick        # smoke run, files under /tmp
    python -m benchmarks.bench_fit_average --problems mnist_cnn --decays 0 0.99 0.995
"""

import os
import statistics
import tempfile

from tqdm.auto import tqdm

from benchmarks import bench_fit_lr
from benchmarks.harness import (
    host_info,
    make_parser,
    markdown_table,
    parse_args,
    result_stem,
    set_threads,
    write_report,
)

LR = 3e-3


def summarize(rows, problems, decays):
    """Per problem: the start's MNLL, per decay the medians of the best and final
    MNLL, and per decay the seeds where it beats decay 0 (best, final)."""
    out = {}
    for name in problems:
        mine = [r for r in rows if r["problem"] == name]
        by = {d: {r["seed"]: r for r in mine if r["average"] == d} for d in decays}
        start = statistics.median(r["curve"]["mnll"][0] for r in mine)
        per = {}
        for d in decays:
            runs = by[d]
            wins = [(runs[s]["best_mnll"] < by[0.0][s]["best_mnll"],
                     runs[s]["final_mnll"] < by[0.0][s]["final_mnll"])
                    for s in runs if 0.0 in by and s in by[0.0]]
            per[d] = {"best": statistics.median(r["best_mnll"] for r in runs.values()),
                      "final": statistics.median(r["final_mnll"] for r in runs.values()),
                      "wins_best": sum(w[0] for w in wins),
                      "wins_final": sum(w[1] for w in wins), "seeds": len(wins)}
        out[name] = {"start": start, "per_decay": per}
    return out


def report(summaries, decays, args):
    headers = ["problem", "after I-BLM"] + [f"best / final, average={d:g}" for d in decays]
    headers += [f"seeds {d:g} < 0 (best, final)" for d in decays if d != 0.0]
    rows = []
    for name, s in summaries.items():
        per = s["per_decay"]
        row = [name, f"{s['start']:.3f}"]
        row += [f"{per[d]['best']:.3f} / {per[d]['final']:.3f}" for d in decays]
        row += [f"{per[d]['wins_best']}, {per[d]['wins_final']} of {per[d]['seeds']}"
                for d in decays if d != 0.0]
        rows.append(row)
    return "\n".join([
        "## fit's moving average of the parameters: test MNLL (medians over seeds "
        f"{args.seeds})", "", markdown_table(headers, rows), "",
        f"fit(steps=S, batch_size={bench_fit_lr.BATCH_SIZE}, lr={LR:g}, capture=False, "
        f"average=decay), AutoKTiedNormal(rank=2), {args.num_samples} guide draws per "
        f"evaluation, {args.threads} thread(s); S per problem as in bench_fit_lr.py"])


def main(args):
    set_threads(args.threads)
    host = host_info()
    decays = sorted(set(args.decays) | {0.0})
    jobs = [(name, d, seed) for name in args.problems for seed in args.seeds for d in decays]
    rows = []
    with tqdm(jobs, desc="fit_average", disable=args.quick) as bar:
        for name, decay, seed in bar:
            bar.set_postfix_str(f"{name} average={decay:g} seed={seed}")
            steps = bench_fit_lr.PROBLEMS[name]["steps"] if args.steps is None else args.steps
            row = bench_fit_lr.run(name, LR, seed, steps, args.num_samples, average=decay)
            rows.append({**row, "average": decay})
    summaries = summarize(rows, args.problems, decays)
    text = report(summaries, decays, args)
    print(text)
    write_report(result_stem(args, "bench_fit_average"),
                 {"config": {**vars(args), "lr": LR, "batch_size": bench_fit_lr.BATCH_SIZE},
                  "summaries": {n: {**s, "per_decay": {f"{d:g}": v for d, v in
                                                       s["per_decay"].items()}}
                                for n, s in summaries.items()},
                  "runs": rows}, text, host_start=host)


if __name__ == "__main__":
    parser = make_parser(__doc__, quick_help="smoke run: one tiny problem, files under /tmp")
    parser.add_argument("--problems", nargs="+", choices=list(bench_fit_lr.PROBLEMS),
                        default=list(bench_fit_lr.PROBLEMS))
    parser.add_argument("--decays", nargs="+", type=float, default=[0.99],
                        help="the decays to compare with 0 (always run)")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=None,
                        help="SVI steps of every problem (default: each problem's own)")
    parser.add_argument("--num-samples", type=int, default=32)
    main(parse_args(parser, quick={
        "problems": ["digits_50"], "seeds": [0], "steps": 20, "num_samples": 4,
        "out": os.path.join(tempfile.gettempdir(), "bench_fit_average_quick")}))
