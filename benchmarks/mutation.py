"""Mutation testing of the code whose mistakes cost users most; not part of CI.

Uses mutmut (``pip install mutmut==3.8.1``). For each target below it copies ``copytrace/``,
the tests and the docs to a work directory (``--workdir``), marks every function of the
target's file that is not under test ``# pragma: no mutate block`` there, writes a
``[tool.mutmut]`` configuration, lets mutmut generate the mutants, and runs a random sample of
at most ``--max-mutants`` of them, each against only the tests that execute the mutated
function, chosen by mutmut from the target's focused test files (one worker, fork server with
torch preloaded: a killed mutant costs a second or two, a survivor the time of all its tests).
It then prints, per target, how many mutants the tests killed, and the survivors.

Targets:

- ``recorder``: the byte, alias and graph facts of an API copy (``ApiEvents._record_api``,
  ``_record_py``, ``_classify``) in ``copytrace/tracer/_api_events.py``;
- ``record_rules``: the rule tables' helpers (``_transfer``...) in ``copytrace/tracer/_rules.py``;
- ``rules``: the hazard rules that group events, ``copytrace/analysis/_rules.py``, except
  ``pageable_transfer``, whose tests need a CUDA device;
- ``pairs``: the hazard rules that pair events and their candidate selection,
  ``copytrace/analysis/_pairs.py``, except ``round_trip`` (CUDA, as above);
- ``otel``: the span export in ``copytrace/export/`` (attributes, OTLP/JSON encoding, the
  span plan, SDK spans, the hazards span).

Usage::

    pip install mutmut==3.8.1
    python benchmarks/mutation.py                       # all targets, 60 mutants each
    python benchmarks/mutation.py --targets rules --max-mutants 0   # every mutant of one
    python benchmarks/mutation.py --show-survivors      # and the diff of each survivor

About 40 minutes for the four default samples on 2 shared CPU cores. Exit status 0; the
scores are in the output (and in the README's development section).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: mutmut's exit-code classification (mutmut.stats.status_by_exit_code)
KILLED, SURVIVED = {1, 3}, {0}
TIMEOUT = {36, -24, 24, 152, 255}
NO_TESTS = {5, 33}


@dataclass(frozen=True)
class Target:
    """Modules under mutation: their functions (``name`` or ``Class.method``; empty: all
    of them) and the test files that may kill their mutants."""

    files: tuple[str, ...]
    functions: tuple[str, ...]
    tests: tuple[str, ...]
    #: functions left unmutated although ``functions`` is empty
    skip: tuple[str, ...] = ()


TARGETS = {
    "recorder": Target(
        ("copytrace/tracer/_api_events.py",)
        ("ApiEvents._record_api", "ApiEvents._record_py", "ApiEvents._classify", "_tag_grad_fn"),
        ("tests/test_tracer_ops.py", "tests/test_cases.py", "tests/test_recorder_facts.py"),
    ),
    "record_rules": Target(
        "copytrace/tracer/_rules.py",
        ("_transfer", "_storage_nbytes", "_is_copy_op", "_basic_index"),
        ("tests/test_rules.py", "tests/test_recorder_facts.py", "tests/test_tracer_ops.py"),
    ),
    "rules": Target(
        ("copytrace/analysis/_rules.py",),
        (),
        ("tests/test_hazards.py", "tests/test_hazard_messages.py"),
        # its tests need a CUDA device (host<->device transfers); see README
        skip=("pageable_transfer",),
    ),
    "pairs": Target(
        ("copytrace/analysis/_pairs.py",),
        (),
        ("tests/test_hazards.py", "tests/test_hazard_messages.py"),
        skip=("round_trip", "_round_trip_rows", "_moves"),
    ),
    "otel": Target(
        (
            "copytrace/export/otlp_json.py",
            "copytrace/export/pipeline.py",
            "copytrace/export/file_sink.py",
            "copytrace/export/sdk_sink.py",
            "copytrace/export/hazard_span.py",
        ),
        (
            "any_value",
            "attribute_list",
            "_span_json",
            "event_attributes",
            "span_times",
            "Encoder.attr",
            "Encoder.attrs",
            "Encoder.span",
            "FileSink._encode",
            "SdkSink.write",
            "ExportPipeline._plan",
            "append_hazard_span",
            "hazard_span_parts",
            "SdkSink.write_hazards",
            "iter_lines",
            "pack_lines",
        ),
        (
            "tests/test_otel_format.py",
            "tests/test_otel_encoding.py",
            "tests/test_export.py",
            "tests/test_promises.py",
        ),
    ),
}

# torch.compile cannot trace through mutmut's trampolines: the compiled-code tests are left out.
_CONFIG = """
[tool.mutmut]
source_paths = ["copytrace"]
only_mutate = {files}
pytest_add_cli_args_test_selection = {tests}
pytest_add_cli_args = ["-p", "no:cacheprovider", "-W", "ignore", "-k", "not compiled"]
also_copy = ["docs/", "README.md", "examples/"]
process_isolation = "forkserver"
forkserver_warmup = "collect"
use_git_change_detection = false
timeout_multiplier = 5.0
"""
# Imported once by the fork server, not once per mutant (the first traced op loads _dynamo).
_PRELOAD = "import torch._dynamo  # noqa: F401  (benchmarks/mutation.py: preload)\n"


def _only_functions(path: Path, keep: tuple[str, ...], skip: tuple[str, ...] = ()) -> None:
    """Mark every top-level function and method of ``path`` not in ``keep`` (when given) or
    in ``skip`` with mutmut's
    ``# pragma: no mutate block``: no mutants, and no trampoline (some functions run while
    their class is being created, before mutmut's trampoline could find them)."""
    import libcst as cst

    pragma = cst.Comment("# pragma: no mutate block")

    class Pin(cst.CSTTransformer):
        def __init__(self) -> None:
            self.classes: list[str] = []
            self.depth = 0

        def visit_ClassDef(self, node: cst.ClassDef) -> bool:
            self.classes.append(node.name.value)
            return True

        def leave_ClassDef(self, node: cst.ClassDef, new: cst.ClassDef) -> cst.ClassDef:
            self.classes.pop()
            return new

        def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
            self.depth += 1
            return True

        def leave_FunctionDef(self, node: cst.FunctionDef, new: cst.FunctionDef) -> cst.FunctionDef:
            self.depth -= 1
            name = ".".join([*self.classes, node.name.value])
            pinned = name in skip or (keep and name not in keep)
            if self.depth or not pinned or not isinstance(new.body, cst.IndentedBlock):
                return new
            header = new.body.header.with_changes(
                whitespace=cst.SimpleWhitespace("  "), comment=pragma
            )
            return new.with_changes(body=new.body.with_changes(header=header))

    tree = cst.parse_module(path.read_text(encoding="utf-8"))
    path.write_text(tree.visit(Pin()).code, encoding="utf-8")


#: mutmut calls a mutated function through its trampoline (a frame in mutmut's package): the
#: call-site walk must skip that frame as it skips copytrace's own, or every event's call site
#: would be the trampoline. (file, text, replacement) applied to the copy.
_PATCHES = (
    (
        "copytrace/tracer/_callsite.py",
        "    if path.startswith(own[0]) if own else False:",
        "    if path.startswith((own[0], _dir_of(__import__('mutmut').__file__))) if own else False:",
    ),
)


def _prepare(work: Path, target: Target) -> None:
    """A copy of the package and the tests with the target's mutmut configuration."""
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(ROOT / "copytrace", work / "copytrace", ignore=ignore)
    for file, text, replacement in _PATCHES:
        path = work / file
        source = path.read_text(encoding="utf-8")
        if text not in source:
            raise SystemExit(f"benchmarks/mutation.py: update _PATCHES: {text!r} not in {file}")
        path.write_text(source.replace(text, replacement), encoding="utf-8")
    if target.functions or target.skip:
        for file in target.files:
            _only_functions(work / file, target.functions, target.skip)
    for name in ("tests", "docs", "examples"):  # tests read the docs and run the examples
        shutil.copytree(ROOT / name, work / name, ignore=ignore)
    shutil.copy(ROOT / "README.md", work / "README.md")
    conftest = work / "tests" / "conftest.py"
    conftest.write_text(conftest.read_text(encoding="utf-8") + _PRELOAD, encoding="utf-8")
    project = (ROOT / "pyproject.toml").read_text(encoding="utf-8").split("[tool.mutmut]")[0]
    config = _CONFIG.format(files=json.dumps(list(target.files)),
                            tests=json.dumps(list(target.tests)))  # fmt: skip
    (work / "pyproject.toml").write_text(project + config, encoding="utf-8")


def _mutmut(work: Path, names: list[str], log: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COPYTRACE", "OTEL_"))}
    env.update(PYTHONPATH="", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "mutmut", "run", "--max-children", "1", *names]
    with log.open("a", encoding="utf-8") as out:
        subprocess.run(cmd, cwd=work, env=env, stdout=out, stderr=subprocess.STDOUT, check=False)


def _results(work: Path, target: Target) -> dict[str, int | None]:
    codes: dict[str, int | None] = {}
    for file in target.files:
        meta = work / "mutants" / (file + ".meta")
        if meta.exists():
            codes.update(json.loads(meta.read_text(encoding="utf-8"))["exit_code_by_key"])
    return codes


def _module_prefix(target: Target) -> str:
    return target.files[0].removesuffix(".py").replace("/", ".") + "."


def run_target(name: str, target: Target, args: argparse.Namespace) -> dict[str, object]:
    work = args.workdir / name
    log = args.workdir / f"{name}.log"
    log.unlink(missing_ok=True)
    _prepare(work, target)
    t0 = time.monotonic()
    # 1. generate the mutants and the test-to-function map (no mutant run: the glob matches none)
    _mutmut(work, [_module_prefix(target) + "no_such_function__mutmut_*"], log)
    every = sorted(_results(work, target))
    chosen = every
    if args.max_mutants and len(chosen) > args.max_mutants:
        chosen = sorted(random.Random(args.seed).sample(chosen, args.max_mutants))
    # 2. run the chosen mutants
    if chosen:
        _mutmut(work, chosen, log)
    codes = _results(work, target)
    status = {m: codes.get(m) for m in chosen}
    killed = [m for m, c in status.items() if c in KILLED]
    timeout = [m for m, c in status.items() if c in TIMEOUT]
    survived = [m for m, c in status.items() if c in SURVIVED]
    untested = [m for m, c in status.items() if c in NO_TESTS]
    other = [m for m in status if m not in {*killed, *timeout, *survived, *untested}]
    scored = len(killed) + len(timeout) + len(survived)
    return {
        "target": name,
        "files": list(target.files),
        "generated": len(every),
        "run": len(chosen),
        "killed": len(killed),
        "timeout": len(timeout),
        "survived": survived,
        "no_tests": untested,
        "other": other,
        "score": (len(killed) + len(timeout)) / scored if scored else None,
        "seconds": round(time.monotonic() - t0),
        "work": str(work),
    }


def _show(work: Path, mutant: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "mutmut", "show", mutant],
        cwd=work, capture_output=True, text=True, check=False,
    )  # fmt: skip
    return proc.stdout.strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--targets", default=",".join(TARGETS), help="comma-separated")
    parser.add_argument("--max-mutants", type=int, default=60, help="per target; 0: all")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/copytrace-mutation"))
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--show-survivors", action="store_true")
    args = parser.parse_args(argv)
    names = [t.strip() for t in args.targets.split(",") if t.strip()]
    unknown = [t for t in names if t not in TARGETS]
    if unknown:
        parser.error(f"unknown target(s) {unknown}; choose from {sorted(TARGETS)}")
    try:
        import mutmut  # noqa: F401
    except ImportError:
        parser.error("mutmut is not installed: pip install mutmut==3.8.1")
    results = []
    for name in names:
        res = run_target(name, TARGETS[name], args)
        results.append(res)
        score = "n/a" if res["score"] is None else f"{res['score']:.0%}"
        print(
            f"{name:9} {', '.join(res['files'])}: {res['run']} mutants run (of {res['generated']}), killed {res['killed']} + timeout {res['timeout']}, survived "
            f"{len(res['survived'])}, no tests {len(res['no_tests'])}, other "
            f"{len(res['other'])}: score {score} ({res['seconds']} s)",
            flush=True,
        )
        for m in res["survived"]:
            print(f"    survived: {m}")
            if args.show_survivors:
                print("        " + _show(Path(res["work"]), m).replace("\n", "\n        "))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
