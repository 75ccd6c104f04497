"""The pytest plugin: ``@pytest.mark.copytrace(...)`` and the ``copy_budget`` fixture.

Each test writes a small test file and runs pytest on it in this process (``pytester``). The
plugin is loaded explicitly (``-p copytrace.pytest_plugin``) and the installed entry point is
blocked (``-p no:copytrace``), so the tests behave the same whether or not the package's
``pytest11`` entry point is installed.
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

PLUGIN_ARGS = (
    "-p", "no:copytrace", "-p", "copytrace.pytest_plugin",
    # no cache files, no assertion rewriting, no end-of-session gc.collect() passes over
    # torch's big heap, no hypothesis plugin (its summary imports hypothesis, and in-process
    # runs drop what they import): each run then takes a fraction of a second
    "-p", "no:cacheprovider", "-p", "no:unraisableexception", "--assert=plain",
    "-p", "no:hypothesispytest",
)  # fmt: skip

HEADER = """
import copy
import pytest
import torch

"""


@pytest.fixture(scope="module", autouse=True)
def _import_what_tracing_imports() -> None:
    # pytester's in-process runs drop the modules a run imported; torch registers operator
    # libraries on import and refuses a second registration, so import them here first.
    import torch

    import copytrace

    with copytrace.trace(write=False):
        torch.zeros(1).clone()


def run(pytester: pytest.Pytester, source: str, *args: str) -> pytest.RunResult:
    pytester.makepyfile(test_budget=HEADER + source)
    return pytester.runpytest_inprocess(*PLUGIN_ARGS, "--strict-markers", *args)


def at(pytester: pytest.Pytester, text: str, function: str) -> str:
    """``test_budget.py:<line> function`` of the line of the test file containing ``text``."""
    lines = (pytester.path / "test_budget.py").read_text().splitlines()
    (number,) = [i + 1 for i, line in enumerate(lines) if text in line]
    return f"test_budget.py:{number} {function}"


def failure_text(result: pytest.RunResult) -> str:
    """The FAILURES section only: newer pytest repeats whole messages in the short summary."""
    lines = []
    for line in result.outlines:
        if "short test summary info" in line:
            break
        lines.append(line)
    return "\n".join(lines)


def test_marker_within_budget_passes(pytester: pytest.Pytester) -> None:
    result = run(
        pytester,
        """
@pytest.mark.copytrace(max_bytes=64, max_copies=1, forbid="all")
def test_one_copy():
    x = torch.arange(16.0)  # 64 B
    assert x.clone().sum() == 120
""",
    )
    result.assert_outcomes(passed=1)


def test_marker_over_budget_fails_naming_the_call_sites(pytester: pytest.Pytester) -> None:
    source = """
@pytest.mark.copytrace(max_bytes=100, max_copies=1)
def test_two_copies():
    x = torch.arange(16.0)
    a = x.clone()
    b = x.double()
"""
    result = run(pytester, source)
    result.assert_outcomes(failed=1)
    text = failure_text(result)
    assert "copytrace budget exceeded in test_budget.py::test_two_copies:" in text
    assert (
        "bytes allocated 192 B over max-bytes 100 B (2 copies), top call sites: "
        f"{at(pytester, 'x.double()', 'test_two_copies')} (128 B, 1 copy), "
        f"{at(pytester, 'x.clone()', 'test_two_copies')} (64 B, 1 copy)"
    ) in text
    assert "copies 2 over max-copies 1 (192 B)" in text
    assert "Traceback" not in text  # pytrace=False: the message is the report


def test_marker_forbidden_hazard_fails_with_the_fix(pytester: pytest.Pytester) -> None:
    source = """
@pytest.mark.copytrace(forbid=["redundant_copy"])
def test_copies_twice():
    x = torch.arange(16.0)
    a = x.clone()
    b = x.clone()
"""
    result = run(pytester, source)
    result.assert_outcomes(failed=1)
    text = failure_text(result)
    assert (
        f"forbidden hazard redundant-copy (warning) at "
        f"{at(pytester, 'a = x', 'test_copies_twice')}, {at(pytester, 'b = x', 'test_copies_twice')}"
        ": the same unchanged source (float32 16)"
    ) in text
    assert "fix: Make the copy once per step and reuse it." in text


def test_fail_on_severity_and_per_step_limits(pytester: pytest.Pytester) -> None:
    result = run(
        pytester,
        """
@pytest.mark.copytrace(fail_on="error", max_copies_per_step=1)
def test_warning_only_one_copy_per_step():
    x = torch.arange(4.0)
    with torch.no_grad():
        a = x.clone(); b = x.clone()  # a warning (redundant-copy) and 2 copies in step 0

@pytest.mark.copytrace(fail_on="warning")
def test_warning_fails():
    x = torch.arange(4.0)
    a = x.clone(); b = x.clone()
""",
    )
    result.assert_outcomes(failed=2)
    text = failure_text(result)
    assert "copies per step over max-copies-per-step 1 in 1 of 1 step(s)" in text
    assert "forbidden hazard redundant-copy" in text
    assert text.count("forbidden hazard") == 1  # fail_on="error" ignores the warning


def test_fixture_counts_only_the_block(pytester: pytest.Pytester) -> None:
    source = """
def test_block_within(copy_budget):
    x = torch.arange(16.0)
    before = x.clone()  # outside the block: not counted
    with copy_budget(max_copies=1, forbid="all") as block:
        y = x.double()
    assert [e.op for e in block.events] == ["double"] and block.findings == []

def test_block_over(copy_budget):
    x = torch.arange(16.0)
    with copy_budget(max_bytes=0):
        z = x.double()
"""
    result = run(pytester, source)
    result.assert_outcomes(passed=1, failed=1)
    text = failure_text(result)
    assert "copytrace budget exceeded in test_budget.py::test_block_over:" in text
    assert f"{at(pytester, 'z = x', 'test_block_over')} (128 B, 1 copy)" in text


def test_failing_test_is_reported_as_it_is(pytester: pytest.Pytester) -> None:
    result = run(
        pytester,
        """
@pytest.mark.copytrace(max_copies=0)
def test_fails_by_itself():
    torch.arange(4.0).clone()
    assert 1 == 2
""",
    )
    result.assert_outcomes(failed=1)
    text = failure_text(result)
    assert "assert 1 == 2" in text and "copytrace budget" not in text


def test_unknown_limit_is_a_usage_error(pytester: pytest.Pytester) -> None:
    result = run(
        pytester,
        """
@pytest.mark.copytrace(max_megabytes=1)
def test_typo():
    pass
""",
    )
    assert result.ret != 0
    assert "unknown limit(s) max_megabytes" in failure_text(result) + "\n".join(result.errlines)


def test_marker_is_registered(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_m="")
    result = pytester.runpytest_inprocess(*PLUGIN_ARGS, "--markers")
    assert any(line.startswith("@pytest.mark.copytrace(") for line in result.outlines)


def test_entry_point_is_declared() -> None:
    if sys.version_info < (3, 11):
        pytest.skip("tomllib needs Python 3.11")
    import tomllib

    meta = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    target = meta["project"]["entry-points"]["pytest11"]["copytrace"]
    assert target == "copytrace.pytest_plugin"
    module = importlib.import_module(target)
    assert hasattr(module, "pytest_runtest_call") and hasattr(module, "copy_budget")
    assert "torch" not in module.__dict__  # importing the plugin costs other suites nothing


BASELINE_TEST = """
@pytest.mark.copytrace
def test_step():
    x = torch.arange(16.0)  # 64 B
    y = x.clone()
    assert y.sum() == 120
"""


def test_baseline_record_fail_update_pass(pytester: pytest.Pytester) -> None:
    """The baseline flow twice over: record, compare, a copy added fails naming its line,
    update, compare again."""
    base = ("--copytrace-baseline", "baseline")
    result = run(pytester, BASELINE_TEST, *base, "--copytrace-baseline-update")
    result.assert_outcomes(passed=1)
    assert any("copytrace: wrote 1 baseline(s) to" in line for line in result.outlines)
    (stored,) = (pytester.path / "baseline").glob("*.json")
    data = json.loads(stored.read_text())
    # one site, recorded relative to the rootdir: the clone of 16 float32 (64 B)
    assert data["test"] == "test_budget.py::test_step"
    assert [(s["file"], s["code"], s["copies"], s["bytes"]) for s in data["sites"]] == [
        ("test_budget.py", "y = x.clone()", 1, 64)]  # fmt: skip
    run(pytester, BASELINE_TEST, *base).assert_outcomes(passed=1)
    # a comment line on top moves every line (matched by text); a second copy is added
    grown = "# moved\n" + BASELINE_TEST.replace(
        "    y = x.clone()\n", "    y = x.clone()\n    z = x.double()  # 128 B\n")  # fmt: skip
    result = run(pytester, grown, *base)
    result.assert_outcomes(failed=1)
    text = failure_text(result)
    assert f"copytrace baseline exceeded in test_budget.py::test_step (baseline {stored}):" in text
    # per step (one step): copies 1 -> 2, bytes 64 -> 64 + 128 = 192
    assert "  copies per step grew from 1 to 2 (+1), over --max-increase 0%" in text
    assert "  bytes per step grew from 64 B to 192 B (+128 B), over --max-increase 0%" in text
    site = at(pytester, "z = x.double()", "test_step")
    assert f"  {site}: added, +1 copies, +128 B per step: z = x.double()  # 128 B" in text
    assert "y = x.clone()" not in text  # the moved clone is matched, not added
    # a 200% allowance: 192 <= 64 * 3 passes; 199% does not
    run(pytester, grown, *base, "--copytrace-max-increase", "200%").assert_outcomes(passed=1)
    run(pytester, grown, *base, "--copytrace-max-increase", "199%").assert_outcomes(failed=1)
    run(pytester, grown, *base, "--copytrace-baseline-update").assert_outcomes(passed=1)
    assert [s["bytes"] for s in json.loads(stored.read_text())["sites"]] == [64, 128]
    run(pytester, grown, *base).assert_outcomes(passed=1)


def test_baseline_missing_and_bad_options(pytester: pytest.Pytester) -> None:
    result = run(pytester, BASELINE_TEST, "--copytrace-baseline", "nowhere")
    result.assert_outcomes(passed=1)
    assert any("copytrace: 1 marked test(s) have no baseline in" in line
               and line.endswith("test_budget.py::test_step") for line in result.outlines)  # fmt: skip
    result = run(pytester, BASELINE_TEST, "--copytrace-baseline-update")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "--copytrace-baseline-update needs --copytrace-baseline DIR" in "\n".join(
        result.errlines)  # fmt: skip
    result = run(pytester, BASELINE_TEST, "--copytrace-baseline", "b",
                 "--copytrace-max-increase", "ten")  # fmt: skip
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "--copytrace-max-increase: not a percentage or a size: 'ten'" in "\n".join(
        result.errlines)  # fmt: skip


def test_byte_limits_take_the_cli_byte_strings(pytester: pytest.Pytester) -> None:
    # one float32 copy of 2048 elements = 8192 bytes: over "4KiB" (4096), within "64MiB"
    result = run(
        pytester,
        """
@pytest.mark.copytrace(max_bytes="64MiB")
def test_within():
    torch.zeros(2048).clone()

@pytest.mark.copytrace(max_bytes="4KiB")
def test_over():
    torch.zeros(2048).clone()
""",
    )
    result.assert_outcomes(passed=1, failed=1)
    over = "bytes allocated 8192 B (8.0 KiB) over max-bytes 4096 B (4.0 KiB)"
    assert over in failure_text(result)


@pytest.mark.parametrize(
    ("limit", "said"),
    [
        ('max_bytes="4 parsecs"', "not a byte count: '4 parsecs'"),
        ('max_copies="two"', "max_copies takes a count >= 0, got 'two'"),
        ('forbid=["no-such-hazard"]', "no-such-hazard"),
    ],
)
def test_bad_limit_is_one_usage_line_before_any_test_runs(
    pytester: pytest.Pytester, limit: str, said: str
) -> None:
    result = run(
        pytester,
        f"""
def test_first():
    pass

@pytest.mark.copytrace({limit})
def test_bad():
    pass
""",
    )
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    errors = [line for line in result.errlines if line.startswith("ERROR:")]
    assert len(errors) == 1 and said in errors[0], result.errlines
    assert "test_budget.py::test_bad" in errors[0]
    assert "Traceback" not in "\n".join(result.errlines + result.outlines)
    result.assert_outcomes()  # nothing ran


def test_fixture_bad_limit_fails_before_the_block(pytester: pytest.Pytester) -> None:
    result = run(
        pytester,
        """
ran = []

def test_block(copy_budget):
    with copy_budget(max_bytes_per_step="lots"):
        ran.append(1)
""",
    )
    assert result.ret != 0
    assert "not a byte count: 'lots'" in "\n".join(result.outlines + result.errlines)
