"""tools/mutation_tables.py: the generated mutation tables of docs/mutation.rst."""

import importlib.util
import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load(name):
    """tools/<name>.py, imported (tools/ is no package)."""
    spec = importlib.util.spec_from_file_location(
        name, os.path.join(ROOT, "tools", name + ".py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tool():
    return _load("mutation_tables")


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


def _mutate_module():
    return _load("mutate")


def test_mutate_refuses_a_resume_that_would_reset_the_results(tmp_path):
    mutate = _mutate_module()
    config = mutate._config(["pyro_vinit/training"], ["tests/training"], ["-q"], 15.0)
    assert mutate.resume_refusal(tmp_path, config) is None  # no run yet
    (tmp_path / "pyproject.toml").write_text(config)
    assert mutate.resume_refusal(tmp_path, config) is None  # the same settings
    other = mutate._config(["pyro_vinit/training"], ["tests/training", "tests/test_x.py"],
                           ["-q"], 15.0)
    reason = mutate.resume_refusal(tmp_path, other)
    assert "reset every result" in reason and "tests/test_x.py" in reason


def _meta(workdir, name, codes, hashes):
    path = workdir / "mutants" / (name + ".meta")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"exit_code_by_key": codes, "hash_by_function_name": hashes,
                                "type_check_error_by_key": {},
                                "durations_by_key": {k: 1.0 for k, v in codes.items()
                                                     if v is not None},
                                "estimated_durations_by_key": {}}))
    return path


def test_mutate_ledger_carries_results_to_a_fresh_run(tmp_path):
    mutate = _mutate_module()
    settings = mutate._config(["pyro_vinit/training"], ["tests/training"], ["-q"], 15.0)
    ledger = tmp_path / "ledger" / "training.json"
    run = tmp_path / "run"
    name = "pyro_vinit/training/loop.py"
    _meta(run, name, {"pyro_vinit.training.loop.x_fit__mutmut_1": 1,
                      "pyro_vinit.training.loop.x_fit__mutmut_2": None,
                      "pyro_vinit.training.loop.xǁAǁb__mutmut_1": 0},
          {"x_fit": "h1", "xǁAǁb": "h2"})
    assert mutate.save_ledger(run, ledger, settings) == 2  # the decided results only
    saved = json.loads(ledger.read_text())
    assert saved["settings"] == settings
    assert saved["files"][name]["exit_code_by_key"] == {
        "pyro_vinit.training.loop.x_fit__mutmut_1": 1,
        "pyro_vinit.training.loop.xǁAǁb__mutmut_1": 0}
    # a fresh scratch directory (the sources copied in): the whole record, for mutmut
    # to compare the hashes
    fresh = tmp_path / "fresh"
    (fresh / name).parent.mkdir(parents=True)
    (fresh / name).write_text("")
    assert mutate.load_ledger(fresh, ledger) == 2
    meta = json.loads((fresh / "mutants" / (name + ".meta")).read_text())
    assert meta["exit_code_by_key"] == saved["files"][name]["exit_code_by_key"]
    assert meta["hash_by_function_name"] == {"x_fit": "h1", "xǁAǁb": "h2"}
    # a directory with results of its own: only what it lacks, for unchanged functions
    again = tmp_path / "again"
    (again / name).parent.mkdir(parents=True)
    (again / name).write_text("")
    _meta(again, name, {"pyro_vinit.training.loop.x_fit__mutmut_1": None,
                        "pyro_vinit.training.loop.x_fit__mutmut_2": 2,
                        "pyro_vinit.training.loop.xǁAǁb__mutmut_1": None},
          {"x_fit": "h1", "xǁAǁb": "changed"})
    assert mutate.load_ledger(again, ledger) == 1
    meta = json.loads((again / "mutants" / (name + ".meta")).read_text())
    assert meta["exit_code_by_key"] == {"pyro_vinit.training.loop.x_fit__mutmut_1": 1,
                                        "pyro_vinit.training.loop.x_fit__mutmut_2": 2,
                                        "pyro_vinit.training.loop.xǁAǁb__mutmut_1": None}
    # a file no longer in the sources (deleted, renamed): its results are dropped, not
    # carried from ledger to ledger and counted (mutmut leaves its record alone)
    gone = tmp_path / "gone"
    assert mutate.load_ledger(gone, ledger) == 0
    assert not (gone / "mutants" / (name + ".meta")).exists()
    assert mutate.save_ledger(gone, ledger, settings) == 0
    # other settings: refused, naming the ledger's
    assert mutate.ledger_refusal(ledger, settings) is None
    assert mutate.ledger_refusal(tmp_path / "none.json", settings) is None
    other = mutate._config(["pyro_vinit/training"], ["tests"], ["-q"], 15.0)
    assert "other settings" in mutate.ledger_refusal(ledger, other)


def test_mutate_tells_a_changed_package_copy(tmp_path):
    # (mutmut then keeps the statistics of the changed modules only: they are taken afresh)
    import shutil

    mutate = _mutate_module()
    assert not mutate.package_changed(tmp_path)  # (no copy: a fresh folder)
    copy = tmp_path / "pyro_vinit"
    shutil.copytree(mutate.ROOT / "pyro_vinit", copy,
                    ignore=shutil.ignore_patterns("__pycache__"))
    assert not mutate.package_changed(tmp_path)
    (copy / "poutine" / "gone.py").write_text("")  # (a source file deleted since)
    assert mutate.package_changed(tmp_path)
    (copy / "poutine" / "gone.py").unlink()
    (copy / "poutine" / "__init__.py").write_text("# edited\n")
    assert mutate.package_changed(tmp_path)
    (copy / "poutine" / "__init__.py").unlink()
    assert mutate.package_changed(tmp_path)


def test_mutate_maps_spawning_tests_to_every_function_of_their_files(tmp_path):
    # a test whose ranks run the code in processes it spawns: mutmut's statistics, taken in
    # the test's process, do not see their calls; the run is told where they land
    mutate = _mutate_module()
    name = "pyro_vinit/initialization/_distributed.py"
    _meta(tmp_path, name, {"pyro_vinit.initialization._distributed.x_f__mutmut_1": 0},
          {"x_f": "h1", "xǁShardsǁg": "h2"})
    stats = tmp_path / "mutants" / "mutmut-stats.json"
    with pytest.raises(SystemExit, match="run once without it first"):
        mutate.map_spawned_tests(tmp_path, [name], ["t.py::test_ranks*"])
    stats.write_text(json.dumps({
        "duration_by_test": {"t.py::test_ranks[a]": 0.1, "t.py::test_ranks[b]": 0.2,
                             "t.py::test_one": 0.3},
        "tests_by_mangled_function_name": {
            "pyro_vinit.initialization._distributed.x_f": ["t.py::test_one"]},
        "stats_time": 1.0}))
    assert mutate.map_spawned_tests(tmp_path, [name], ["t.py::test_ranks*"]) == 2
    saved = json.loads(stats.read_text())
    assert saved["tests_by_mangled_function_name"] == {
        "pyro_vinit.initialization._distributed.x_f":
            ["t.py::test_one", "t.py::test_ranks[a]", "t.py::test_ranks[b]"],
        "pyro_vinit.initialization._distributed.xǁShardsǁg":
            ["t.py::test_ranks[a]", "t.py::test_ranks[b]"]}
    assert saved["stats_time"] == 1.0 and len(saved["duration_by_test"]) == 3
    with pytest.raises(SystemExit, match="matches none"):
        mutate.map_spawned_tests(tmp_path, [name], ["t.py::test_none*"])
    with pytest.raises(SystemExit, match="no mutated file"):
        mutate.map_spawned_tests(tmp_path, ["pyro_vinit/x.py"], ["t.py::test_ranks*"])


def test_no_mutant_listed_as_equivalent_was_killed():
    # an edit renumbers its function's mutants: an entry of tools/mutmut_equivalent.txt
    # then names another mutant, which a ledger may record as killed (and which
    # tools/mutate.py would otherwise have counted as equivalent)
    mutate = _load("mutate")
    equivalent = mutate._equivalent()
    assert mutate.stale_equivalents({"a": 1, "b": 3, "c": 0, "d": -24, "e": 1},
                                    {"a": "", "b": "", "c": "", "d": ""}) == ["a", "b"]
    ledgers = os.path.join(ROOT, "tools", "mutmut_ledger")
    stale = []
    for name in sorted(os.listdir(ledgers)):
        with open(os.path.join(ledgers, name)) as f:
            for entry in json.load(f)["files"].values():
                stale += mutate.stale_equivalents(entry["exit_code_by_key"], equivalent)
    assert stale == []


def _order_module():
    return _load("mutation_order")  # (the pytest plugin of the mutation runs)


def test_mutation_order_names_the_function_and_its_test_file():
    order = _order_module()
    mutant = "pyro_vinit.poutine._site_value.xǁUsesǁadd__mutmut_3"
    assert order.function_of(mutant) == "pyro_vinit.poutine._site_value.xǁUsesǁadd"
    assert order.own_test_file(mutant) == "test_site_value.py"
    assert order.own_test_file("pyro_vinit.poutine.layer_recorder.x_f__mutmut_12") == \
        "test_layer_recorder.py"


def test_mutation_order_runs_the_killers_of_its_function_first():
    order = _order_module()
    mutant = "pkg.mod.x_f__mutmut_9"
    killers = [("pkg.mod.x_f__mutmut_1", "tests/test_other.py::killer"),
               ("pkg.mod.x_f__mutmut_2", "tests/test_other.py::killer"),
               ("pkg.mod.x_f__mutmut_3", "tests/test_other.py::second"),
               ("pkg.mod.x_g__mutmut_1", "tests/test_other.py::of_another_function")]
    durations = {"tests/test_other.py::killer": 9.0, "tests/test_other.py::second": 0.1,
                 "tests/test_other.py::fast": 0.01, "tests/test_mod.py::own": 5.0,
                 "tests/test_other.py::of_another_function": 0.001}
    key = order.order_key(mutant, killers, durations)
    tests = sorted(durations) + ["tests/test_other.py::unknown"]
    ranked = sorted(tests, key=lambda t: key(t, t.split("::")[0].rpartition("/")[2]))
    assert ranked == ["tests/test_other.py::killer", "tests/test_other.py::second",
                      "tests/test_mod.py::own", "tests/test_other.py::of_another_function",
                      "tests/test_other.py::fast", "tests/test_other.py::unknown"]


def test_mutation_order_acts_in_a_mutants_run_only(tmp_path, monkeypatch):
    order = _order_module()
    monkeypatch.chdir(tmp_path)

    class Item:
        def __init__(self, nodeid):
            self.nodeid, self.path = nodeid, tmp_path / nodeid.split("::")[0]

    class Report:
        failed, nodeid = True, "tests/test_b.py::b"

    items = [Item("tests/test_a.py::a"), Item("tests/test_b.py::b")]
    monkeypatch.setenv("MUTANT_UNDER_TEST", "stats")  # (mutmut's statistics run)
    order.pytest_collection_modifyitems(None, None, items)
    order.pytest_runtest_logreport(Report())
    assert [i.nodeid for i in items] == ["tests/test_a.py::a", "tests/test_b.py::b"]
    assert not (tmp_path / "mutation-killers.jsonl").exists()
    monkeypatch.setenv("MUTANT_UNDER_TEST", "pkg.mod.x_f__mutmut_1")
    order.pytest_runtest_logreport(Report())  # b kills mutant 1 ...
    (tmp_path / "mutation-killers.jsonl").open("a").write("{cut short\n")
    monkeypatch.setenv("MUTANT_UNDER_TEST", "pkg.mod.x_f__mutmut_2")
    order.pytest_collection_modifyitems(None, None, items)  # ... and runs first for 2
    assert [i.nodeid for i in items] == ["tests/test_b.py::b", "tests/test_a.py::a"]
