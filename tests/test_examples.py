"""Smoke-runs every example script in --quick mode."""

import glob
import importlib.util
import inspect
import os
import subprocess
import sys

import pytest

from pyro_vinit import FitConfig, fit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = sorted(glob.glob(os.path.join(ROOT, "examples", "[!_]*.py")))


@pytest.mark.parametrize("path", EXAMPLES, ids=[os.path.basename(p) for p in EXAMPLES])
def test_example_quick(path, tmp_path):
    result = subprocess.run(
        [sys.executable, path, "--quick", "--out-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "MPLBACKEND": "Agg"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "nothing to average" not in result.stderr  # ParamAverage given the parameters
    outputs = os.listdir(tmp_path)
    assert any(name.endswith(".json") for name in outputs), outputs


def test_examples_exist():
    assert EXAMPLES, "no example scripts found"


FIT = FitConfig()
FIT_BATCH_SIZE = inspect.signature(fit).parameters["batch_size"].default

# The training flags of each example and the value of fit's recipe they default to.
# gradient_variance keeps [1]'s KL weight and random start (a measurement of that protocol).
RECIPE_DEFAULTS = {
    "toy_regression": {"lr": FIT.lr, "kl_weight": FIT.kl_weight, "batch_size": FIT_BATCH_SIZE},
    "initializer_comparison": {"protocol": "fit", "lr": FIT.lr, "kl_weight": FIT.kl_weight,
                               "batch_size": FIT_BATCH_SIZE,
                               "iblm_batch_size": FIT.iblm_batch_size},
    "guide_comparison": {"lr": FIT.lr, "batch_size": FIT_BATCH_SIZE},
    "gradient_variance": {"lr": FIT.lr},
    "quick_start": {"lr": FIT.lr, "kl_weight": FIT.kl_weight, "kl_warmup": 0,
                    "batch_size": FIT_BATCH_SIZE, "iblm_batch_size": FIT.iblm_batch_size,
                    "max_scale_ratio": FIT.max_scale_ratio, "init": "iblm",
                    "average": FIT.average},
    "distributed_mnist": {"lr": FIT.lr, "warmup_steps": FIT.warmup_steps,
                          "average": FIT.average,
                          "kl_weight": FIT.kl_weight, "kl_warmup": 0,
                          "batch_size": FIT_BATCH_SIZE, "iblm_batch_size": FIT.iblm_batch_size,
                          "max_scale_ratio": FIT.max_scale_ratio},
}


def test_recipe_defaults_cover_every_example():
    assert sorted(RECIPE_DEFAULTS) == sorted(os.path.basename(p)[:-3] for p in EXAMPLES)


@pytest.mark.parametrize("name", sorted(RECIPE_DEFAULTS))
def test_example_defaults_are_fits(name, monkeypatch):
    # Issue 22: every example trains with fit's recipe unless a flag says otherwise.
    monkeypatch.syspath_prepend(os.path.join(ROOT, "examples"))
    spec = importlib.util.spec_from_file_location(f"example_{name}",
                                                  os.path.join(ROOT, "examples", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    args = vars(module.parse_args([]))
    assert {k: args[k] for k in RECIPE_DEFAULTS[name]} == RECIPE_DEFAULTS[name]
