"""
A pytest plugin for the mutmut runs of ``tools/mutate.py`` (loaded there with
``PYTEST_ADDOPTS=-p mutation_order``): it runs a mutant's tests in the order
most likely to kill it soon, and records which test killed it.

mutmut hands a mutant's worker the tests that reach the mutated function in no
particular order, and stops at the first failure (``-x``); in a folder whose
tests all reach the same handlers, a mutant killed by the last file's tests
first runs hundreds of others. The order here:

1. the tests that killed other mutants of the same function in this run
   folder (most kills first; they are kept in ``mutation-killers.jsonl`` beside
   the mutants);
2. the tests of the module's own test file (``_site_value.py`` ->
   ``test_site_value.py``);
3. the rest, fastest first (mutmut's recorded durations).

Which tests run is unchanged, and so is the verdict of a mutant: killed when
any of them fails, survived when none does. Outside a mutant's run (mutmut's
statistics, its clean run) the plugin does nothing.
"""

import json
import os
from collections import Counter
from pathlib import Path

import pytest

KILLERS = Path("mutation-killers.jsonl")
STATS = Path("mutmut-stats.json")


def function_of(mutant):
    """``pkg.mod.x_f__mutmut_3`` -> ``pkg.mod.x_f``: the mutated function."""
    return mutant.rpartition("__mutmut_")[0]


def own_test_file(mutant):
    """``pkg.poutine._site_value.x_f__mutmut_3`` -> ``test_site_value.py``."""
    module = mutant.rpartition(".")[0].rpartition(".")[2]
    return f"test_{module.lstrip('_')}.py"


def order_key(mutant, killers, durations):
    """The sort key of a test (by its node id and file name) for ``mutant``."""
    function = function_of(mutant)
    kills = Counter(test for killed, test in killers if function_of(killed) == function)
    own = own_test_file(mutant)

    def key(nodeid, file_name):
        return (-kills[nodeid], file_name != own, durations.get(nodeid, float("inf")))

    return key


def _mutant():
    mutant = os.environ.get("MUTANT_UNDER_TEST", "")
    return mutant if "__mutmut_" in mutant else None


def _killers():
    if not KILLERS.exists():
        return []
    found = []
    for line in KILLERS.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:  # (a line cut short by a killed worker)
            continue
        found.append((record["mutant"], record["test"]))
    return found


def _durations():
    if not STATS.exists():
        return {}
    return json.loads(STATS.read_text()).get("duration_by_test", {})


@pytest.hookimpl(trylast=True)  # (after the suite's own ordering)
def pytest_collection_modifyitems(session, config, items):
    mutant = _mutant()
    if mutant is None:
        return
    key = order_key(mutant, _killers(), _durations())
    items.sort(key=lambda item: key(item.nodeid, item.path.name))



def pytest_runtest_logreport(report):
    mutant = _mutant()
    if mutant is not None and report.failed:
        with KILLERS.open("a") as f:
            f.write(json.dumps({"mutant": mutant, "test": report.nodeid}) + "\n")
