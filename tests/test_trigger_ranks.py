"""``copytrace trigger --all-ranks`` on a real 2-rank ``torchrun`` job (CPU, gloo, DDP) under
``COPYTRACE=1 COPYTRACE_TRIGGER=signal``: the torchrun launcher's pid is enough to signal both
ranks; each rank traces exactly the next N steps, and the job's stdout is unchanged."""

from __future__ import annotations

import gzip
import json
import os
import queue
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch.distributed as dist
from _require import require_or_skip

if not dist.is_available() or not dist.is_gloo_available():
    require_or_skip("needs torch.distributed + gloo", allow_module_level=True)
pytestmark = pytest.mark.skipif(not hasattr(os, "kill") or os.name != "posix", reason="posix")

# One clone per iteration; each optimizer.step() ends a step (auto_step), so iteration i's
# clone is in step i. Each rank waits after iteration 5's optimizer.step(), i.e. in step 6,
# until the file argv[1] exists.
DDP_SCRIPT = """
import os, sys, time, torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

def say(line):
    # one write per line: print() writes the text and its newline apart, and the two ranks'
    # writes to the launcher's one pipe could then interleave inside a line
    sys.stdout.write(line + "\\n")
    sys.stdout.flush()


dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = DDP(torch.nn.Linear(4, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x = torch.randn(8, 4) + rank
for i in range(20):
    loss = model(x.clone()).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    say(f"rank {rank} iter {i} loss {loss.item():.6f}")
    if i == 5:
        say(f"rank {rank} waiting")
        while not os.path.exists(sys.argv[1]):
            time.sleep(0.01)
# both ranks done before the group goes: gloo's teardown while the other rank still talks
# can abort a rank ("terminate called without an active exception"), traced or not
dist.barrier()
dist.destroy_process_group()
"""

STEPS = 4


def _torchrun() -> list[str]:
    exe = Path(sys.executable).with_name("torchrun")
    if exe.is_file():
        return [str(exe)]
    found = shutil.which("torchrun")
    return [found] if found else [sys.executable, "-m", "torch.distributed.run"]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COPYTRACE", "OTEL_"))}
    env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", MASTER_ADDR="127.0.0.1", **extra)
    return env


def _per_rank(stdout: str) -> dict[str, list[str]]:
    said: dict[str, list[str]] = {"0": [], "1": []}
    for rank, text in re.findall(r"rank (\d) (iter \d+ loss [\d.]+|waiting)", stdout):
        said[rank].append(text)
    assert len(said["0"]) == len(said["1"]) == 21, stdout  # 20 iterations and "waiting"
    return said


def _clone_steps(path: Path) -> tuple[list[int], list[str]]:
    """The steps of a trace file's clones, and its run span's windows."""
    steps, windows = [], []
    for line in gzip.open(path, "rt").read().splitlines():
        for rs in json.loads(line)["resourceSpans"]:
            for ss in rs["scopeSpans"]:
                for span in ss["spans"]:
                    attrs = {a["key"]: a["value"] for a in span["attributes"]}
                    if span["name"] == "copytrace.clone":
                        steps.append(int(attrs["copytrace.step"]["intValue"]))
                    elif span["name"] == "copytrace.run":
                        values = attrs["copytrace.windows"]["arrayValue"]["values"]
                        windows = [v["stringValue"] for v in values]
    return sorted(steps), windows


def test_trigger_all_ranks_of_a_torchrun_job(tmp_path):
    script = tmp_path / "ddp_train.py"
    script.write_text(DDP_SCRIPT)
    cmd = [*_torchrun(), "--standalone", "--nproc_per_node=2", str(script)]
    plain_go = tmp_path / "plain-go"
    plain_go.touch()
    for _attempt in range(3):
        plain = subprocess.run(
            [*cmd, str(plain_go)], capture_output=True, text=True, cwd=tmp_path, env=_env(),
            timeout=300,
        )  # fmt: skip
        # The untraced reference only: gloo's teardown has aborted a rank of it after all 20
        # iterations ("terminate called without an active exception"), copytrace not loaded.
        if plain.returncode == 0 or "terminate called without an active" not in plain.stderr:
            break
    assert plain.returncode == 0, plain.stdout + plain.stderr

    out, go = tmp_path / "out", tmp_path / "go"
    env = _env(COPYTRACE="1", COPYTRACE_TRIGGER="signal", COPYTRACE_OUTPUT=str(out))
    proc = subprocess.Popen(
        [*cmd, str(go)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        cwd=tmp_path, env=env,
    )  # fmt: skip
    # both pipes drained by threads (a full stderr pipe must not stall the job) and the wait
    # for the ranks bounded: a job that never gets there fails with what it printed
    out_lines: queue.Queue[str] = queue.Queue()
    err_lines: list[str] = []
    readers = [
        threading.Thread(target=lambda: [out_lines.put(ln) for ln in proc.stdout], daemon=True),
        threading.Thread(target=lambda: err_lines.extend(proc.stderr), daemon=True),
    ]  # fmt: skip
    for reader in readers:
        reader.start()
    try:
        lines: list[str] = []
        deadline = time.monotonic() + 240
        while sum(ln.endswith(" waiting\n") for ln in lines) < 2:
            try:
                lines.append(out_lines.get(timeout=max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                raise AssertionError(
                    f"ranks not both waiting after 240 s: {lines} {''.join(err_lines)[-3000:]}"
                ) from None
        exe = Path(sys.executable).with_name("copytrace")
        alone = subprocess.run(
            [str(exe), "trigger", str(proc.pid), "--steps", str(STEPS)],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        trig = subprocess.run(
            [str(exe), "trigger", str(proc.pid), "--all-ranks", "--steps", str(STEPS)],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        go.touch()
        proc.wait(timeout=300)
        for reader in readers:
            reader.join(timeout=60)
        rest = "".join(out_lines.get() for _ in range(out_lines.qsize()))
        err = "".join(err_lines)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    # the launcher is not armed itself: without --all-ranks, one line says what to do
    assert alone.returncode == 2
    assert alone.stderr.strip().splitlines() == [
        f"copytrace: error: process {proc.pid} is not armed by copytrace; 2 armed processes "
        f"run under it: use --all-ranks to signal them all"
    ]
    assert trig.returncode == 0, trig.stderr
    said = trig.stdout.splitlines()
    assert len(said) == 2, trig.stdout
    for rank, line in enumerate(said):
        assert f"(rank {rank}): tracing the next {STEPS} steps -> {out}" in line
        assert f"-rank{rank}." in line
    # the job's output is unchanged: each rank's lines, in order (the two ranks' writes
    # interleave in the launcher's stdout as they come)
    assert _per_rank("".join(lines) + rest) == _per_rank(plain.stdout)
    # by rank: a name's pid comes before its rank, and the ranks' pids may be in either order
    # (a wrapped pid counter; "10000" sorts before "9999")
    files = sorted(out.glob("copytrace-*.otlp.jsonl*"), key=lambda p: p.name.split("-rank")[1])
    assert len(files) == 2, files
    for rank, path in enumerate(files):
        assert path.name.endswith((f"-rank{rank}.otlp.jsonl", f"-rank{rank}.otlp.jsonl.gz"))
        steps, windows = _clone_steps(path)
        # signalled while waiting in step 6: each rank's window opens at its next
        # boundary, steps 7 .. 7 + STEPS - 1
        assert steps == list(range(7, 7 + STEPS)), (path.name, steps)
        assert windows == [f"7-{6 + STEPS}"]
    assert err.count(f"copytrace: traced steps 7-{6 + STEPS}") == 2, err
    # each rank's window report has a name of its own (they share the directory and end
    # their windows together); the launcher's merged report.html comes at the end
    for rank in (0, 1):
        report = out / f"report-rank{rank}.html"
        assert f"copytrace: report of steps 7-{6 + STEPS}: {report}" in err, err
        assert files[rank].name in report.read_text(encoding="utf-8")
        assert files[1 - rank].name not in report.read_text(encoding="utf-8")
    assert (out / "report.html").is_file()
