"""What every example does at the end: write ``results.json`` and its figures."""

import json
import os
from typing import Callable, List


def save_results(out_dir: str, results: dict, plot: Callable[[], List[str]]) -> None:
    """
    Writes ``results`` to ``out_dir/results.json``, then calls ``plot()``,
    which draws the figures and returns their paths. Without matplotlib (an
    optional extra) the figures are skipped, and the script says so.
    """
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    try:
        written = plot()
    except ImportError:
        print("matplotlib not installed: skipping the plots")
    else:
        print("wrote", ", ".join(written))
