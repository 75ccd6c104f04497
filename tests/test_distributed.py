"""A real 2-rank ``torchrun`` job on CPU (gloo, DistributedDataParallel) under ``COPYTRACE=1``:
both ranks traced with their rank and world size, DDP's own bucket copies visible as
implicit copies, the launcher itself untraced, and one merged report."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch.distributed as dist
from _require import require_or_skip

from copytrace.dashboards import load_trace

if not dist.is_available() or not dist.is_gloo_available():
    require_or_skip("needs torch.distributed + gloo", allow_module_level=True)

DDP_SCRIPT = """
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        loss = model(torch.randn(4, 8) + rank).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    print(f"rank {rank} of {dist.get_world_size()} done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
"""


def _torchrun() -> list[str]:
    exe = Path(sys.executable).with_name("torchrun")
    if exe.is_file():
        return [str(exe)]
    found = shutil.which("torchrun")
    return [found] if found else [sys.executable, "-m", "torch.distributed.run"]


def test_torchrun_two_ranks_ddp_gloo(tmp_path):
    script = tmp_path / "ddp_train.py"
    script.write_text(DDP_SCRIPT)
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COPYTRACE", "OTEL_"))}
    env.update(COPYTRACE="1", COPYTRACE_OUTPUT=str(out), OMP_NUM_THREADS="1",
               GLOO_SOCKET_IFNAME="lo", MASTER_ADDR="127.0.0.1")  # fmt: skip
    proc = subprocess.run(
        [*_torchrun(), "--standalone", "--nproc_per_node=2", str(script)],
        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "rank 0 of 2 done" in proc.stdout and "rank 1 of 2 done" in proc.stdout

    files = sorted(p.name for p in out.glob("copytrace-*.otlp.jsonl*"))
    assert len(files) == 2, files  # the two ranks; the torchrun agent is not traced
    assert any("-rank0." in f for f in files) and any("-rank1." in f for f in files)

    trace = load_trace(out)
    ranks = {}
    for run in trace.runs:
        res = run.resource
        ranks[res["copytrace.rank"]] = run
        assert res["copytrace.world_size"] == 2
        assert run.attrs["copytrace.steps"] >= 3
        # DDP copies each gradient into its communication bucket inside backward, in C++:
        # no API call explains them, so they are implicit aten::copy_ events.
        bucket = [
            e
            for e in run.events
            if e.op == "implicit"
            and e.attrs.get("copytrace.phase") == "backward"
            and "aten::copy_" in e.attrs.get("copytrace.aten", [])
        ]
        assert len(bucket) >= 4 * 3, [(e.op, e.attrs.get("copytrace.phase")) for e in run.events]
    assert sorted(ranks) == [0, 1]

    # One merged report, written once, by the launcher, after both ranks' traces.
    html = (out / "report.html").read_text(encoding="utf-8")
    assert all(f in html for f in files)
    report_lines = [
        ln for ln in proc.stderr.splitlines() if ln.startswith("copytrace:") and "report" in ln
    ]
    assert len(report_lines) == 1, proc.stderr
    assert not list(out.glob(".copytrace-launch-*"))
