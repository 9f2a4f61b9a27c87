"""
What the benchmark scripts share: the command line (:func:`make_parser`,
:func:`parse_args`: ``--quick``, ``--threads``, ``--out``, ``--tag`` and the
timing options), the result files (:func:`result_stem`, :func:`write_json`
and :func:`write_report`: results with the host's versions, threads and load
average), and side-by-side timing: several configurations run in
interleaved rounds (each runs a block of steps per round, in an order that
rotates from round to round), so that the load of a shared machine hits all
of them alike; each configuration's time is the median over rounds of its
per-step time, and a ratio of two configurations is computed within each
round, then summarized by its median and range (:func:`time_interleaved`).
Also :func:`markdown_table`, :func:`fit_exponent` and
:func:`fit_fixed_and_rate`.

The scripts import it as ``benchmarks.harness``: they run as modules from
the repository's root, ``python -m benchmarks.bench_floor``.

Usage::

    lrt_step = local_reparam(svi.step)
    configs = {"plain": lambda: svi.step(x, y), "LRT": lambda: lrt_step(x, y)}
    timings = time_interleaved(configs, rounds=3, block=2)
    timings.median_ms("LRT"), timings.ratio("LRT", "plain").median
"""

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import pyro
import torch

__all__ = [
    "RESULTS",
    "Ratio",
    "Timings",
    "fit_exponent",
    "fit_fixed_and_rate",
    "host_info",
    "make_parser",
    "markdown_table",
    "parse_args",
    "result_stem",
    "schedule",
    "set_threads",
    "time_interleaved",
    "write_json",
    "write_report",
]


#: The default folder of the result files.
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def make_parser(doc: Optional[str], *, threads: bool = True, out: bool = True, tag: bool = True,
                timing: Optional[Tuple[int, int, int]] = None,
                quick_help: str = "smoke run, no files") -> argparse.ArgumentParser:
    """
    The options every benchmark script has: ``--quick``, and unless switched off
    ``--threads`` (default 1), ``--out`` (the folder of the result files,
    default :data:`RESULTS`) and ``--tag`` (a suffix of their names); with
    ``timing=(rounds, block, warmup)`` also ``--rounds``, ``--block`` and
    ``--warmup`` of :func:`time_interleaved`, with those defaults.

    :param str doc: The script's docstring; its first paragraph describes it.
    """
    description = None if doc is None else doc.strip().split("\n\n")[0]
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help=quick_help)
    if threads:
        parser.add_argument("--threads", type=int, default=1, help="torch threads")
    if timing is not None:
        rounds, block, warmup = timing
        parser.add_argument("--rounds", type=int, default=rounds, help="interleaved rounds")
        parser.add_argument("--block", type=int, default=block, help="steps per block")
        parser.add_argument("--warmup", type=int, default=warmup,
                            help="untimed steps per configuration")
    if out:
        parser.add_argument("--out", default=RESULTS, help="folder of the result files")
    if tag:
        parser.add_argument("--tag", default="",
                            help="suffix of the result files' names (e.g. 1thread)")
    return parser


def parse_args(parser: argparse.ArgumentParser, argv: Optional[Sequence[str]] = None, *,
               quick: Optional[Mapping[str, Any]] = None) -> argparse.Namespace:
    """
    Parses the command line; with ``--quick``, sets the options in ``quick``
    (the smoke run's sizes), whatever was given. Refuses a ``--threads`` or a
    timing option below 1.

    :param parser: From :func:`make_parser`.
    :param list argv: The arguments (default ``sys.argv[1:]``).
    :param dict quick: The values of ``--quick``, by option name (``dest``).
    """
    args = parser.parse_args(argv)
    for name in ("threads", "rounds", "block"):
        value = getattr(args, name, 1)
        if value < 1:
            parser.error(f"--{name} must be at least 1, got {value}")
    if args.quick:
        for name, value in (quick or {}).items():
            if not hasattr(args, name):
                raise ValueError(f"quick sets {name!r}, which is no option of this script")
            setattr(args, name, value)
    return args


def result_stem(args: argparse.Namespace, name: str) -> str:
    """
    The path of a script's result files without the suffix: ``name`` in
    ``args.out``, with ``_`` and ``args.tag`` appended if a tag was given
    (``--tag 1thread`` and ``--tag _1thread`` both give ``name_1thread``).
    """
    tag = getattr(args, "tag", "")
    if tag:
        name += tag if tag.startswith("_") else "_" + tag
    return os.path.join(args.out, name)


def schedule(names: Sequence[str], rounds: int) -> List[List[str]]:
    """
    The order in which :func:`time_interleaved` runs the configurations: one
    list per round, every configuration once, round ``r`` starting at the
    ``r``-th name (mod their number), so that over the rounds each
    configuration takes every position and none always follows the same one.

    :param list names: The configurations' names.
    :param int rounds: The number of rounds.
    """
    if rounds < 1:
        raise ValueError(f"rounds must be a positive integer, got {rounds!r}")
    if len(set(names)) != len(names):
        raise ValueError(f"configuration names must be distinct, got {list(names)}")
    n = len(names)
    return [[names[(r + i) % n] for i in range(n)] for r in range(rounds)]


@dataclass(frozen=True)
class Ratio:
    """
    The ratio of two configurations' per-step times, computed in each round:
    its median over rounds and its range.
    """

    median: float
    low: float
    high: float
    per_round: Tuple[float, ...]

    def to_dict(self) -> Dict[str, Any]:
        return {"median": self.median, "low": self.low, "high": self.high,
                "per_round": list(self.per_round)}


class Timings:
    """
    Per-step times of configurations measured in interleaved rounds (the
    result of :func:`time_interleaved`).

    :param dict per_step: Seconds per step of each configuration, one entry
        per round (the round's block time divided by the block's steps).
    :param dict block: Steps per block of each configuration.
    """

    def __init__(self, per_step: Mapping[str, Sequence[float]],
                 block: Optional[Mapping[str, int]] = None) -> None:
        lengths = {len(v) for v in per_step.values()}
        if len(lengths) > 1 or 0 in lengths:
            raise ValueError("every configuration needs the same, positive number of rounds, "
                             f"got {({k: len(v) for k, v in per_step.items()})}")
        self.per_step = {name: list(v) for name, v in per_step.items()}
        self.block = dict(block) if block is not None else {name: 1 for name in per_step}

    @classmethod
    def combine(cls, runs: Sequence["Timings"]) -> "Timings":
        """
        The rounds of several measurements of the same configurations (e.g.
        repeats with fresh models) as one :class:`Timings`.

        :param list runs: Timings of the same configurations and blocks.
        """
        if not runs:
            raise ValueError("combine needs at least one Timings")
        first = runs[0]
        for run in runs[1:]:
            if run.names != first.names or run.block != first.block:
                raise ValueError("combine needs the same configurations and blocks in every "
                                 f"run, got {first.block} and {run.block}")
        return cls({name: [t for run in runs for t in run.per_step[name]] for name in first.names},
                   first.block)

    @property
    def names(self) -> List[str]:
        return list(self.per_step)

    def median(self, name: str) -> float:
        """The median over rounds of ``name``'s per-step time (seconds)."""
        return statistics.median(self._times(name))

    def median_ms(self, name: str) -> float:
        """The median over rounds of ``name``'s per-step time (milliseconds)."""
        return 1e3 * self.median(name)

    def medians_ms(self) -> Dict[str, float]:
        """:meth:`median_ms` of every configuration."""
        return {name: self.median_ms(name) for name in self.per_step}

    def ratio(self, numerator: str, denominator: str) -> Ratio:
        """
        ``numerator``'s per-step time over ``denominator``'s, in each round (so
        that both were measured under the same load), summarized by the median
        and range over rounds.
        """
        per_round = tuple(a / b for a, b in zip(self._times(numerator),
                                                 self._times(denominator)))
        return Ratio(statistics.median(per_round), min(per_round), max(per_round), per_round)

    def to_dict(self) -> Dict[str, Any]:
        """Medians and per-round times in milliseconds, and the blocks, for JSON."""
        return {
            "median_ms": self.medians_ms(),
            "per_round_ms": {k: [1e3 * t for t in v] for k, v in self.per_step.items()},
            "block": self.block,
        }

    def _times(self, name: str) -> List[float]:
        if name not in self.per_step:
            raise KeyError(f"no configuration {name!r} was timed; timed: {self.names}")
        return self.per_step[name]


def time_interleaved(
    configs: Mapping[str, Callable[[], object]],
    *,
    rounds: int,
    block: Union[int, Mapping[str, int], None] = None,
    block_seconds: Optional[float] = None,
    warmup: int = 3,
    clock: Callable[[], float] = time.perf_counter,
) -> Timings:
    """
    Times each configuration (a callable running one step) in interleaved
    rounds, in the order of :func:`schedule`: in each round every
    configuration runs a block of steps, timed as a whole.

    :param dict configs: One step of each configuration, by name.
    :param int rounds: Rounds of blocks.
    :param block: Steps per block: one number for all, one per
        configuration, or None with ``block_seconds``.
    :param float block_seconds: Instead of ``block``: each configuration's
        block is as many steps as fit in this time, judged from its last
        warm-up step (at least one).
    :param int warmup: Untimed steps of each configuration before the first
        round (at least one with ``block_seconds``).
    :param callable clock: The clock, in seconds.
    """
    names = list(configs)
    if (block is None) == (block_seconds is None):
        raise ValueError("give exactly one of block (steps per block) and block_seconds "
                         f"(time per block), got block={block!r}, "
                         f"block_seconds={block_seconds!r}")
    if warmup < (1 if block_seconds is not None else 0):
        raise ValueError(f"warmup must be >= 1 with block_seconds (the block size is judged "
                         f"from the last warm-up step), got {warmup!r}")
    order = schedule(names, rounds)
    blocks: Dict[str, int] = {}
    if isinstance(block, int):
        blocks = {name: block for name in names}
    elif block is not None:
        missing = set(names) - set(block)
        if missing:
            raise ValueError(f"block gives no number of steps for {sorted(missing)}")
        blocks = {name: block[name] for name in names}
    bad = {name: b for name, b in blocks.items() if not isinstance(b, int) or b < 1}
    if bad:
        raise ValueError(f"blocks must be positive integers, got {bad}")
    last_warmup = {}
    for name, fn in configs.items():
        for _ in range(warmup):
            start = clock()
            fn()
            last_warmup[name] = clock() - start
    if block_seconds is not None:
        blocks = {name: max(1, round(block_seconds / max(last_warmup[name], 1e-9)))
                  for name in names}
    per_step: Dict[str, List[float]] = {name: [] for name in names}
    for round_names in order:
        for name in round_names:
            fn, steps = configs[name], blocks[name]
            start = clock()
            for _ in range(steps):
                fn()
            per_step[name].append((clock() - start) / steps)
    return Timings(per_step, blocks)


def set_threads(threads: int) -> None:
    """
    Sets PyTorch's intra-op threads, and ``OMP_NUM_THREADS`` / ``MKL_NUM_THREADS``
    for any child process.

    :param int threads: A positive number of threads.
    """
    if not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads must be a positive integer, got {threads!r}")
    torch.set_num_threads(threads)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(threads)


def host_info() -> Dict[str, Any]:
    """
    What a timing depends on besides the code: the versions of Python, torch
    and Pyro, the platform, the cores, PyTorch's threads, the load average
    (1, 5, 15 minutes) and the time (UTC).
    """
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "pyro": pyro.__version__,
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "load_average": None if load is None else [round(v, 2) for v in load],
        "time_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def write_json(path: str, results: Mapping[str, Any],
               host_start: Optional[Mapping[str, Any]] = None) -> str:
    """
    Writes ``results`` to ``path`` as JSON (creating its folder), with a
    ``"host"`` entry: ``host_start`` (the :func:`host_info` taken when the
    run began) or the host now, and the load average at the end.

    :param str path: The file to write.
    :param dict results: JSON-serializable results (no ``"host"`` key).
    :param dict host_start: :func:`host_info` at the start of the run.
    :return: ``path``.
    """
    if "host" in results:
        raise ValueError("results already have a 'host' entry; write_json adds it: "
                         "pass the run's start as host_start instead")
    host = dict(host_start if host_start is not None else host_info())
    end = host_info()
    host["load_average_end"] = end["load_average"]
    host["time_utc_end"] = end["time_utc"]
    folder = os.path.dirname(path)
    if folder:
        os.makedirs(folder, exist_ok=True)
    with open(path, "w") as f:
        json.dump({**results, "host": host}, f, indent=2)
        f.write("\n")
    return path


def write_report(stem: str, results: Mapping[str, Any], text: str,
                 host_start: Optional[Mapping[str, Any]] = None) -> None:
    """
    Writes a benchmark's results to ``stem + ".json"`` (:func:`write_json`)
    and its printed report ``text`` to ``stem + ".md"``, and says so.

    :param str stem: The path of both files, without the suffix.
    :param dict results: As for :func:`write_json`.
    :param str text: The report, Markdown.
    :param dict host_start: :func:`host_info` at the start of the run.
    """
    write_json(stem + ".json", results, host_start=host_start)
    with open(stem + ".md", "w") as f:
        f.write(text + "\n")
    print(f"\nwrote {stem}.json and .md")


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """
    A Markdown table; cells are written with ``str``.

    :param list headers: The column names.
    :param list rows: The rows, each as long as ``headers``.
    """
    bad = [i for i, row in enumerate(rows) if len(row) != len(headers)]
    if bad:
        raise ValueError(f"rows {bad} do not have {len(headers)} cells (one per header)")
    lines = ["| " + " | ".join(headers) + " |", "|" + " --- |" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def iblm_options(kl_weight: Optional[float], options: Optional[str]) -> Optional[Dict[str, Any]]:
    """fit's ``init_options`` from a benchmark's ``--iblm-kl-weight`` and
    ``--iblm-options`` (a JSON object): the options given, None if none."""
    merged: Dict[str, Any] = dict(json.loads(options or "{}"))
    if kl_weight is not None:
        merged["kl_weight"] = kl_weight
    return merged or None


def fit_exponent(xs: Sequence[float], ys: Sequence[float]) -> float:
    """
    The exponent ``p`` of ``y ∝ x^p``: the least-squares slope of
    ``log y`` against ``log x``.

    :param list xs: Positive abscissae, at least two distinct.
    :param list ys: Positive values, one per abscissa.
    """
    if len(xs) != len(ys) or len(set(xs)) < 2:
        raise ValueError(f"need as many values as abscissae, at least two abscissae distinct; "
                         f"got {len(xs)} abscissae ({len(set(xs))} distinct), {len(ys)} values")
    if min(xs) <= 0 or min(ys) <= 0:
        raise ValueError("a log-log fit needs positive abscissae and values")
    lx, ly = [math.log(v) for v in xs], [math.log(v) for v in ys]
    mx, my = statistics.fmean(lx), statistics.fmean(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sum((a - mx) ** 2 for a in lx)


def fit_fixed_and_rate(work: Sequence[float], seconds: Sequence[float]) -> Tuple[float, float]:
    r"""
    The fixed cost :math:`a` and the cost per unit of work :math:`b` of

    .. math:: t \approx a + b\,w,

    by least squares on relative residuals :math:`(a + b w_i - t_i) / t_i`
    (so that small and large steps count alike), with :math:`a, b \ge 0`:
    if the unconstrained fit makes one negative, it is zero and the other is
    refitted alone. For a training step, ``a`` is the per-step overhead that
    does not grow with the arithmetic, and ``a / b`` the work at which the
    arithmetic overtakes it.

    :param list work: The work of each measurement (e.g. FLOPs per step), >= 0.
    :param list seconds: The time of each measurement, > 0.
    :return: ``(a, b)``.
    """
    if len(work) != len(seconds) or len(set(work)) < 2:
        raise ValueError(f"need as many times as works, at least two works distinct; got "
                         f"{len(work)} works ({len(set(work))} distinct), {len(seconds)} times")
    if min(work) < 0 or min(seconds) <= 0:
        raise ValueError("work must be >= 0 and times > 0")
    # rows (1/t, w/t) against the target 1: the normal equations of a 2-parameter fit
    u = [1.0 / t for t in seconds]
    v = [w / t for w, t in zip(work, seconds)]
    suu, suv, svv = sum(x * x for x in u), sum(x * y for x, y in zip(u, v)), sum(y * y for y in v)
    su, sv = sum(u), sum(v)
    det = suu * svv - suv * suv
    a = (su * svv - sv * suv) / det
    b = (sv * suu - su * suv) / det
    if a < 0:
        return 0.0, sv / svv
    if b < 0:
        return su / suu, 0.0
    return a, b
