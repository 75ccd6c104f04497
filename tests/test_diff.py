"""``copytrace diff`` and ``copytrace check --baseline``: two real traces of one program, before
and after edits made here, compared call site by call site.

The program (``BASE``) runs ``STEPS`` steps (one ``optimizer.step()`` each, so ``STEPS``
steps of work: the empty tail after the last step is not counted). Each function copies its
own float32 10x10 tensor (400 B), so no copy repeats another's source. ``NEW`` is ``BASE``
with three comment lines added at the top (every line moves down by 3) and one edit per
function:

=========  ====================================  =============================================
function   edit                                  per-step delta (exact)
=========  ====================================  =============================================
added      ``y = w.clone()`` added               added site: +1 copy, +400 B
removed    its ``w.clone()`` removed             removed site: -1 copy, -400 B
dtype      ``.to(float64)`` -> ``.to(float16)``  changed: copies 1 -> 1, 800 B -> 200 B: -600 B
old_name   renamed ``new_name``                  unchanged (matched by its text)
dup        its clone line duplicated             the copy of the line added: +1 copy, +400 B
hazard     ``torch.tensor(w)`` added             added: +1 copy, +400 B; hazard
                                                 ``tensor-ctor-copy`` (and the duplicated
                                                 clone is a ``redundant-copy``)
=========  ====================================  =============================================

Totals per step: BASE 4 copies (removed, dtype, old_name, dup), 400 + 800 + 400 + 400 =
2000 B; NEW 6 copies (added, dtype, new_name, dup x2, hazard), 400 + 200 + 400 + 800 + 400
= 2200 B: +2 copies, +200 B.
"""

from __future__ import annotations

import json
import runpy
import warnings
from pathlib import Path

import pytest

import copytrace
from copytrace.analysis.diff import snapshot_sources
from copytrace.cli import main

STEPS = 5
BASE = """import torch


def added(w):
    return w.sum()


def removed(w):
    y = w.clone()
    return y.sum()


def dtype(w):
    return w.to(torch.float64).sum()


def old_name(w):
    return w.clone().sum()


def dup(w):
    a = w.clone()
    return a.sum()


def hazard(w):
    return w.sum()


ws = [torch.randn(10, 10) for _ in range(6)]
opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
for _ in range(STEPS):
    added(ws[0])
    removed(ws[1])
    dtype(ws[2])
    old_name(ws[3])
    dup(ws[4])
    hazard(ws[5])
    opt.step()
""".replace("STEPS", str(STEPS))

EDITS = [
    ("def added(w):\n    return w.sum()", "def added(w):\n    y = w.clone()\n    return y.sum()"),
    ("    y = w.clone()\n    return y.sum()\n\n\ndef dtype", "    return w.sum()\n\n\ndef dtype"),
    ("torch.float64", "torch.float16"),
    ("old_name", "new_name"),
    ("    a = w.clone()\n", "    a = w.clone()\n    a = w.clone()\n"),
    ("def hazard(w):\n    return w.sum()", "def hazard(w):\n    return torch.tensor(w).sum()"),
]


def _new_source(edits: list[tuple[str, str]] = EDITS, shift: bool = True) -> str:
    text = BASE
    for old, new in edits:
        assert old in text, old
        text = text.replace(old, new)
    return ("# one\n# two\n# three\n" if shift else "") + text


def _line(text: str, needle: str, nth: int = 1) -> int:
    hits = [i for i, line in enumerate(text.splitlines(), 1) if needle in line]
    return hits[nth - 1]


def _trace(prog: Path, source: str, out: Path) -> Path:
    """Trace ``source`` run as ``prog`` into ``out``, then keep its source lines as
    ``copytrace run`` does when its program ends."""
    prog.write_text(source, encoding="utf-8")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's own warning against torch.tensor(t)
        with copytrace.trace(out) as t:
            runpy.run_path(str(prog), run_name="__main__")
    assert t.trace_path is not None
    snapshot_sources(t.trace_path)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The BASE trace, the NEW trace (every edit), and GROW (only the added copy, no shift)."""
    root = tmp_path_factory.mktemp("diff")
    prog = root / "prog.py"
    base = _trace(prog, BASE, root / "base")
    grow = _trace(prog, _new_source(EDITS[:1], shift=False), root / "grow")
    # NEW last: its file on disk is NEW's, as after an edit and a run (``removed`` is still
    # defined there, so its lost clone is not taken for ``added``'s under another name)
    new = _trace(prog, _new_source(), root / "new")
    return {"base": base, "new": new, "grow": grow, "prog": prog}


def _json(capsys: pytest.CaptureFixture, *argv: str) -> dict:
    assert main(["diff", *argv, "--json"]) == 0
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return json.loads(out)


def _by_function(items: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for i in items:
        out.setdefault(i["function"], []).append(i)
    return out


def test_diff_json_exact_deltas(runs: dict[str, Path], capsys: pytest.CaptureFixture) -> None:
    d = _json(capsys, str(runs["base"]), str(runs["new"]))
    new_text = _new_source()
    assert (d["base"]["steps"], d["new"]["steps"]) == (STEPS, STEPS)
    assert d["totals"]["copies_per_step"] == {"base": 4, "new": 6, "delta": 2}
    assert d["totals"]["bytes_per_step"] == {"base": 2000, "new": 2200, "delta": 200}
    added = _by_function(d["added"])
    assert sorted(added) == ["added", "dup", "hazard"]
    # the added copy in the loop: line of NEW, 1 copy and 400 B per step
    (a,) = added["added"]
    assert (a["line"], a["code"]) == (_line(new_text, "y = w.clone()"), "y = w.clone()")
    assert a["copies_per_step"] == {"base": 0, "new": 1, "delta": 1}
    assert a["bytes_per_step"] == {"base": 0, "new": 400, "delta": 400}
    assert a["totals"]["bytes"] == {"base": 0, "new": 400 * STEPS, "delta": 400 * STEPS}
    # the duplicated line: its second occurrence is the added one; the first matched
    (dup,) = added["dup"]
    assert dup["line"] == _line(new_text, "a = w.clone()", nth=2)
    assert dup["bytes_per_step"]["delta"] == 400
    (hz,) = added["hazard"]
    assert (hz["code"], hz["copies_per_step"]["delta"]) == ("return torch.tensor(w).sum()", 1)
    # the removed copy: its line in BASE
    (r,) = d["removed"]
    assert (r["function"], r["line"]) == ("removed", _line(BASE, "y = w.clone()"))
    assert r["copies_per_step"] == {"base": 1, "new": 0, "delta": -1}
    assert r["bytes_per_step"] == {"base": 400, "new": 0, "delta": -400}
    # the changed dtype: float64 (8 B x 100) -> float16 (2 B x 100), one copy either way
    (c,) = d["changed"]
    assert (c["function"], c["line"], c["base_line"]) == (
        "dtype", _line(new_text, "torch.float16"), _line(BASE, "torch.float64"))  # fmt: skip
    assert c["copies_per_step"] == {"base": 1, "new": 1, "delta": 0}
    assert c["bytes_per_step"] == {"base": 800, "new": 200, "delta": -600}
    assert set(c["time_per_step_ns"]) == {"base", "new", "delta"}
    # the shifted file and the renamed function: matched, so not listed with an exact change;
    # dup's first line too (their copy time may differ: that is a separate, tested list)
    assert d["unchanged"] + len(d["time_changed"]) == 2
    assert {i["function"] for i in d["time_changed"]} <= {"new_name", "dup"}
    assert all(i["time_test"]["significant"] for i in d["time_changed"])
    codes = {(h["code"], h["function"]) for h in d["hazards"]["added"]}
    assert ("tensor-ctor-copy", "hazard") in codes
    assert {h["code"] for h in d["hazards"]["added"]} == {"tensor-ctor-copy", "redundant-copy"}
    assert d["hazards"]["removed"] == []


def test_diff_terminal_and_markdown(runs: dict[str, Path], capsys: pytest.CaptureFixture) -> None:
    new_text = _new_source()
    assert main(["diff", str(runs["base"]), str(runs["new"])]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1] == ("per step: copies 4 -> 6 (+2), bytes 2.0 KiB -> 2.1 KiB (+200 B), "
                      + out[1].split(", ", 2)[2])  # fmt: skip
    # the label column is as wide as the widest label printed ("time only" rows, which depend
    # on the run's timing, widen it): rows compared with their spaces collapsed
    rows = [" ".join(line.split()) for line in out
            if line.startswith(("added", "removed", "changed"))]  # fmt: skip
    # largest byte change first: the dtype (-600 B), then the 400 B ones
    assert rows[0].startswith(f"changed prog.py:{_line(new_text, 'float16')} dtype (was :"
                              f"{_line(BASE, 'float64')})")  # fmt: skip
    assert len(rows) == 5
    assert any(r.startswith(f"added prog.py:{_line(new_text, 'y = w.clone()')} added")
               and "+400 B (0 B -> 400 B)" in r for r in rows)  # fmt: skip
    assert main(["diff", str(runs["base"]), str(runs["new"]), "--markdown"]) == 0
    md = capsys.readouterr().out
    assert md.startswith("### copytrace diff: call sites 3 added, 1 removed, 1 changed, ")
    assert "| added | `prog.py:" in md and "`y = w.clone()`" in md
    assert "- + tensor-ctor-copy (warning) at prog.py:" in md


def _listed(rows: list[str]) -> str:
    """The counts a headline must give for these rows (each row starts with its label)."""
    labels = ("added", "removed", "changed", "time only")
    return ", ".join(f"{sum(r.startswith(label) for r in rows)} {label}" for label in labels)


def test_diff_headlines_count_the_rows_they_list(
    runs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    # Whether a matched site's copy time changed (a "time only" row) depends on the run's
    # timing: each headline is checked against the rows printed beside it, not a fixed count.
    d = _json(capsys, str(runs["base"]), str(runs["new"]))
    json_rows = [*(["added"] * len(d["added"])), *(["removed"] * len(d["removed"])),
                 *(["changed"] * len(d["changed"])), *(["time only"] * len(d["time_changed"]))]  # fmt: skip
    assert main(["diff", str(runs["base"]), str(runs["new"]), "--markdown"]) == 0
    md = capsys.readouterr().out.splitlines()
    md_rows = [line[2:] for line in md if line.startswith("| ") and "`prog.py:" in line]
    assert md[0] == f"### copytrace diff: call sites {_listed(md_rows)}"
    assert _listed(md_rows) == _listed(json_rows)
    assert len(md_rows) == 5 + len(d["time_changed"])  # 3 added, 1 removed, 1 changed
    assert main(["diff", str(runs["base"]), str(runs["new"])]) == 0
    out = capsys.readouterr().out.splitlines()
    rows = [line for line in out if line.startswith(("added", "removed", "changed", "time"))]
    assert len(rows) == len(md_rows)
    (foot,) = [line for line in out if line.startswith("(call sites: ")]
    assert foot.startswith(f"(call sites: {_listed(rows)}, {d['unchanged']} unchanged; ")
    # NEW adds hazards, listed on the lines under a bare "hazards:" (no trailing space)
    assert "hazards:" in out and not [line for line in out if line.endswith(" ")]
    page = tmp_path / "d.html"
    assert main(["diff", str(runs["base"]), str(runs["new"]), "-o", str(page)]) == 0
    said = capsys.readouterr().out
    assert said == f"copytrace: diff written to {page} (call sites: {_listed(json_rows)})\n"


def test_one_directory_with_two_runs(
    runs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """With one directory of two runs, its last run is compared with the one before."""
    both = tmp_path / "both"
    both.mkdir()
    for side in ("base", "grow"):
        for f in runs[side].glob("*.otlp.jsonl*"):
            (both / f"{side}-{f.name}").write_bytes(f.read_bytes())
    d = _json(capsys, str(both))
    assert [i["function"] for i in d["added"]] == ["added"]
    assert d["totals"]["bytes_per_step"]["delta"] == 400


def _check(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, list[str]]:
    code = main(["check", *argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, err.splitlines()


def test_gate_exit_codes_and_lines(runs: dict[str, Path], capsys: pytest.CaptureFixture) -> None:
    base, grow, new = str(runs["base"]), str(runs["grow"]), str(runs["new"])
    line = _line(_new_source(EDITS[:1], shift=False), "y = w.clone()")
    site = f"{runs['prog']}:{line} added: added, +1 copies, +400 B per step: y = w.clone()"
    # GROW: 4 -> 5 copies (+25%), 2000 -> 2400 B (+20%) per step, no new hazard
    code, err = _check(capsys, grow, "--baseline", base, "--max-increase", "10%")
    assert code == 1
    assert err == [
        f"copytrace check: baseline {base}: copies per step grew from 4 to 5 (+1), over "
        "--max-increase 10%",
        f"copytrace check: baseline {base}: bytes per step grew from 2000 B to 2400 B (+400 B), "
        "over --max-increase 10%",
        f"copytrace check: baseline {base}: {site}",
    ]
    assert _check(capsys, grow, "--baseline", base, "--max-increase", "25%") == (0, [])
    assert _check(capsys, grow, "--baseline", base, "--max-increase", "64KiB") == (0, [])
    assert _check(capsys, grow, "--baseline", base, "--max-increase", "400") == (0, [])
    code, err = _check(capsys, grow, "--baseline", base, "--max-increase", "399")
    assert code == 1 and err[-1] == f"copytrace check: baseline {base}: {site}"
    # NEW: within 64KiB of bytes, but a hazard code BASE did not have fails it
    code, err = _check(capsys, new, "--baseline", base, "--max-increase", "64KiB")
    assert code == 1
    assert any(e.startswith(f"copytrace check: baseline {base}: {runs['prog']}:"
                            f"{_line(_new_source(), 'torch.tensor')} hazard: new hazard "
                            "tensor-ctor-copy (warning)") for e in err)  # fmt: skip


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["check", "{grow}", "--baseline", "{base}", "--max-increase", "ten"],
         "copytrace: error: --max-increase: not a percentage or a size: 'ten' (e.g. 10%, 64KiB)"),
        (["check", "{grow}", "--max-increase", "10%"],
         "copytrace: error: --max-increase needs --baseline BASE"),
        # a negative value after a space reaches the option's check (argparse read it as a flag)
        (["check", "{grow}", "--baseline", "{base}", "--max-increase", "-10%"],
         "copytrace: error: --max-increase: must be >= 0, got '-10%' (a share such as 10% or a "
         "size such as 64KiB)"),
        (["check", "{grow}", "--baseline", "{missing}"], "copytrace: error: "),
        (["diff", "{missing}", "{grow}"], "copytrace: error: "),
        (["diff", "{base}", "{corrupt}"], "copytrace: error: no readable copytrace spans in "),
    ],
)  # fmt: skip
def test_bad_input_one_line_exit_2(
    runs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture,
    argv: list[str], message: str,
) -> None:  # fmt: skip
    corrupt = tmp_path / "bad.otlp.jsonl"
    corrupt.write_text("{not json\n", encoding="utf-8")
    names = {"grow": runs["grow"], "base": runs["base"], "missing": tmp_path / "nope",
             "corrupt": corrupt}  # fmt: skip
    assert main([a.format(**names) for a in argv]) == 2
    out, err = capsys.readouterr()
    assert (out, len(err.splitlines())) == ("", 1)
    assert err.startswith(message), err
