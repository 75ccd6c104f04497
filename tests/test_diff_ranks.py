"""``copytrace diff RUN --ranks`` on a real 2-rank ``torchrun`` job (CPU, gloo) under
``COPYTRACE=1``, launched as ``tests/test_distributed.py`` launches it.

Each of ``STEPS`` optimizer steps, both ranks clone a float32 10x10 tensor (400 B) and
all-reduce it in place; rank 1 also converts a float32 512x512 tensor to float64
(512 * 512 * 8 = 2097152 B), so it is the straggler: per step rank 0 makes 1 copy of 400 B,
rank 1 makes 2 copies of 400 + 2097152 = 2097552 B.

Copies and bytes are exact; copy time is not. Which rank is the slowest (the most copy time
per step) is a timing fact: rank 1's extra 2 MiB conversion usually makes it rank 1, but on a
loaded machine a descheduled clone can make rank 0's copy time the larger. The tests read
each rank's copy time from the trace and derive from it the slowest rank, the median rank it
is compared with, and which side of that comparison the conversion is on.
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
from fractions import Fraction
from pathlib import Path

import pytest
from test_distributed import _torchrun

from copytrace.analysis.diff import number
from copytrace.cli import main

STEPS = 6
PROGRAM = """
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
w = torch.ones(10, 10)
big = torch.ones(512, 512)
opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
for _ in range(STEPS):
    a = w.clone()
    if rank == 1:
        b = big.double()
    dist.all_reduce(a)
    opt.step()
dist.destroy_process_group()
""".replace("STEPS", str(STEPS))
RANK1_BYTES = 400 + 512 * 512 * 8


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("ranks")
    (root / "prog.py").write_text(PROGRAM, encoding="utf-8")
    out = root / "out"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COPYTRACE", "OTEL_"))}
    env.update(COPYTRACE="1", COPYTRACE_OUTPUT=str(out), OMP_NUM_THREADS="1",
               GLOO_SOCKET_IFNAME="lo", MASTER_ADDR="127.0.0.1")  # fmt: skip
    proc = subprocess.run(
        [*_torchrun(), "--standalone", "--nproc_per_node=2", "prog.py"],
        capture_output=True, text=True, cwd=root, env=env, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert len(list(out.glob("copytrace-*-rank*.otlp.jsonl*"))) == 2
    return out


def _program_line(needle: str) -> int:
    return next(i for i, line in enumerate(PROGRAM.splitlines(), 1) if needle in line)


def _ranks_json(run_dir: Path, capsys: pytest.CaptureFixture) -> dict:
    assert main(["diff", str(run_dir), "--ranks", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _copy_times(d: dict) -> dict[str, Fraction]:
    """Each rank's copy time per step (ns, exact), summed from its steps' recorded times."""
    return {r["rank"]: Fraction(sum(s["time_ns"] for s in r["per_step"]), r["steps"])
            for r in d["ranks"]}  # fmt: skip


def _slowest_and_median(times: dict[str, Fraction]) -> tuple[str, str]:
    """The slowest rank (the most copy time per step; the lower rank on a tie) and, of two
    ranks, the other one (the median of the rest)."""
    slow = max(times, key=lambda r: (times[r], -int(r)))
    (median,) = [r for r in times if r != slow]
    return slow, median


def test_ranks_json(run_dir: Path, capsys: pytest.CaptureFixture) -> None:
    d = _ranks_json(run_dir, capsys)
    got = [(r["rank"], r["steps"], r["copies_per_step"], r["bytes_per_step"]) for r in d["ranks"]]
    assert got == [("0", STEPS, 1, 400), ("1", STEPS, 2, RANK1_BYTES)]
    assert [s["bytes"] for s in d["ranks"][1]["per_step"]] == [RANK1_BYTES] * STEPS
    times = _copy_times(d)
    # every step's copy time was measured (each step makes at least one copy)
    assert all(s["time_ns"] > 0 for r in d["ranks"] for s in r["per_step"])
    assert [r["time_per_step_ns"] for r in d["ranks"]] == [number(times[r]) for r in ("0", "1")]
    slow, median = _slowest_and_median(times)
    assert d["slowest"] == {"rank": slow, "time_per_step_ns": number(times[slow])}
    # max / median over 2 ranks: copies 2 / 1.5; bytes 2 * 2097552 / (400 + 2097552);
    # copy time: the slowest's over the mean of the two
    assert d["imbalance"]["copies_per_step"] == 1.333
    assert d["imbalance"]["bytes_per_step"] == round(2 * RANK1_BYTES / (400 + RANK1_BYTES), 3)
    assert d["imbalance"]["time_per_step_ns"] == round(
        float(2 * times[slow] / (times["0"] + times["1"])), 3)  # fmt: skip
    against = d["against"]
    assert (against["base_rank"], against["new_rank"]) == (median, slow)
    # rank 1's conversion: added when rank 1 is the slowest (compared against rank 0),
    # removed when rank 0 is
    side, other = ("added", "removed") if slow == "1" else ("removed", "added")
    assert against["diff"][other] == []
    (conversion,) = against["diff"][side]
    assert (conversion["line"], conversion["code"]) == (_program_line("big.double()"),
                                                       "b = big.double()")  # fmt: skip
    converted = {"1": 512 * 512 * 8, "0": 0}
    assert conversion["bytes_per_step"] == {"base": converted[median], "new": converted[slow],
                                            "delta": converted[slow] - converted[median]}  # fmt: skip
    # the clone: the same bytes on both ranks, so unchanged or, if its copy time differs
    # between the ranks, "time only"
    assert against["diff"]["changed"] == []
    assert against["diff"]["unchanged"] + len(against["diff"]["time_changed"]) == 1


def test_ranks_terminal(run_dir: Path, capsys: pytest.CaptureFixture) -> None:
    slow, median = _slowest_and_median(_copy_times(_ranks_json(run_dir, capsys)))
    assert main(["diff", str(run_dir), "--ranks"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"copytrace diff --ranks: {run_dir} (2 rank(s))"
    assert lines[1].split() == ["rank", "steps", "copies/step", "bytes/step", "copy", "time/step"]
    assert lines[2].split()[:5] == ["0", str(STEPS), "1", "400", "B"]
    assert lines[3].split()[:5] == ["1", str(STEPS), "2", "2.0", "MiB"]
    # the slowest rank's row, and only it, is marked
    assert [line.endswith("<- slowest") for line in lines[2:4]] == [slow == "0", slow == "1"]
    assert lines[4].startswith("imbalance (max/median over ranks): copies 1.33, bytes 2.00, ")
    assert lines[6].split() == ["step", "rank", "0", "rank", "1", "max/median"]
    assert len([line for line in lines if line.startswith("  ") and line.split()[0].isdigit()]) \
        == STEPS  # fmt: skip
    assert f"slowest rank {slow} against rank {median} (the median):" in lines
    # the label column is as wide as its widest label: "time only" when the clone's copy time
    # differs between the ranks, so the spaces after the label vary from run to run
    label = "added" if slow == "1" else "removed"
    assert any(line.split()[:2] == [label, f"prog.py:{_program_line('big.double()')}"]
               and "b = big.double()" in line for line in lines)  # fmt: skip


def _stretch_clones(run_dir: Path, into: Path, rank: str, by_ns: int) -> None:
    """Copy the run's trace files (and sources kept) into ``into``, each of ``rank``'s clone
    spans ``by_ns`` longer, as a loaded machine stretches a copy; without the columnar
    sidecar, so the JSON is read."""
    cache = into / ".copytrace-cache"
    cache.mkdir(parents=True)
    for src in run_dir.glob("copytrace-*.otlp.jsonl.gz"):
        lines = gzip.decompress(src.read_bytes()).decode().splitlines()
        if src.name.endswith(f"-rank{rank}.otlp.jsonl.gz"):
            for k, line in enumerate(lines):
                req = json.loads(line)
                for rs in req["resourceSpans"]:
                    for ss in rs["scopeSpans"]:
                        for span in ss["spans"]:
                            if span["name"] == "copytrace.clone":
                                span["endTimeUnixNano"] = str(int(span["endTimeUnixNano"]) + by_ns)
                lines[k] = json.dumps(req)
        (into / src.name).write_bytes(gzip.compress(("\n".join(lines) + "\n").encode()))
        kept = run_dir / ".copytrace-cache" / f"{src.name}.sources.json"
        if kept.is_file():  # kept by an earlier diff; else the diff reads prog.py itself
            (cache / kept.name).write_bytes(kept.read_bytes())


def test_ranks_when_rank_0_copies_slowest(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """The comparison the other way round, made certain: rank 0's clone (one per step)
    stretched by more than rank 1's whole copy time makes rank 0 the slowest; it is then
    compared against rank 1, where the conversion is removed."""
    base = _ranks_json(run_dir, capsys)
    times = _copy_times(base)
    # longer than all of rank 1's copies together: every stretched clone outlasts every copy
    # of rank 1 (so the clone's copy-time change is certain too)
    by_ns = sum(s["time_ns"] for s in base["ranks"][1]["per_step"]) + 1_000_000
    slow_dir = tmp_path / "rank0-slow"
    _stretch_clones(run_dir, slow_dir, "0", by_ns)
    d = _ranks_json(slow_dir, capsys)
    stretched = _copy_times(d)
    assert stretched == {"0": times["0"] + by_ns, "1": times["1"]}
    assert _slowest_and_median(stretched) == ("0", "1")
    assert d["slowest"] == {"rank": "0", "time_per_step_ns": number(stretched["0"])}
    against = d["against"]
    assert (against["base_rank"], against["new_rank"]) == ("1", "0")
    (removed,) = against["diff"]["removed"]
    assert removed["code"] == "b = big.double()"
    assert removed["bytes_per_step"] == {"base": 512 * 512 * 8, "new": 0, "delta": -512 * 512 * 8}
    # rank 0's clone now takes over 1 ms more in every step: a copy-time change of the clone
    (clone,) = against["diff"]["time_changed"]
    assert clone["code"] == "a = w.clone()" and clone["time_test"]["significant"]
    assert main(["diff", str(slow_dir), "--ranks"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.endswith("<- slowest") for line in lines[2:4]] == [True, False]
    assert "slowest rank 0 against rank 1 (the median):" in lines
    assert any(line.split()[:2] == ["removed", f"prog.py:{_program_line('big.double()')}"]
               for line in lines)  # fmt: skip


def test_ranks_bad_input(run_dir: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["diff", str(run_dir), str(run_dir), "--ranks"]) == 2
    out, err = capsys.readouterr()
    assert (out, err) == ("", "copytrace: error: --ranks compares the ranks of one run: no NEW\n")
