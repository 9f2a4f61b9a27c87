"""Smoke runs (``--quick``) of the benchmark scripts behind the performance page, and
the exactness of the plain-PyTorch twin that bench_floor times."""

import importlib.util
import json
import os
import subprocess
import sys

import pyro
import pytest
import torch
from pyro.infer import TraceMeanField_ELBO

from pyro_vinit import AutoKTiedNormal, LocalReparamMessenger
from pyro_vinit._pyro_compat import unconstrained_param

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# script: text its report must contain
SCRIPTS = {
    "bench_targets.py": ["AutoKTiedNormal(2) + LRT ÷ bayesian-torch LinearReparameterization",
                         "batch 1000, validation off", "batch 128, validation on",
                         "AutoRadialNormal ÷ AutoNormal", "native loop", "load average"],
    "bench_lrt_step.py": ["k-tied LRT low-rank", "mean-field Flipout", "low-rank ÷ dense"],
    "bench_gradient_variance.py": ["| 1 |", "LRT / ordinary", "no weight noise"],
    "bench_floor.py": ["pure PyTorch, our estimator", "minimal Pyro", "tiny 8-8-8-3, batch 2",
                       "64-400-400-10, batch 1000", "load average"],
    "bench_fit_recipe.py": ["digits_mlp", "λ=0.1 seed 0", " 0:", " 5:"],
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


def _steps_module():
    spec = importlib.util.spec_from_file_location(
        "_steps", os.path.join(ROOT, "benchmarks", "_steps.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("sizes", [(6, 5, 4, 3), (64, 40, 30, 10)], ids=["dense", "low-rank"])
def test_pure_estimator_equals_pyro_step(sizes):
    # bench_floor's "pure PyTorch" step must be the Pyro step's arithmetic, or its floor
    # means nothing: same parameters, same seed, same loss and gradients.
    steps = _steps_module()
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
