"""Smoke runs (``--quick``) of the benchmark scripts behind the performance page."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# script: text its report must contain
SCRIPTS = {
    "bench_targets.py": ["AutoKTiedNormal(2) + LRT ÷ bayesian-torch LinearReparameterization",
                         "batch 1000, validation off", "batch 128, validation on",
                         "AutoRadialNormal ÷ AutoNormal", "native loop", "load average"],
    "bench_lrt_step.py": ["k-tied LRT low-rank", "mean-field Flipout", "low-rank ÷ dense"],
    "bench_gradient_variance.py": ["| 1 |", "LRT / ordinary", "no weight noise"],
}


def _run(args, tmp_path, pythonpath=ROOT):
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=900,
        env={**os.environ, "MPLBACKEND": "Agg", "OMP_NUM_THREADS": "1",
             "PYTHONPATH": pythonpath},
    )


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_script_quick(script, tmp_path):
    result = _run([f"benchmarks/{script}", "--quick"], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    for text in SCRIPTS[script]:
        assert text in result.stdout, (text, result.stdout[-3000:])


def test_targets_without_bayesian_torch(tmp_path):
    # a bayesian_torch package that fails to import stands for one not installed
    fake = tmp_path / "bayesian_torch"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('not installed (test)')\n")
    result = _run(["benchmarks/bench_targets.py", "--quick"], tmp_path,
                  pythonpath=os.pathsep.join([str(tmp_path), ROOT]))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "bayesian-torch is not installed: its rows are skipped" in result.stdout
    assert "pip install --no-deps bayesian-torch==0.5.0" in result.stdout
    bt_rows = [line for line in result.stdout.splitlines() if "÷ bayesian-torch" in line]
    assert len(bt_rows) == 4 and all("skipped" in line for line in bt_rows), bt_rows
    assert "AutoKTiedNormal(2) ÷ AutoNormal" in result.stdout


def test_scaling_quick(tmp_path):
    result = _run(["benchmarks/bench_scaling.py", "--quick", "--out", str(tmp_path)], tmp_path)
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
