"""``copytrace diff RUN --ranks`` on a real 2-rank ``torchrun`` job (CPU, gloo) under
``COPYTRACE=1``, launched as ``tests/test_distributed.py`` launches it.

Each of ``STEPS`` optimizer steps, both ranks clone a float32 10x10 tensor (400 B) and
all-reduce it in place; rank 1 also converts a float32 512x512 tensor to float64
(512 * 512 * 8 = 2097152 B), so it is the straggler: per step rank 0 makes 1 copy of 400 B,
rank 1 makes 2 copies of 400 + 2097152 = 2097552 B.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from test_distributed import _torchrun

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


def test_ranks_json(run_dir: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["diff", str(run_dir), "--ranks", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    got = [(r["rank"], r["steps"], r["copies_per_step"], r["bytes_per_step"]) for r in d["ranks"]]
    assert got == [("0", STEPS, 1, 400), ("1", STEPS, 2, RANK1_BYTES)]
    assert [s["bytes"] for s in d["ranks"][1]["per_step"]] == [RANK1_BYTES] * STEPS
    # rank 1's 2 MiB conversion outweighs rank 0's 400 B clone in every step
    assert d["slowest"]["rank"] == "1"
    # max / median over 2 ranks: copies 2 / 1.5; bytes 2 * 2097552 / (400 + 2097552)
    assert d["imbalance"]["copies_per_step"] == 1.333
    assert d["imbalance"]["bytes_per_step"] == round(2 * RANK1_BYTES / (400 + RANK1_BYTES), 3)
    assert d["imbalance"]["time_per_step_ns"] > 1
    against = d["against"]
    assert (against["base_rank"], against["new_rank"]) == ("0", "1")
    (added,) = against["diff"]["added"]
    assert (added["line"], added["code"]) == (_program_line("big.double()"), "b = big.double()")
    assert added["bytes_per_step"] == {"base": 0, "new": 512 * 512 * 8, "delta": 512 * 512 * 8}
    assert against["diff"]["unchanged"] + len(against["diff"]["time_changed"]) == 1  # the clone


def test_ranks_terminal(run_dir: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["diff", str(run_dir), "--ranks"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"copytrace diff --ranks: {run_dir} (2 rank(s))"
    assert lines[1].split() == ["rank", "steps", "copies/step", "bytes/step", "copy", "time/step"]
    assert lines[2].split()[:5] == ["0", str(STEPS), "1", "400", "B"]
    assert lines[3].split()[:5] == ["1", str(STEPS), "2", "2.0", "MiB"]
    assert lines[3].endswith("<- slowest") and not lines[2].endswith("<- slowest")
    assert lines[4].startswith("imbalance (max/median over ranks): copies 1.33, bytes 2.00, ")
    assert lines[6].split() == ["step", "rank", "0", "rank", "1", "max/median"]
    assert len([line for line in lines if line.startswith("  ") and line.split()[0].isdigit()]) \
        == STEPS  # fmt: skip
    assert "slowest rank 1 against rank 0 (the median):" in lines
    # the label column is as wide as its widest label: "time only" when the clone's copy time
    # differs between the ranks, so the spaces after "added" vary from run to run
    assert any(line.split()[:2] == ["added", f"prog.py:{_program_line('big.double()')}"]
               and "b = big.double()" in line for line in lines)  # fmt: skip


def test_ranks_bad_input(run_dir: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["diff", str(run_dir), str(run_dir), "--ranks"]) == 2
    out, err = capsys.readouterr()
    assert (out, err) == ("", "copytrace: error: --ranks compares the ranks of one run: no NEW\n")
