"""Smoke-runs every example script in --quick mode."""

import glob
import os
import subprocess
import sys

import pytest

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
    outputs = os.listdir(tmp_path)
    assert any(name.endswith(".json") for name in outputs), outputs


def test_examples_exist():
    assert EXAMPLES, "no example scripts found"
