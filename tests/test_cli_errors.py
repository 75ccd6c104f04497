"""Command-line mistakes (a wrong flag, a missing argument, a bad value) are one line on
stderr naming the (sub)command, and exit status 2: the real ``copytrace`` command."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def _copytrace(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("COPYTRACE")}
    return subprocess.run(
        [sys.executable, "-m", "copytrace", *args],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip


@pytest.mark.parametrize(
    "args, line",
    [
        (("run", "--bogus", "x.py"),
         "copytrace run: error: unrecognized arguments: --bogus (see copytrace run --help)"),
        (("--bogus", "report", "t"),
         "copytrace: error: unrecognized arguments: --bogus (see copytrace --help)"),
        # an unknown flag alone: the flag is named, not the missing command
        (("--bogus",),
         "copytrace: error: unrecognized arguments: --bogus (see copytrace --help)"),
        (("report", "t", "--bogus", "-x"),
         "copytrace report: error: unrecognized arguments: --bogus -x "
         "(see copytrace report --help)"),
        (("summary", "t", "--top", "many"),
         "copytrace summary: error: argument --top: invalid int value: 'many' "
         "(see copytrace summary --help)"),
        (("diff",),
         "copytrace diff: error: the following arguments are required: BASE "
         "(see copytrace diff --help)"),
        (("bogus",),
         "copytrace: error: argument COMMAND: invalid choice: 'bogus' (choose from 'run', "
         "'report', 'summary', 'check', 'diff', 'fix', 'export', 'doctor', 'trigger') "
         "(see copytrace --help)"),
        # py-spy takes 0 and -5 and fails only after the program ran: refused before it
        (("run", "--py-spy", "--py-spy-rate", "0", "x.py"),
         "copytrace run: error: argument --py-spy-rate: must be >= 1, got 0 "
         "(see copytrace run --help)"),
        (("run", "--py-spy-rate=-5", "x.py"),
         "copytrace run: error: argument --py-spy-rate: must be >= 1, got -5 "
         "(see copytrace run --help)"),
        # os.kill reads 0 and a negative pid as process groups: refused as no process id
        (("trigger", "--", "-5"),
         "copytrace trigger: error: argument PID: not a process id: '-5' "
         "(see copytrace trigger --help)"),
        (("trigger", "0"),
         "copytrace trigger: error: argument PID: not a process id: '0' "
         "(see copytrace trigger --help)"),
        (("run", "--py-spy-rate", "fast", "x.py"),
         "copytrace run: error: argument --py-spy-rate: not a whole number: 'fast' "
         "(see copytrace run --help)"),
        (("fix", "t", "--bogus", "--", "python", "train.py", "--lr", "1"),
         "copytrace fix: error: unrecognized arguments: --bogus (see copytrace fix --help)"),
    ],
)  # fmt: skip
def test_a_usage_error_is_one_line_naming_the_command(args: tuple[str, ...], line: str) -> None:
    proc = _copytrace(*args)
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.splitlines() == [line]


def test_the_programs_own_flags_are_not_copytraces(tmp_path) -> None:
    # after the script, flags are the program's: copytrace run passes them on
    (tmp_path / "prog.py").write_text("import sys\nprint(sys.argv[1:])\n")
    proc = subprocess.run(
        [sys.executable, "-m", "copytrace", "run", "--no-report", "-o", str(tmp_path / "o"),
         str(tmp_path / "prog.py"), "--bogus"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0] == "['--bogus']"


#: every subcommand (``copytrace --help`` lists them; the test below checks it is all of them)
COMMANDS = ("run", "report", "summary", "check", "diff", "fix", "export", "doctor", "trigger")


def test_help_is_plain_text():
    # the descriptions are the subcommands' docstrings: their reStructuredText markup
    # (``literal``, :class:`...`, "Usage::") is taken out of every help text
    top = _copytrace("--help")
    assert top.returncode == 0, top.stderr
    listed = top.stdout.split("positional arguments:")[1].split("options:")[0]
    assert [c for c in COMMANDS if f"\n    {c} " in listed] == list(COMMANDS)
    # each subcommand's line in the list is its one-sentence summary, not its whole docstring
    assert "\n    fix       propose the code change for each finding that has a mechanical\n" \
           "              fix, as a unified diff\n" in listed  # fmt: skip
    assert "Usage" not in listed
    helps = {"": top.stdout}
    for command in COMMANDS:
        proc = _copytrace(command, "--help")
        assert proc.returncode == 0, proc.stderr
        helps[command] = proc.stdout
    for command, text in helps.items():
        for markup in ("``", ":class:", ":func:", ":mod:", ":attr:", ":data:", "::\n"):
            assert markup not in text, (command, markup)
    # the literals stay, without their backquotes
    assert "(COPYTRACE_TRIGGER=signal)" in helps["trigger"]
    assert "\nUsage:\n\n    copytrace fix TRACE [--code CODES]" in helps["fix"]


def test_plain_takes_out_roles_literals_and_block_markers():
    from copytrace.cli import plain

    text = "See :class:`copytrace.Trace` and :func:`~copytrace.fixes.plan_fixes`.\nUsage::\n"
    assert plain(text) == "See copytrace.Trace and plan_fixes.\nUsage:\n"
    assert plain("``--steps N``, else\n``a\nb``") == "--steps N, else\na\nb"


def test_top_level_help_gives_each_command_one_short_line() -> None:
    # `copytrace --help` lists each command with the first paragraph of its doc, not the whole
    # doc (fix's printed its Usage:: block and export's its column notes there)
    from copytrace.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    helps = {choice.dest: choice.help for choice in sub._choices_actions}
    assert helps["fix"] == (
        "propose the code change for each finding that has a mechanical fix, as a unified diff"
    )
    assert helps["export"] == (
        "write a trace's events as one Parquet file, a Hive-partitioned Parquet dataset, "
        "or a Chrome trace for Perfetto"
    )
    for name, text in helps.items():
        assert "\n" not in text and "``" not in text, name
        assert text[:1].islower() and not text.endswith("."), name


def test_a_commands_help_keeps_its_paragraphs() -> None:
    # export's doc has one paragraph per output form; argparse's default formatter ran them
    # together into one block ("... Perfetto. --parquet OUT: the columnar ...")
    from copytrace.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    text = sub.choices["export"].format_help()
    for form in ("--parquet OUT:", "--dataset OUT:", "--chrome-trace OUT.json:"):
        assert f"\n\n{form}" in text, form
    assert "Perfetto.\n\n--parquet OUT:" in text
