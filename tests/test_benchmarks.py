"""Smoke runs (``--quick``) of the benchmark scripts behind the performance page, and
the exactness of the plain-PyTorch twin that bench_floor times."""

import ast
import glob
import importlib
import json
import os
import subprocess
import sys

import pyro
import pytest
import torch
from pyro.infer import TraceMeanField_ELBO

from benchmarks import _steps
from pyro_vinit import AutoKTiedNormal, LocalReparamMessenger
from pyro_vinit._pyro_compat import unconstrained_param

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# script: text its report must contain
SCRIPTS = {
    "bench_targets.py": ["AutoKTiedNormal(2) + LRT ÷ bayesian-torch LinearReparameterization",
                         "batch 1000, validation off", "batch 128, validation on",
                         "AutoRadialNormal ÷ AutoNormal", "native loop", "load average"],
    "bench_lrt_step.py": ["k-tied LRT low-rank", "mean-field Flipout", "low-rank ÷ dense"],
    "bench_vectorized_predictive.py": ["sequential ÷ parallel", "32 rows", "LRT"],
    "bench_gradient_variance.py": ["| 1 |", "LRT / ordinary", "no weight noise"],
    "bench_floor.py": ["pure PyTorch, our estimator", "minimal Pyro", "tiny 8-8-8-3, batch 2",
                       "64-400-400-10, batch 1000", "load average"],
    "bench_fit_recipe.py": ["digits_mlp", "λ=0.1 seed 0", " 0:", " 5:"],
    "bench_captured.py": ["CapturedSVI ÷ bayesian-torch LinearReparameterization, batch 128",
                          "CapturedSVI ÷ AutoKTiedNormal(2) + LRT, SVI", "Tracing step",
                          "load average"],
    "bench_fit_capture.py": ["digits_mlp", "break-even steps", "load average",
                             "extra fixed s, per-op fake modes"],
    "bench_fit_compile.py": ["| digits_cnn | 128 |", "fit compiles from", "| capture=None |",
                             "None ÷ True"],
    "gpu_step_breakdown.py": ["where the time goes", "optimizer (ms)", "| 400 | 16 |"],
    "bench_fit_warmup.py": ["digits_cnn: test error / MNLL", "| 50 |", "warm-up steps"],
    "bench_fit_kl_regression.py": ["| diabetes | 0.01 |", "| toy | 1 |", "noise scale at the end",
                                   "| friedman1_2000 | 2000 | 10 | 3151 |", "mean excess (nats)",
                                   "| problems and probes | 0.01 |", "| hetero_sine_10d | 0.01 |"],
    "bench_regional_compile.py": ["inductor on the elementwise regions ÷ fit's step, "
                                  "CapturedSVI (replay) | 32", "where the time goes",
                                  "| torch.float64 | fit's step, CapturedSVI (replay) | 0.0e+00 "
                                  "| 0.0e+00 |", "load average",
                                  "CapturedSVI(compile=True) ÷ fit's step, CapturedSVI (replay) "
                                  "| 32", "| torch.float64 | fit's step, CapturedSVI(compile=True) "
                                  "|"],
    "bench_conv_noise.py": ["digits CNN, batch 128", "LRT on every layer (local_reparam()) ÷",
                            "load average"],
    "bench_fit_average.py": ["| digits_50 |", "best / final, average=0 |",
                             "seeds 0.99 < 0 (best, final)", "of 1 |"],
    # digits_50: N, W, N/W, the rule's lr and its grid neighbour
    "bench_fit_lr.py": ["| digits_50 | 1438 | 3760 | 0.382 | 9.28e-03 | 0.008 |",
                        "seeds rule < 3e-3", "(best after I-BLM / final)",
                        "bench_fit_lr_quick/bench_fit_lr.json"],
}


def _run(args, tmp_path, pythonpath=ROOT, **env):
    # TMPDIR: a smoke run's files (the scripts' --quick writes under the temporary
    # folder) in this test's own, not in one that another xdist worker's run overwrites
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=900,
        env={**os.environ, "MPLBACKEND": "Agg", "OMP_NUM_THREADS": "1",
             "PYTHONPATH": pythonpath, "TMPDIR": str(tmp_path), **env},
    )


BENCHMARK_FILES = sorted(glob.glob(os.path.join(ROOT, "benchmarks", "**", "*.py"), recursive=True))


def _path_edits_and_bare_imports(source):
    """``sys.path`` touched, and imports of this folder's modules by bare name
    (``import _steps``), which only work with the script's folder on the path."""
    local = {os.path.splitext(os.path.basename(p))[0] for p in BENCHMARK_FILES}
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr == "path" \
                and isinstance(node.value, ast.Name) and node.value.id == "sys":
            found.append((node.lineno, "sys.path"))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name in local]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module in local:
            found.append((node.lineno, node.module))
    return sorted(found)


def test_benchmarks_import_as_a_package():
    # every benchmark runs as `python -m benchmarks.<name>` from the root and imports its
    # helpers as `benchmarks.<module>`: no path edits
    wrong = {}
    for path in BENCHMARK_FILES:
        with open(path) as f:
            found = _path_edits_and_bare_imports(f.read())
        if found:
            wrong[os.path.relpath(path, ROOT)] = found
    assert not wrong, wrong
    assert _path_edits_and_bare_imports(
        "import sys\nsys.path.insert(0, '.')\nimport _steps\nfrom harness import x\n"
        "from benchmarks import _steps\n") == [(2, "sys.path"), (3, "_steps"), (4, "harness")]


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_script_quick(script, tmp_path):
    result = _run(["-m", f"benchmarks.{script[:-3]}", "--quick"], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    for text in SCRIPTS[script]:
        assert text in result.stdout, (text, result.stdout[-3000:])


def test_kl_regression_summary_in_nats():
    # bench_fit_kl_regression's per-weight summary on made-up runs: medians over seeds,
    # the excess over each problem's best weight (a difference: MNLL can be negative),
    # and the runs that end above their start
    from benchmarks.bench_fit_kl_regression import per_problem, per_weight, summarize

    def row(problem, lam, seed, start, last):
        return {"problem": problem, "kl_weight": lam, "seed": seed, "start_mnll": start,
                "best_mnll": min(start, last) - 0.05, "last_mnll": last, "last_rmse": 1.0,
                "noise_scale": 0.5, "iblm_noise": 0.4 + seed, "num_data": 100,
                "input_dim": 2, "num_weights": 50}

    rows = [row("a", 0.1, 0, 0.0, -0.5), row("a", 0.1, 1, 0.0, -0.3), row("a", 0.1, 2, 0.0, 9.0),
            row("a", 1.0, 0, 0.0, -0.2), row("a", 1.0, 1, 0.0, -0.2), row("a", 1.0, 2, 0.0, 0.1),
            row("b", 0.1, 0, 1.0, 3.0), row("b", 1.0, 0, 1.0, 0.96)]
    summary = summarize(rows)
    assert summary["a", 0.1]["last_mnll"] == -0.3 and summary["a", 0.1]["runs_worse"] == 1
    assert summary["a", 0.1]["last_mnll_range"] == pytest.approx(9.5)
    problems = per_problem(rows, summary)
    assert problems["a"]["best_kl_weight"] == 0.1 and problems["b"]["best_kl_weight"] == 1.0
    assert problems["a"]["excess"] == pytest.approx({0.1: 0.0, 1.0: 0.1})
    assert problems["b"]["excess"] == pytest.approx({0.1: 2.04, 1.0: 0.0})
    assert problems["a"]["iblm_noise"] == 1.4
    weights = per_weight(problems, summary, ["a", "b"])
    assert weights[0.1]["mean_excess"] == pytest.approx(1.02)
    assert (weights[0.1]["worst_excess"], weights[0.1]["worst_problem"]) == (
        pytest.approx(2.04), "b")
    assert weights[0.1]["within"] == 1 and weights[1.0]["within"] == 1  # a's 0.1 > 0.05
    assert weights[0.1]["ends_worse"] == ["b"] and weights[1.0]["ends_worse"] == []
    assert (weights[0.1]["runs_worse"], weights[0.1]["runs"]) == (2, 4)
    only_a = per_weight(problems, summary, ["a"])[1.0]
    assert only_a["mean_excess"] == pytest.approx(0.1) and only_a["within"] == 0


def test_fit_lr_from_json_rewrites_the_same_report(tmp_path):
    # the tables remade from a saved run's JSON are the run's own (its files in tmp_path,
    # not where test_script_quick's run of the script on another xdist worker writes)
    result = _run(["-m", "benchmarks.bench_fit_lr", "--quick"], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    saved = result.stdout[:result.stdout.index("wrote ")]
    tables = saved[saved.index("## Per problem and"):]
    again = _run(["-m", "benchmarks.bench_fit_lr", "--from-json",
                  os.path.join(result.stdout.split("wrote ")[1].split(".json")[0] + ".json"),
                  "--out", str(tmp_path)], tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.startswith(tables), (tables, again.stdout)
    with open(tmp_path / "bench_fit_lr.md") as f:
        assert f.read() == tables.rstrip("\n") + "\n"


def test_gpu_check_runs_on_the_cpu(tmp_path):
    # every part of `make gpu-check` (tests, step times, I-BLM, agreement) on the CPU
    result = _run(["-m", "benchmarks.gpu_check", "--device", "cpu", "--quick",
                   "--out", str(tmp_path)], tmp_path)
    assert result.returncode == 0, (result.stdout[-3000:], result.stderr[-3000:])
    with open(tmp_path / "gpu_check.json") as f:
        found = json.load(f)
    assert found["tests"]["returncode"] == 0 and " passed" in found["tests"]["summary"]
    compiled = "AutoKTiedNormal(2) + LRT, CapturedSVI(compile=True) (inductor, CUDA graph)"
    captured = "AutoKTiedNormal(2) + LRT, CapturedSVI (CUDA graph)"
    assert set(found["agreement"]) == {captured, compiled}
    assert all(a["agree"] for a in found["agreement"].values())
    (row,) = found["steps"]
    ours = {"AutoKTiedNormal(2) + LRT, SVI (eager)",
            "AutoKTiedNormal(2) + LRT, CapturedSVI (op by op)", captured, compiled}
    assert ours <= set(row["ms"])
    assert set(row["capture_cost"]) == ours - {"AutoKTiedNormal(2) + LRT, SVI (eager)"}
    assert "I-BLM initialization" in result.stdout


def test_targets_without_bayesian_torch(tmp_path):
    # a bayesian_torch package that fails to import stands for one not installed
    fake = tmp_path / "bayesian_torch"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('not installed (test)')\n")
    result = _run(["-m", "benchmarks.bench_targets", "--quick"], tmp_path,
                  pythonpath=os.pathsep.join([str(tmp_path), ROOT]))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "bayesian-torch is not installed: its rows are skipped" in result.stdout
    assert "pip install --no-deps bayesian-torch==0.5.0" in result.stdout
    bt_rows = [line for line in result.stdout.splitlines() if "÷ bayesian-torch" in line]
    assert len(bt_rows) == 4 and all("skipped" in line for line in bt_rows), bt_rows
    assert "AutoKTiedNormal(2) ÷ AutoNormal" in result.stdout


def test_scaling_quick(tmp_path):
    result = _run(["-m", "benchmarks.bench_scaling", "--quick", "--out", str(tmp_path)], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    with open(tmp_path / "bench_scaling.json") as f:
        results = json.load(f)
    assert results["host"]["threads"] == 1 and "load_average_end" in results["host"]
    for axis, grid in (("width", "widths"), ("batch", "batches")):
        points = results["steps"][axis]["points"]
        assert [p[axis] for p in points] == results["config"][grid]
        fits = results["steps"][axis]["fits"]
        assert {"nn (deterministic)", "AutoNormal", "AutoKTiedNormal(2) + LRT",
                "AutoRadialNormal + Flipout"} <= set(fits)
        for name, fit in fits.items():
            assert fit["fixed_ms"] >= 0 and len(fit["gpu_model_ms"]) == len(points), name
        for point in points:
            for name, row in point["configs"].items():
                # a fresh process per point: its own start, a peak above it
                assert row["peak_mb"] >= row["start_mb"] > 0, (name, row)
                assert row["ms"] > 0 and row["ops"] > 0 and row["flops"] > 0, (name, row)
        # every configuration and point in its own process forked from one clean server:
        # they all start from the same resident memory (in one process they would not)
        starts = {row["start_mb"] for point in points for row in point["configs"].values()}
        assert max(starts) - min(starts) < 1.0, starts
        # the counted matrix-product FLOPs grow with the grid
        flops = [p["configs"]["nn (deterministic)"]["flops"] for p in points]
        assert flops == sorted(flops) and flops[0] < flops[-1]
    for axis in ("width", "rows"):
        rows = results["iblm"][axis]["rows"]
        assert all(r["peak_mb"] >= r["setup_peak_mb"] > 0 and r["seconds"] > 0 for r in rows)
    pytest.importorskip("matplotlib")
    assert {"scaling_steps.png", "scaling_iblm.png"} <= set(os.listdir(tmp_path))


@pytest.mark.parametrize("sizes", [(6, 5, 4, 3), (64, 40, 30, 10)], ids=["dense", "low-rank"])
def test_pure_estimator_equals_pyro_step(sizes):
    # bench_floor's "pure PyTorch" step must be the Pyro step's arithmetic, or its floor
    # means nothing: same parameters, same seed, same loss and gradients.
    steps = _steps
    pyro.set_rng_seed(0)
    x = torch.randn(16, sizes[0], dtype=torch.float64)
    y = torch.randint(0, sizes[-1], (16,))
    model = steps.make_model(sizes, 500).double()
    guide = AutoKTiedNormal(model, rank=2)
    loss_fn = TraceMeanField_ELBO()(model, guide)
    with LocalReparamMessenger():
        loss_fn(x, y)
    # Non-default values everywhere, so that a dropped term cannot hide.
    with torch.no_grad():
        for p in loss_fn.parameters():
            p.add_(0.3 * torch.randn_like(p))
    _, pure_loss, leaves_by_site = steps.pure_ktied_lrt_step(model, guide, x, y, 500)
    pyro.set_rng_seed(1)
    with LocalReparamMessenger():
        expected = loss_fn(x, y)
    pyro.set_rng_seed(1)
    actual = pure_loss()
    assert torch.allclose(actual, expected, rtol=1e-12), (actual, expected)
    actual.backward()
    expected.backward()
    for name, leaves in leaves_by_site.items():
        bias = name[: -len("weight")] + "bias"
        attrs = [f"locs.{name}", f"locs.{bias}", f"scale_u.{name}", f"scale_v.{name}",
                 f"scales.{bias}"]
        for attr, leaf in zip(attrs, leaves):
            grad = unconstrained_param(guide, attr).grad
            assert torch.allclose(leaf.grad, grad, rtol=1e-10, atol=1e-12), attr


def _race_module():
    return importlib.import_module("benchmarks.bench_time_to_quality")


class _FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_race_clock_counts_setup_and_steps_only():
    # A fake clock: set-up takes 1 s, each step 0.25 s, each evaluation 100 s. The
    # curve's times must be training time alone, each the first past its checkpoint.
    race = _race_module()
    clock = _FakeClock()

    class Runner:
        def setup(self):
            clock.now += 1.0

        def step(self):
            clock.now += 0.25

    def evaluate(runner):
        clock.now += 100.0
        return {"mnll": 0.0, "error": 0.0}

    curve, steps = race.race(Runner(), evaluate, [0.5, 1.1, 2.0], clock=clock)
    assert [p["seconds"] for p in curve] == [1.0, 1.25, 2.0]
    assert steps == 4


def test_race_time_to_target_and_medians():
    race = _race_module()
    curve = [{"seconds": 0.5, "mnll": 1.0}, {"seconds": 1.0, "mnll": 0.3},
             {"seconds": 2.0, "mnll": 0.2}]
    assert race.time_to(curve, "mnll", 0.3) == 1.0  # at or under
    assert race.time_to(curve, "mnll", 0.25) == 2.0
    assert race.time_to(curve, "mnll", 0.1) is None
    # None is "never": after every number
    assert race.median([3.0, None, 1.0]) == 3.0
    assert race.median([None, 2.0, None]) is None
    assert race.median([1.0, 2.0]) == 1.5


def _summary(times, best_mnll):
    return {"time_to": {"mnll <= 0.3": {"median": times[0]}, "mnll <= 0.2": {"median": times[1]}},
            "best": {"mnll": {"median": best_mnll}}}


def test_race_ratios_against_the_best_peer():
    race = _race_module()
    summary = {
        race.OURS: _summary([1.0, 3.0], 0.15),
        # the best peer differs per target; peers that never get there are ignored
        "IVON": _summary([None, None], 0.16),
        "bayesian-torch": _summary([2.0, None], 0.14),
        "Pyro AutoNormal": _summary([4.0, None], 0.2),
        race.OURS_TRAINED: _summary([0.1, 0.1], 0.01),  # ours, not a peer
    }
    rows = race.ratios(summary, race.OURS)
    assert rows["mnll <= 0.3"]["best_peer"] == "bayesian-torch"
    assert rows["mnll <= 0.3"]["ratio"] == 0.5 and rows["mnll <= 0.3"]["met"]
    # no peer gets there: met, with no ratio
    assert rows["mnll <= 0.2"]["ratio"] is None and rows["mnll <= 0.2"]["met"]
    assert rows["best mnll"]["best_peer"] == "bayesian-torch"
    assert not rows["best mnll"]["met"]  # 0.15 > 0.14
    summary[race.OURS]["time_to"]["mnll <= 0.3"]["median"] = 1.01
    summary[race.OURS]["time_to"]["mnll <= 0.2"]["median"] = None
    rows = race.ratios(summary, race.OURS)
    assert not rows["mnll <= 0.3"]["met"]
    assert rows["mnll <= 0.2"]["ratio"] is None and not rows["mnll <= 0.2"]["met"]


def test_time_to_quality_quick_without_peers(tmp_path):
    # bayesian-torch and ivon packages that fail to import stand for ones not installed,
    # and NumPyro's environment is missing: their rows are skipped, with a note
    for name in ("bayesian_torch", "ivon"):
        fake = tmp_path / "fake" / name
        fake.mkdir(parents=True)
        (fake / "__init__.py").write_text("raise ImportError('not installed (test)')\n")
    out = tmp_path / "out"
    result = _run(["-m", "benchmarks.bench_time_to_quality", "--quick", "--problems", "digits_mlp",
                   "--numpyro-python", str(tmp_path / "none" / "python"), "--out", str(out),
                   "--figures", str(out)], tmp_path,
                  pythonpath=os.pathsep.join([str(tmp_path / "fake"), ROOT]))
    assert result.returncode == 0, result.stderr[-3000:]
    for text in ("bayesian-torch is not installed", "ivon-opt is not installed",
                 "NumPyro's environment", "ours (I-BLM) ÷ best peer (target ≤ 0.5×"):
        assert text in result.stdout, (text, result.stdout[-3000:])
    with open(out / "bench_time_to_quality.json") as f:
        results = json.load(f)
    problem = results["problems"]["digits_mlp"]
    assert set(problem["skipped"]) == {"bayesian-torch", "bayesian-torch MOPED", "IVON",
                                       "NumPyro AutoNormal"}
    assert set(problem["runs"]) == {"ours (I-BLM)", "ours (trained net)", "Pyro AutoNormal"}
    for method, (run,) in problem["runs"].items():
        seconds = [p["seconds"] for p in run["curve"]]
        # evaluated right after set-up, then at the checkpoints past it, to the budget
        assert seconds[0] > 0 and seconds == sorted(seconds), (method, seconds)
        assert seconds[-1] >= results["config"]["budget"], (method, seconds)
        assert all(0 <= p["error"] <= 1 and p["mnll"] > 0 for p in run["curve"]), method
    # I-BLM's start is already good; Pyro's AutoNormal from its default init is not
    ours = problem["runs"]["ours (I-BLM)"][0]["curve"][0]
    pyro_start = problem["runs"]["Pyro AutoNormal"][0]["curve"][0]
    assert ours["error"] < 0.2 < pyro_start["error"], (ours, pyro_start)
    ratios = problem["ratios"]["ours (I-BLM) ÷ best peer"]
    assert ratios["best mnll"]["best_peer"] == "Pyro AutoNormal"
    assert problem["ratios"]["ours (trained net) ÷ MOPED"] == {}  # MOPED skipped
    pytest.importorskip("matplotlib")
    assert (out / "race.png").exists()
