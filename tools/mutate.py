"""
Mutation testing of chosen modules against chosen tests with mutmut, for
``make mutate`` (a developer tool, not part of CI).

mutmut reads its settings only from the ``pyproject.toml`` of the directory it
runs in, so this script copies the package and the tests into a scratch
directory (``build/mutmut`` by default), writes the settings for the requested
modules and tests there, runs ``mutmut run`` and prints, per module, how many
mutants the tests killed and how many survived. Mutants listed in
``tools/mutmut_equivalent.txt`` (equivalent to the original code, so no test
can kill them) are counted apart.

A run of thousands of mutants outlasts a session, and ``build/`` does not
survive a fresh checkout: ``--ledger FILE`` (a JSON file kept in the repository,
e.g. under ``tools/mutmut_ledger/``) carries the results over. Before the run
its results are written into the scratch directory, where mutmut keeps those of
every function whose code is unchanged (it compares each function's hash) and
tests only the rest; after the run, or with ``--summary-only``, the scratch
directory's results are written back to it. A ledger holds the settings of its
run and is refused for others.

Usage::

    python tools/mutate.py --modules pyro_vinit/distributions --tests tests/distributions
    cd build/mutmut && mutmut show <mutant name>     # the diff of one survivor
"""

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EQUIVALENT = ROOT / "tools" / "mutmut_equivalent.txt"
#: mutmut's exit codes of a mutant that a test killed (a failed test; pytest's "interrupted")
KILLED = (1, 3)

def _toml_list(items):
    return "[" + ", ".join(json.dumps(str(item)) for item in items) + "]"


def _config(modules, tests, pytest_args, timeout_multiplier):
    globs = [m if m.endswith(".py") else f"{m.rstrip('/')}/*" for m in modules]
    return "\n".join(
        [
            "[tool.mutmut]",
            'source_paths = ["pyro_vinit"]',
            f"only_mutate = {_toml_list(globs)}",
            f"pytest_add_cli_args_test_selection = {_toml_list(tests)}",
            f"pytest_add_cli_args = {_toml_list(pytest_args)}",
            # torch starts threads at import: fork the workers from a clean server process.
            'process_isolation = "forkserver"',
            f"timeout_multiplier = {timeout_multiplier}",
            "",
        ]
    )


def resume_refusal(workdir, config):
    """Why resuming the run in ``workdir`` with ``config`` would lose its results, or
    None: mutmut resets every result when the tests or pytest arguments (or the
    modules, or the timeout) differ from the run before."""
    path = Path(workdir) / "pyproject.toml"
    if not path.exists():
        return None
    before = path.read_text()
    if before == config:
        return None
    changed = [line for line in config.splitlines() if line not in before.splitlines()]
    return (f"--resume/--mutants with settings other than {workdir}'s run would make mutmut "
            f"reset every result there ({'; '.join(changed)}); give that run's --modules, "
            f"--tests, --pytest-args and --timeout-multiplier:\n{before}")


def _function_of(mutant):
    """The mangled function name of a mutant (``pkg.mod.x_f__mutmut_3`` -> ``x_f``), as
    mutmut keys its functions' hashes."""
    return mutant.rpartition(".")[2].rpartition("__mutmut_")[0]


def _dotted(module):
    """``pyro_vinit/x/y.py`` (or a package folder) -> ``pyro_vinit.x.y``."""
    return module.removesuffix(".py").replace("/", ".").rstrip(".")


def package_changed(workdir):
    """Whether the package copy in ``workdir`` differs from the sources (files added,
    removed or edited). mutmut 3.8 then regenerates the changed files' mutants and
    keeps the statistics of their modules only: the other modules' mutants would
    count as having no tests, so the statistics are to be taken afresh."""
    import filecmp

    def differs(comparison):
        return bool(comparison.left_only or comparison.right_only or comparison.diff_files
                    or any(differs(sub) for sub in comparison.subdirs.values()))

    copy = Path(workdir) / "pyro_vinit"
    return copy.exists() and differs(filecmp.dircmp(
        ROOT / "pyro_vinit", copy, ignore=["__pycache__"]))


def map_spawned_tests(workdir, modules, patterns):
    """Maps the tests that match ``patterns`` (fnmatch, e.g. ``file.py::test_ranks*``) to
    every function of the mutated files ``modules``, in the statistics of the run in
    ``workdir``: tests whose code runs in processes they spawn (the ranks of a
    ``torch.distributed`` group), where mutmut's statistics, taken in the test's own
    process, do not see the calls. Returns the number of tests mapped; refuses a
    folder without statistics (a first run takes them)."""
    import fnmatch

    path = Path(workdir) / "mutants" / "mutmut-stats.json"
    if not path.exists():
        raise SystemExit(f"--spawned-tests maps tests in the statistics of a run, which "
                         f"{workdir} has none of yet: run once without it first")
    stats = json.loads(path.read_text())
    tests = sorted(t for t in stats["duration_by_test"]
                   if any(fnmatch.fnmatch(t, p) for p in patterns))
    if not tests:
        raise SystemExit(f"--spawned-tests {patterns} matches none of the run's tests")
    mapping = stats["tests_by_mangled_function_name"]
    for module in modules:
        meta = Path(workdir) / "mutants" / (module + ".meta")
        if not meta.exists():
            raise SystemExit(f"--spawned-modules: {module} is no mutated file of the run")
        dotted = _dotted(module)
        for function in json.loads(meta.read_text())["hash_by_function_name"]:
            name = f"{dotted}.{function}"
            mapping[name] = sorted(set(mapping.get(name, [])) | set(tests))
    path.write_text(json.dumps(stats, indent=4))
    return len(tests)


def save_ledger(workdir, path, settings):
    """Writes the decided results of the run in ``workdir`` (run with ``settings``,
    its pyproject.toml text) to the ledger ``path``: per mutated file, its functions'
    hashes and its mutants' exit codes and durations."""
    files = {}
    for meta in sorted((Path(workdir) / "mutants").rglob("*.py.meta")):
        data = json.loads(meta.read_text())
        codes = {k: v for k, v in data["exit_code_by_key"].items() if v is not None}
        if not codes:
            continue
        name = meta.relative_to(Path(workdir) / "mutants").as_posix().removesuffix(".meta")
        files[name] = {
            "hash_by_function_name": data.get("hash_by_function_name", {}),
            "exit_code_by_key": codes,
            "durations_by_key": {k: round(v, 3) for k, v in
                                 data.get("durations_by_key", {}).items() if k in codes},
        }
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps({"settings": settings, "files": files}, indent=1,
                                     sort_keys=True) + "\n")
    return sum(len(f["exit_code_by_key"]) for f in files.values())


def ledger_refusal(path, settings):
    """Why the ledger ``path`` cannot seed a run with ``settings``, or None."""
    if not Path(path).exists():
        return None
    before = json.loads(Path(path).read_text())["settings"]
    if before == settings:
        return None
    return (f"the ledger {path} holds a run with other settings; give its --modules, "
            f"--tests, --pytest-args and --timeout-multiplier, or another --ledger:\n{before}")


def load_ledger(workdir, path):
    """Writes the ledger ``path``'s results into ``workdir``'s mutmut data: a file's
    whole record where ``workdir`` has none (mutmut then keeps the results of the
    functions whose hash is unchanged), else the results ``workdir`` lacks for
    functions of the same hash. A file that ``workdir``'s sources no longer hold
    (deleted, renamed) is left out: mutmut would leave its record alone, and it
    would be counted and carried from ledger to ledger. Returns the number of
    results written."""
    if not Path(path).exists():
        return 0
    written = 0
    for name, entry in json.loads(Path(path).read_text())["files"].items():
        if not (Path(workdir) / name).is_file():
            continue
        meta = Path(workdir) / "mutants" / (name + ".meta")
        if meta.exists():
            data = json.loads(meta.read_text())
            hashes = data.get("hash_by_function_name", {})
            for key, code in entry["exit_code_by_key"].items():
                function = _function_of(key)
                if (key in data["exit_code_by_key"] and data["exit_code_by_key"][key] is None
                        and function in hashes
                        and hashes[function] == entry["hash_by_function_name"].get(function)):
                    data["exit_code_by_key"][key] = code
                    if key in entry["durations_by_key"]:
                        data.setdefault("durations_by_key", {})[key] = \
                            entry["durations_by_key"][key]
                    written += 1
        else:
            data = {"exit_code_by_key": dict(entry["exit_code_by_key"]),
                    "hash_by_function_name": dict(entry["hash_by_function_name"]),
                    "type_check_error_by_key": {},
                    "durations_by_key": dict(entry["durations_by_key"]),
                    "estimated_durations_by_key": {}}
            written += len(entry["exit_code_by_key"])
        meta.parent.mkdir(parents=True, exist_ok=True)
        meta.write_text(json.dumps(data, indent=4))
    return written


def _equivalent():
    """mutant name -> justification, from tools/mutmut_equivalent.txt."""
    if not EQUIVALENT.exists():
        return {}
    result = {}
    for line in EQUIVALENT.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, why = line.partition(" ")
            result[name] = why.strip()
    return result


def _module_of(mutant, modules):
    for module in modules:
        dotted = _dotted(module)
        if mutant == dotted or mutant.startswith(dotted + "."):
            return module
    return None


def stale_equivalents(exit_codes, equivalent):
    """The mutants listed as equivalent that a test killed: entries left behind by an
    edit that renumbered their function's mutants (mutmut numbers them in order)."""
    return sorted(m for m, code in exit_codes.items() if m in equivalent and code in KILLED)


def summarize(workdir, modules):
    """Per module: Counter of killed / survived / no tests / timeout / equivalent, the
    survivors, and the stale entries of the equivalent list."""
    from mutmut.stats import status_by_exit_code

    equivalent = _equivalent()
    counts = {module: Counter() for module in modules}
    survivors, stale = [], []
    for meta in sorted((workdir / "mutants").rglob("*.py.meta")):
        codes = json.loads(meta.read_text())["exit_code_by_key"]
        stale += stale_equivalents(codes, equivalent)
        for mutant, code in codes.items():
            module = _module_of(mutant, modules)
            if module is None or code is None:
                continue
            # A timeout means the mutant hangs the tests: detected, though not by an assert.
            status = status_by_exit_code[code]
            if mutant in equivalent and code not in KILLED:
                status = "equivalent"
            counts[module][status] += 1
            if status in ("survived", "no tests"):
                survivors.append(f"{mutant} ({status})")
    return counts, survivors, stale


def _print_table(counts):
    statuses = ["killed", "timeout", "survived", "no tests", "equivalent"]
    other = sorted({s for c in counts.values() for s in c} - set(statuses))
    print(" | ".join(["module", "total"] + statuses + other
                     + ["survival rate", "counting the equivalent"]))
    for module, c in counts.items():
        everything = sum(c.values())
        total = everything - c["equivalent"]
        alive = c["survived"] + c["no tests"]
        rate = f"{100 * alive / total:.1f}%" if total else "-"
        raw = f"{100 * (alive + c['equivalent']) / everything:.1f}%" if everything else "-"
        print(" | ".join([module, str(total)] + [str(c[s]) for s in statuses + other]
                         + [rate, raw]))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modules", nargs="+", required=True,
                        help="packages or .py files under pyro_vinit to mutate")
    parser.add_argument("--tests", nargs="+", required=True,
                        help="test files, folders or pytest ids (file::test) to run against "
                             "each mutant")
    parser.add_argument("--workdir", type=Path, default=ROOT / "build" / "mutmut")
    parser.add_argument("--max-children", type=int, default=1, help="parallel workers")
    parser.add_argument("--resume", action="store_true",
                        help="keep the previous results in workdir; retest only what changed")
    parser.add_argument("--mutants", nargs="+", default=[],
                        help="retest only these mutants (names as printed), keeping the other "
                             "results; implies --resume. Give the same --modules and --tests as "
                             "the run before: mutmut starts afresh when its settings change")
    parser.add_argument("--pytest-args", default="",
                        help="extra pytest arguments for every run, one string, e.g. "
                             "'-k \"not slow_test\"' to leave out slow tests")
    parser.add_argument("--timeout-multiplier", type=float, default=15.0,
                        help="a mutant times out after this many times its tests' CPU time "
                             "(mutmut's default 15); lower it where many mutants hang")
    parser.add_argument("--summary-only", action="store_true",
                        help="print the table of the last run without running mutmut")
    parser.add_argument("--ledger", type=Path, default=None,
                        help="a JSON file of results carried from run to run (e.g. "
                             "tools/mutmut_ledger/initialization.json): read before the run, "
                             "written after it (and with --summary-only)")
    parser.add_argument("--spawned-tests", nargs="+", default=[],
                        help="tests (fnmatch patterns of pytest ids) whose code runs in "
                             "processes they spawn, which mutmut's statistics do not see: "
                             "run against every mutant of --spawned-modules")
    parser.add_argument("--spawned-modules", nargs="+", default=[],
                        help="the mutated files (e.g. pyro_vinit/initialization/_distributed"
                             ".py) whose code the --spawned-tests run in their processes")
    args = parser.parse_args()
    if bool(args.spawned_tests) != bool(args.spawned_modules):
        parser.error("--spawned-tests and --spawned-modules go together")
    for path in args.modules + args.tests:
        # a test may be a pytest id, ``file::test``: the file must exist
        if not (ROOT / path.partition("::")[0]).exists():
            parser.error(f"{path} does not exist (paths are relative to {ROOT})")

    if not args.summary_only:
        config = _config(args.modules, args.tests,
                         ["-p", "no:cacheprovider", "-x", "-q"] + shlex.split(args.pytest_args),
                         args.timeout_multiplier)
        if args.resume or args.mutants:
            reason = resume_refusal(args.workdir, config)
            if reason:
                parser.error(reason)
        if args.ledger is not None:
            reason = ledger_refusal(args.ledger, config)
            if reason:
                parser.error(reason)
        if not (args.resume or args.mutants):
            shutil.rmtree(args.workdir, ignore_errors=True)
        args.workdir.mkdir(parents=True, exist_ok=True)
        stats = args.workdir / "mutants" / "mutmut-stats.json"
        if stats.exists() and package_changed(args.workdir):
            stats.unlink()
            print("the package changed since the folder's last run: mutmut's statistics "
                  "are taken afresh")
        for name in ("pyro_vinit", "tests"):
            shutil.rmtree(args.workdir / name, ignore_errors=True)
            shutil.copytree(ROOT / name, args.workdir / name,
                            ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copy(ROOT / "setup.cfg", args.workdir / "setup.cfg")
        (args.workdir / "pyproject.toml").write_text(config)
        if args.ledger is not None:
            print(f"{load_ledger(args.workdir, args.ledger)} results from {args.ledger}")
        if args.spawned_tests:
            count = map_spawned_tests(args.workdir, args.spawned_modules, args.spawned_tests)
            print(f"{count} spawning tests mapped to the functions of {args.spawned_modules}")
        mutmut = Path(sys.executable).with_name("mutmut")
        # mutmut puts its mutated copy first on the path; tools/ holds the plugin that
        # orders each mutant's tests (mutation_order.py), and nothing mutmut imports
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "tools"),
               "PYTEST_ADDOPTS": "-p mutation_order"}
        cmd = [str(mutmut), "run", "--max-children", str(args.max_children)] + args.mutants
        subprocess.run(cmd, cwd=args.workdir, env=env, check=True)

    counts, survivors, stale = summarize(args.workdir, args.modules)
    print()
    _print_table(counts)
    if survivors:
        print(f"\n{len(survivors)} not killed (see `cd {args.workdir} && mutmut show <name>`):")
        print("\n".join(survivors))
    if stale:
        print(f"\n{len(stale)} listed in {EQUIVALENT.name} but killed (counted as killed; "
              "renumbered by an edit? check with `mutmut show <name>`):")
        print("\n".join(stale))
    summary = {m: dict(c) for m, c in counts.items()}
    (args.workdir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    if args.ledger is not None:
        settings = (args.workdir / "pyproject.toml").read_text()
        reason = ledger_refusal(args.ledger, settings)
        if reason:
            parser.error(reason)
        print(f"{save_ledger(args.workdir, args.ledger, settings)} results written to "
              f"{args.ledger}")


if __name__ == "__main__":
    main()
