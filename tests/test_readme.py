"""Every command the README shows works on its example, and its samples are what they show.

The commands are read from README.md itself and run verbatim, in order, once per session
(``tests/_readme_run.py``, shared with ``tests/test_fix_example.py``, which checks the example's
fix on the same run).

The README's complete program (a ``python`` block that starts with an import, followed by its
output) is run as ``train.py`` and must print exactly the output shown. The call sites in the
sample output must name the lines of ``examples/train_charlm.py`` as it is today, and every
relative link of the README and of ``docs/`` must reach a file and, with ``#``, a heading.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from _readme_run import BLOCK as _BLOCK
from _readme_run import README, ROOT, STEPS, readme_commands, readme_run
from _readme_run import env as _readme_env
from _readme_run import readme as _readme

#: The house limit on the newcomer's page (its depth lives in docs/).
README_MAX_BYTES = 15_000


def readme_programs(text: str) -> list[tuple[str, str]]:
    """``(program, output)`` for each ``python`` block that is a whole program (its first line
    is an import) and is followed directly by an untagged block: the output it prints."""
    programs = []
    for m in _BLOCK.finditer(text):
        lang, body = m.group(1), m.group(2)
        if lang != "python" or not body.startswith(("import ", "from ")):
            continue
        nxt = _BLOCK.match(text, m.end() + 1)  # one blank line between the two blocks
        if nxt is not None and nxt.group(1) == "":
            programs.append((body, nxt.group(2)))
    return programs


def test_readme_is_a_newcomers_page():
    size = len(README.read_bytes())
    assert size <= README_MAX_BYTES, f"README.md is {size} bytes; move depth to docs/"


def test_readme_commands_are_found():
    commands = readme_commands(_readme())
    # One of each kind the README shows (derived by reading it): the set-up's traced run,
    # the hook with and without an output directory, run with arguments and with py-spy,
    # report, summary and check; two runs compared (diff, check --baseline) and fix; then a
    # finding of the example patched end to end (verify, apply, trace again, check).
    assert commands == [
        "copytrace run examples/train_charlm.py",
        "COPYTRACE=1 python examples/train_charlm.py",
        "COPYTRACE=1 COPYTRACE_OUTPUT=runs/ct python examples/train_charlm.py",
        "copytrace run examples/train_charlm.py --seed 1",
        "copytrace run --py-spy examples/train_charlm.py",
        "copytrace report copytrace-out -o report.html",
        "copytrace summary copytrace-out",
        "copytrace check copytrace-out --max-bytes-per-step 64MiB --max-copies-per-step 100 "
        "--forbid data-inplace",
        "COPYTRACE_OUTPUT=base-out copytrace run examples/train_charlm.py",
        "COPYTRACE_OUTPUT=new-out copytrace run examples/train_charlm.py",
        "copytrace diff base-out new-out",
        "copytrace check new-out --baseline base-out --max-increase 10%",
        "copytrace fix new-out",
        "copytrace fix copytrace-out --verify -- python examples/train_charlm.py",
        "copytrace fix copytrace-out --apply",
        "COPYTRACE_OUTPUT=fixed-out copytrace run examples/train_charlm.py",
        "copytrace check fixed-out --forbid tensor-ctor-copy",
    ]


def test_every_readme_command_works_on_the_example(tmp_path_factory):
    run = readme_run(tmp_path_factory)
    assert run.commands == readme_commands(_readme())
    failure = run.failure()
    assert failure is None, failure
    for command, proc in run.procs.items():
        if command.startswith(("copytrace run", "COPYTRACE=1")):
            assert f"final: step={STEPS}" in proc.stdout, command
    assert (run.cwd / "report.html").is_file()
    assert (run.cwd / "copytrace-out" / "report.html").is_file()
    assert list((run.cwd / "runs" / "ct").glob("copytrace-*.otlp.jsonl.gz"))


def test_readme_program_prints_the_output_shown(tmp_path):
    programs = readme_programs(_readme())
    assert len(programs) == 1  # the context manager's example
    program, shown = programs[0]
    (tmp_path / "train.py").write_text(program, encoding="utf-8")
    proc = subprocess.run(
        [sys.executable, "train.py"], cwd=tmp_path, env=_readme_env(), capture_output=True,
        text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    # The README shortens the paths of the call sites to the script's own name.
    printed = proc.stdout.replace(f"{tmp_path}{os.sep}", "")
    assert printed == shown
    assert (tmp_path / "report.html").is_file()
    assert list((tmp_path / "copytrace-out").glob("copytrace-*.otlp.jsonl.gz"))


def test_sample_call_sites_name_the_example_as_it_is():
    """``train_charlm.py:211 main  | best_state = ...``: line 211 of the example holds that
    source (the summary prints the call site's line, stripped and cut to fit)."""
    example = (ROOT / "examples" / "train_charlm.py").read_text(encoding="utf-8").splitlines()
    sites = re.findall(r"train_charlm\.py:(\d+) \w+\s+\| (.+)$", _readme(), flags=re.M)
    assert len(sites) >= 3
    for line, source in sites:
        source = source.rstrip().removesuffix("...").removesuffix("…")
        assert example[int(line) - 1].strip().startswith(source), (line, source)


def _slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces to -."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = _BLOCK.sub("", path.read_text(encoding="utf-8"))
    return {_slug(h) for h in re.findall(r"^#+ (.+)$", text, flags=re.M)}


@pytest.mark.parametrize(
    "page", [README, *sorted((ROOT / "docs").glob("*.md"))], ids=lambda p: p.name
)
def test_relative_links_reach_their_target(page):
    text = _BLOCK.sub("", page.read_text(encoding="utf-8"))
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue  # an absolute URL
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        assert dest.exists(), f"{page.name}: {target}"
        if anchor:
            assert anchor in _anchors(dest), f"{page.name}: {target}"


def test_readme_screenshot_is_small():
    shot = ROOT / "docs" / "img" / "report.png"
    assert f"]({shot.relative_to(ROOT).as_posix()})" in _readme()
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert shot.stat().st_size < 200_000


def test_merged_trace_picture_is_small():
    # drawn by docs/img/make_merged_trace.py from the example's merged Chrome trace
    shot = ROOT / "docs" / "img" / "merged-trace.png"
    production = (ROOT / "docs" / "production.md").read_text(encoding="utf-8")
    assert "](img/merged-trace.png)" in production
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert shot.stat().st_size < 200_000
