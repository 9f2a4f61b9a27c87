"""tools/mutation_tables.py: the generated mutation tables of docs/mutation.rst."""

import importlib.util
import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def tool():
    spec = importlib.util.spec_from_file_location(
        "mutation_tables", os.path.join(ROOT, "tools", "mutation_tables.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_tables_are_up_to_date(tool):
    assert tool.main(["--check"]) == 0, "run python tools/mutation_tables.py"


def test_percent(tool):
    assert tool.percent(0, 307) == "0 %"
    assert tool.percent(7, 35) == "20 %"
    assert tool.percent(20, 327) == "6.1 %"
    assert tool.percent(22, 369) == "6.0 %"  # 5.96: the decimal stays
    assert tool.percent(1, 0) == "-"


def test_rates_from_counts(tool):
    def row(**kw):
        return tool.cells({"module": "pyro_vinit/m.py", "killed": 347, "survived": 5, **kw},
                          short_names=True)

    cells = row(equivalent=61, unspecified=17, first=[84, 413])
    assert cells["module"] == ["``m.py``"] and cells["total"] == ["352"]
    assert cells["equivalent"] == ["61 (17)"]
    # the parenthesized rate counts the `unspecified:` entries as survivors: 22 / 369
    assert cells["survival rate"] == ["1.4 % (6.0 %)"]
    assert cells["first (not killed)"] == ["84 of 413 (20.3 %)"]
    assert row(equivalent=3)["survival rate"] == ["1.4 %"]
    # the default table counts every equivalent mutant in the parenthesized rate
    full = tool.cells({"module": "pyro_vinit/m.py", "killed": 307, "survived": 0,
                       "equivalent": 20}, short_names=False)
    assert full["module"] == ["``pyro_vinit/m.py``"]
    assert full["survival rate"] == ["0 % (6.1 %)"]


def test_rst_table_continues_cells(tool):
    text = tool.rst_table(["a", "bb"], [{"a": ["x"], "bb": ["1", "2"]}])
    assert text.splitlines() == ["= ==", "a bb", "= ==", "x 1", "  2", "= =="]


def test_record(tool):
    figures = {"tables": [{"rows": [{"module": "pyro_vinit/m.py", "killed": 1, "survived": 9,
                                     "equivalent": 0, "tests": ["t"]}]}]}
    tool.record(figures, {"pyro_vinit/m.py": {"killed": 5, "timeout": 2, "survived": 1,
                                              "no tests": 1, "equivalent": 3}})
    assert figures["tables"][0]["rows"][0] == {
        "module": "pyro_vinit/m.py", "killed": 7, "survived": 2, "equivalent": 3, "tests": ["t"]}
    with pytest.raises(SystemExit, match="no row"):
        tool.record(figures, {"pyro_vinit/other.py": {}})


def test_figures_file_is_consistent():
    with open(os.path.join(ROOT, "tools", "mutation_figures.json")) as f:
        figures = json.load(f)
    for table in figures["tables"]:
        for row in table["rows"]:
            assert os.path.exists(os.path.join(ROOT, row["module"])), row["module"]
            assert row.get("unspecified", 0) <= row["equivalent"], row


def test_mutate_refuses_a_resume_that_would_reset_the_results(tmp_path):
    spec = importlib.util.spec_from_file_location(
        "mutate", os.path.join(ROOT, "tools", "mutate.py"))
    mutate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mutate)
    config = mutate._config(["pyro_vinit/training"], ["tests/training"], ["-q"], 15.0)
    assert mutate.resume_refusal(tmp_path, config) is None  # no run yet
    (tmp_path / "pyproject.toml").write_text(config)
    assert mutate.resume_refusal(tmp_path, config) is None  # the same settings
    other = mutate._config(["pyro_vinit/training"], ["tests/training", "tests/test_x.py"],
                           ["-q"], 15.0)
    reason = mutate.resume_refusal(tmp_path, other)
    assert "reset every result" in reason and "tests/test_x.py" in reason
