"""The benchmarks' timing helper (benchmarks/harness.py), on a fake clock."""

import json
import math
import os

import pyro
import pytest
import torch

from benchmarks.harness import (
    RESULTS,
    Ratio,
    Timings,
    fit_exponent,
    fit_fixed_and_rate,
    host_info,
    iblm_options,
    make_parser,
    markdown_table,
    parse_args,
    result_stem,
    schedule,
    set_threads,
    time_interleaved,
    write_json,
    write_report,
)


class FakeClock:
    """A clock that only moves when a configuration's step runs."""

    def __init__(self):
        self.now = 0.0
        self.calls = []

    def __call__(self):
        return self.now

    def step(self, name, seconds):
        def run():
            self.calls.append(name)
            self.now += seconds(len(self.calls)) if callable(seconds) else seconds

        return run


def test_schedule_rotates():
    order = schedule(["a", "b", "c"], rounds=4)
    assert order == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]
    # over as many rounds as configurations, each takes every position once
    for position in range(3):
        assert sorted(r[position] for r in order[:3]) == ["a", "b", "c"]


@pytest.mark.parametrize("names, rounds", [(["a", "b"], 0), (["a", "a"], 2)])
def test_schedule_rejects(names, rounds):
    with pytest.raises(ValueError, match="rounds|distinct"):
        schedule(names, rounds)


def test_time_interleaved_order_and_medians():
    clock = FakeClock()
    configs = {"a": clock.step("a", 2.0), "b": clock.step("b", 0.5)}
    timings = time_interleaved(configs, rounds=3, block=2, warmup=1, clock=clock)
    # warm-up once each, then blocks of 2 in the rotating order of schedule()
    assert clock.calls == ["a", "b"] + ["a"] * 2 + ["b"] * 2 + ["b"] * 2 + ["a"] * 2 \
        + ["a"] * 2 + ["b"] * 2
    assert timings.per_step == {"a": [2.0] * 3, "b": [0.5] * 3}
    assert timings.median_ms("a") == 2000.0
    assert timings.medians_ms() == {"a": 2000.0, "b": 500.0}
    assert timings.ratio("a", "b").median == 4.0
    assert timings.block == {"a": 2, "b": 2}


def test_time_interleaved_per_step_is_block_mean():
    # the step time varies within a block: the block's mean is the round's per-step time
    clock = FakeClock()
    durations = iter([9.0, 1.0, 3.0, 2.0, 6.0, 100.0, 5.0])
    timings = time_interleaved({"a": clock.step("a", lambda _: next(durations))},
                               rounds=3, block=2, warmup=1, clock=clock)
    assert timings.per_step["a"] == [2.0, 4.0, 52.5]
    assert timings.median("a") == 4.0


def test_block_per_configuration_and_block_seconds():
    clock = FakeClock()
    configs = {"slow": clock.step("slow", 0.25), "fast": clock.step("fast", 0.01)}
    timings = time_interleaved(configs, rounds=1, block_seconds=1.0, warmup=2, clock=clock)
    assert timings.block == {"slow": 4, "fast": 100}
    assert clock.calls.count("slow") == 2 + 4 and clock.calls.count("fast") == 2 + 100
    timings = time_interleaved(configs, rounds=2, block={"slow": 1, "fast": 3}, warmup=0,
                               clock=clock)
    assert timings.block == {"slow": 1, "fast": 3}
    assert timings.per_step["fast"] == pytest.approx([0.01, 0.01])
    # a step slower than the block time still runs once per round
    timings = time_interleaved({"slow": configs["slow"]}, rounds=1, block_seconds=0.1,
                               warmup=1, clock=clock)
    assert timings.block == {"slow": 1}


@pytest.mark.parametrize("kwargs, match", [
    ({"block": 2, "block_seconds": 1.0}, "exactly one"),
    ({}, "exactly one"),
    ({"block_seconds": 1.0, "warmup": 0}, "warmup"),
    ({"block": {"a": 2}}, "no number of steps"),
    ({"block": 0}, "positive"),
])
def test_time_interleaved_rejects(kwargs, match):
    clock = FakeClock()
    configs = {"a": clock.step("a", 1.0), "b": clock.step("b", 1.0)}
    with pytest.raises(ValueError, match=match):
        time_interleaved(configs, rounds=1, clock=clock, **kwargs)
    assert clock.calls == []  # nothing ran


def test_ratio_is_per_round():
    # the median of per-round ratios, not the ratio of medians (which is 1 here)
    timings = Timings({"a": [1.0, 2.0, 10.0], "b": [2.0, 1.0, 2.0]})
    ratio = timings.ratio("a", "b")
    assert ratio == Ratio(median=2.0, low=0.5, high=5.0, per_round=(0.5, 2.0, 5.0))
    assert timings.median("a") / timings.median("b") == 1.0
    assert ratio.to_dict() == {"median": 2.0, "low": 0.5, "high": 5.0,
                               "per_round": [0.5, 2.0, 5.0]}
    with pytest.raises(KeyError, match="no configuration 'c'"):
        timings.ratio("a", "c")


def test_combine():
    a = Timings({"x": [1.0, 2.0], "y": [1.0, 1.0]}, {"x": 2, "y": 2})
    b = Timings({"x": [4.0], "y": [2.0]}, {"x": 2, "y": 2})
    both = Timings.combine([a, b])
    assert both.per_step == {"x": [1.0, 2.0, 4.0], "y": [1.0, 1.0, 2.0]}
    assert both.ratio("x", "y").per_round == (1.0, 2.0, 2.0)
    assert both.block == {"x": 2, "y": 2}
    with pytest.raises(ValueError, match="same configurations and blocks"):
        Timings.combine([a, Timings({"x": [1.0], "y": [1.0]}, {"x": 1, "y": 2})])
    with pytest.raises(ValueError, match="same configurations and blocks"):
        Timings.combine([a, Timings({"x": [1.0]}, {"x": 2})])
    with pytest.raises(ValueError, match="at least one"):
        Timings.combine([])


def test_timings_to_dict_and_rejects_ragged():
    timings = Timings({"a": [0.001, 0.003, 0.002]}, {"a": 5})
    d = timings.to_dict()
    assert d["median_ms"] == {"a": 2.0}
    assert d["per_round_ms"]["a"] == pytest.approx([1.0, 3.0, 2.0])
    assert d["block"] == {"a": 5}
    with pytest.raises(ValueError, match="same, positive number of rounds"):
        Timings({"a": [1.0, 2.0], "b": [1.0]})


def test_set_threads(monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    try:
        set_threads(1)
        assert torch.get_num_threads() == 1
        assert os.environ["OMP_NUM_THREADS"] == "1" and os.environ["MKL_NUM_THREADS"] == "1"
        assert host_info()["threads"] == 1
    finally:
        torch.set_num_threads(before)
    with pytest.raises(ValueError, match="positive integer"):
        set_threads(0)


def test_write_json(tmp_path):
    start = host_info()
    assert start["torch"] == torch.__version__ and start["pyro"] == pyro.__version__
    assert len(start["load_average"]) == 3
    path = write_json(str(tmp_path / "sub" / "r.json"), {"x": [1, 2]}, host_start=start)
    with open(path) as f:
        written = json.load(f)
    assert written["x"] == [1, 2]
    assert written["host"]["time_utc"] == start["time_utc"]
    assert written["host"]["threads"] == start["threads"]
    assert len(written["host"]["load_average_end"]) == 3
    with pytest.raises(ValueError, match="host_start"):
        write_json(str(tmp_path / "s.json"), {"host": 1})
    assert not os.path.exists(tmp_path / "s.json")


def test_write_report(tmp_path, capsys):
    stem = str(tmp_path / "out" / "bench_x")
    write_report(stem, {"rows": [3]}, "## table\n| a |", host_start=host_info())
    with open(stem + ".json") as f:
        written = json.load(f)
    assert written["rows"] == [3] and "load_average_end" in written["host"]
    with open(stem + ".md") as f:
        assert f.read() == "## table\n| a |\n"
    assert f"wrote {stem}.json and .md" in capsys.readouterr().out


def test_markdown_table():
    table = markdown_table(["a", "b"], [[1, "x"], [2.5, "y"]])
    assert table.splitlines() == ["| a | b |", "| --- | --- |", "| 1 | x |", "| 2.5 | y |"]
    with pytest.raises(ValueError, match="rows \\[1\\]"):
        markdown_table(["a", "b"], [[1, 2], [3]])


def test_fit_exponent():
    xs = [100, 200, 400, 800]
    assert fit_exponent(xs, [3.0 * x ** 1.7 for x in xs]) == pytest.approx(1.7, rel=1e-12)
    # least squares over all points, not the slope between the ends (which is 1 here):
    # log x = 0, 1, 2, 3 and log y = 0, 0, 0, 3 give 4.5 / 5
    e = math.e
    assert fit_exponent([1.0, e, e ** 2, e ** 3], [1.0, 1.0, 1.0, e ** 3]) == pytest.approx(0.9)
    for xs, ys in [([1.0], [1.0]), ([1.0, 1.0], [1.0, 2.0]), ([1.0, 2.0], [1.0]),
                   ([1.0, 2.0], [0.0, 1.0])]:
        with pytest.raises(ValueError):
            fit_exponent(xs, ys)


def test_fit_fixed_and_rate():
    work = [1e6, 4e6, 1.6e7, 6.4e7]
    a, b = fit_fixed_and_rate(work, [2e-3 + 1e-10 * w for w in work])
    assert a == pytest.approx(2e-3, rel=1e-9) and b == pytest.approx(1e-10, rel=1e-9)
    # relative residuals: a 10 % error at the smallest step weighs as much as one at the
    # largest, so the intercept is not swamped by the large steps' absolute errors
    times = [2e-3 + 1e-10 * w for w in work]
    times[-1] *= 1.1
    a, _ = fit_fixed_and_rate(work, times)
    assert a == pytest.approx(2e-3, rel=0.05)
    # the constrained fits: a time falling with work has no rate, a pure rate no fixed cost
    assert fit_fixed_and_rate([1.0, 2.0, 3.0], [3.0, 2.0, 1.5]) == (
        pytest.approx((1 / 3 + 1 / 2 + 1 / 1.5) / (1 / 9 + 1 / 4 + 1 / 2.25)), 0.0)
    assert fit_fixed_and_rate([1.0, 2.0, 4.0], [1.0, 2.2, 4.0])[0] == 0.0
    for work, times in [([1.0], [1.0]), ([1.0, 1.0], [1.0, 2.0]), ([1.0, 2.0], [1.0, 0.0]),
                        ([-1.0, 2.0], [1.0, 1.0])]:
        with pytest.raises(ValueError):
            fit_fixed_and_rate(work, times)


def test_make_parser_common_options():
    args = parse_args(make_parser("A benchmark.\n\nMore."), [])
    assert vars(args) == {"quick": False, "threads": 1, "out": RESULTS, "tag": ""}
    assert make_parser("A benchmark.\n\nMore.").description == "A benchmark."
    args = parse_args(make_parser(None, threads=False, out=False, tag=False,
                                  timing=(10, 5, 3)), ["--rounds", "4"])
    assert vars(args) == {"quick": False, "rounds": 4, "block": 5, "warmup": 3}


def test_parse_args_quick_overrides_what_was_given():
    parser = make_parser(None, timing=(10, 5, 3))
    parser.add_argument("--sizes", type=int, nargs="+", default=[784, 10])
    quick = {"rounds": 2, "sizes": [20, 3]}
    args = parse_args(parser, ["--rounds", "7"], quick=quick)
    assert args.rounds == 7 and args.sizes == [784, 10]
    args = parse_args(parser, ["--quick", "--rounds", "7", "--block", "4"], quick=quick)
    assert args.rounds == 2 and args.sizes == [20, 3] and args.block == 4
    with pytest.raises(ValueError, match="'size'"):
        parse_args(parser, ["--quick"], quick={"size": 1})


@pytest.mark.parametrize("option", ["--threads", "--rounds", "--block"])
def test_parse_args_rejects_nonpositive(option, capsys):
    with pytest.raises(SystemExit):
        parse_args(make_parser(None, timing=(10, 5, 3)), [option, "0"])
    assert f"{option} must be at least 1, got 0" in capsys.readouterr().err


def test_result_stem():
    args = parse_args(make_parser(None), ["--out", "/r"])
    assert result_stem(args, "bench_x") == os.path.join("/r", "bench_x")
    # a tag is joined with one underscore, given with it or without
    for tag in ("1thread", "_1thread"):
        args = parse_args(make_parser(None), ["--out", "/r", "--tag", tag])
        assert result_stem(args, "bench_x") == os.path.join("/r", "bench_x_1thread")
    # a script without --tag
    args = parse_args(make_parser(None, tag=False), ["--out", "/r"])
    assert result_stem(args, "bench_x") == os.path.join("/r", "bench_x")


def test_iblm_options_merge_the_kl_weight_over_the_json_options():
    assert iblm_options(None, None) is None
    assert iblm_options(None, "{}") is None
    assert iblm_options(0.01, None) == {"kl_weight": 0.01}
    assert iblm_options(0.01, '{"standardize_hidden": false, "kl_weight": 1.0}') == {
        "standardize_hidden": False, "kl_weight": 0.01}
