"""The Sphinx docs build with warnings as errors (as `make docs` does)."""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_docs_build(tmp_path):
    pytest.importorskip("sphinx", reason="the [docs] extra is not installed")
    result = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "-q", "-b", "html", "docs", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert (tmp_path / "index.html").exists()

    # The API reference links into the Pyro and PyTorch docs (intersphinx, from the
    # inventories shipped in docs/_inventories, so this holds without a network too).
    html = "".join(p.read_text() for p in (tmp_path / "api").glob("*.html"))
    for base in ("https://docs.pyro.ai/en/stable/", "https://pytorch.org/docs/stable/"):
        assert f'<a class="reference external" href="{base}' in html, f"no links to {base}"


def _python_blocks(text):
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def test_readme_usage_runs(tmp_path):
    # The README's usage snippet, with fewer steps, must run as printed and learn.
    with open(os.path.join(ROOT, "README.md")) as f:
        blocks = _python_blocks(f.read())
    assert blocks, "README.md has no python block"
    code = blocks[0]
    assert "range(2000)" in code and "LinearWarmup(1000)" in code
    code = code.replace("range(2000)", "range(300)")
    code = code.replace("LinearWarmup(1000)", "LinearWarmup(100)")
    code = code.replace("print(classification_metrics(", "metrics = (classification_metrics(")
    code += "\nassert metrics['error_rate'] < 0.1, metrics\n"
    script = tmp_path / "readme_usage.py"
    script.write_text(code)
    result = subprocess.run(
        [sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
