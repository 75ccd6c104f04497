"""copytrace fix: real programs traced (``copytrace run`` subprocesses), patched through
LibCST, run again; near misses get no patch; comments and untouched lines stay as they were;
files outside the project and ambiguous lines are refused."""

from __future__ import annotations

import difflib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from copytrace.analysis import Finding
from copytrace.analysis._view import Ev
from copytrace.fixes import apply_plan, format_diff, format_unfixed, make_plan, plan_fixes

# Every finding here fires on the CPU, and every fix keeps values bit for bit: the program
# prints the same numbers (repr of Python floats: exact) before and after.
EXACT = '''\
import copy

import torch
from torch import nn

torch.manual_seed(0)
model = nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x = torch.randn(8, 4)
snaps, kept, wides, evals = [], [], [], []
for step in range(5):
    xb = x.to("cpu")  # the batch stays on the CPU
    loss = model(xb).pow(2).mean()
    snaps.append(torch.tensor(loss,   dtype=torch.float64))   # keep   the spacing
    w = model.weight.clone().detach()
    wides.append(xb.double().clone())
    val = model(x).sum()  # no torch.no_grad(): an evaluation that keeps its graph
    kept.append(val.clone())
    target = copy.deepcopy(model)
    evals.append(target(x).sum().item())
    loss.backward()
    opt.step()
    opt.zero_grad()
print([s.item() for s in snaps], w.tolist(), float(sum(v.sum() for v in wides)))
print([k.item() for k in kept], evals)
'''
EXACT_CODES = {"noop-conversion": 12, "tensor-ctor-copy": 14, "clone-detach-order": 15,
               "redundant-copy": 16, "graph-retaining-copy": 18, "deepcopy-in-loop": 19}  # fmt: skip

# The same hazards where the patch must not be offered.
NEAR = '''\
import copy

import torch
from torch import nn

torch.manual_seed(0)
model = nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x = torch.randn(8, 4)
total = torch.zeros(())
out = []
for step in range(8):
    inp = x if step % 2 == 0 else x.double()
    y = inp.float()
    loss = model(y).pow(2).mean()
    total = total + model(x).sum().clone()
    fresh = nn.Linear(4, 2)
    frozen = copy.deepcopy(fresh)
    a, b = torch.tensor(loss), torch.tensor(loss)
    h = x.half().float()
    loss.backward()
    opt.step()
    opt.zero_grad()
    out.append((a + b + h.sum() + frozen(x).sum()).item())
total.backward()
print(out[-1], model.weight.grad.sum().item())
'''

# A `.data` write between a forward and its backward.
DATA = '''\
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x = torch.randn(5, 3)
for step in range(3):
    out = model(x).pow(2).sum()
    # decay the weights
    for p in model.parameters():
        p.data.mul_(0.5)
    out.backward()
    opt.step()
    opt.zero_grad()
print(model[2].weight.sum().item())
'''


def _trace(root: Path, script: str, out: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "copytrace", "run", "--no-report", "-o", out, script]
    proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _project(tmp: Path, name: str, text: str) -> Path:
    root = tmp / name
    root.mkdir()
    (root / "train.py").write_text(text)
    return root


@pytest.fixture(scope="module")
def exact(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """EXACT traced, its plan, the patch applied in place, and traced again."""
    root = _project(tmp_path_factory.mktemp("fix"), "exact", EXACT)
    before = _trace(root, "train.py", "out-before")
    plan = plan_fixes(root / "out-before", root=root)
    diff = format_diff(plan)
    apply_plan(plan)
    after = _trace(root, "train.py", "out-after")
    again = plan_fixes(root / "out-after", root=root)
    return {"root": root, "plan": plan, "diff": diff, "before": before, "after": after,
            "again": again}  # fmt: skip


def test_exact_fixes_keep_the_output(exact: dict) -> None:
    assert exact["after"].stdout == exact["before"].stdout
    assert exact["before"].stdout.count("\n") == 2


def test_verify_says_what_the_two_runs_show(exact: dict) -> None:
    # --verify's words for each case of a fix's finding in the runs before and after the patch
    from copytrace.fixes._verify import Outcome, Verification

    fix = exact["plan"].fixes[0]
    where = f"{fix.finding.code} at train.py:{fix.line}"
    cases = {  # (found before, gone after) -> what --verify says
        (True, True): "fixed (found before the patch, not after)",
        (True, False): "NOT fixed (still found after the patch)",
        (False, True): "not checked (found in neither run)",
        (False, False): "NOT fixed (found only after the patch)",
    }
    for (before, gone), said in cases.items():
        after = 0.0 if gone else 400.0
        v = Verification([Outcome(fix, before, gone, 400.0 if before else 0.0, after)])
        v.bytes_per_step_before, v.bytes_per_step_after = 2000.0, 1600.0 + after
        lines = v.lines()
        assert lines[0] == f"{where}: {said}; its copies: {400 if before else 0} -> {after:.0f} "\
            "bytes per step"  # fmt: skip
        assert lines[1] == "program stdout: the same; exit status: the same (0 -> 0)"
        assert lines[2] == ("all copies: 2000 -> 1600 bytes per step (400 fewer)" if gone
                            else "all copies: 2000 -> 2000 bytes per step (no change)")  # fmt: skip
        assert v.ok is (before and gone)  # only a confirmed fix passes
    v = Verification([Outcome(fix, True, True, 400.0, 0.0)], status_before=0, status_after=1)
    assert not v.ok  # the patched program failed: same stdout or not, not verified
    assert v.lines()[1] == "program stdout: the same; exit status: DIFFERENT (0 -> 1)"


@pytest.mark.parametrize("code", sorted(EXACT_CODES))
def test_each_exact_fix_removes_its_finding(exact: dict, code: str) -> None:
    fixes = [f for f in exact["plan"].fixes if f.finding.code == code]
    assert [(f.rel, f.line, f.exact) for f in fixes] == [("train.py", EXACT_CODES[code], True)]
    assert f"# copytrace fix: {code} at train.py:{EXACT_CODES[code]}:" in exact["diff"]
    codes_after = {f.code for f in exact["again"].fixes} | {u.finding.code for u in exact["again"].unfixed}
    assert code not in codes_after


def test_exact_rewrites_and_untouched_lines(exact: dict) -> None:
    old = EXACT.splitlines()
    new = (exact["root"] / "train.py").read_text().splitlines()
    sm = difflib.SequenceMatcher(None, old, new, autojunk=False)
    changed = {i + 1 for tag, i1, i2, _, _ in sm.get_opcodes() if tag != "equal"
               for i in range(i1, i2)}  # fmt: skip
    # the deepcopy moves above the loop: lines 11 (the loop) gets one line inserted before it
    assert changed == set(EXACT_CODES.values())
    text = "\n".join(new)
    assert 'xb = x  # the batch stays on the CPU' in text
    assert "snaps.append(loss.detach().to(dtype=torch.float64, copy=True))   # keep   the spacing" in text
    assert "w = model.weight.detach().clone()" in text
    assert "wides.append(xb.double())" in text
    assert "kept.append(val.detach().clone())" in text
    assert "target = copy.deepcopy(model)\nfor step in range(5):" in text
    assert "    target.load_state_dict(model.state_dict())" in text


def test_diff_applies_with_git_and_patch(exact: dict, tmp_path: Path) -> None:
    patched = (exact["root"] / "train.py").read_text()
    (tmp_path / "fix.diff").write_text(exact["diff"] + format_unfixed(exact["plan"]))
    tools = [["patch", "-p1", "-i", "fix.diff"]] if shutil.which("patch") else []
    if shutil.which("git"):
        tools.append(["git", "apply", "fix.diff"])
    assert tools
    for cmd in tools:
        (tmp_path / "train.py").write_text(EXACT)
        subprocess.run(cmd, cwd=tmp_path, check=True, capture_output=True)
        assert (tmp_path / "train.py").read_text() == patched, cmd


def test_near_misses_get_no_patch(tmp_path: Path) -> None:
    root = _project(tmp_path, "near", NEAR)
    _trace(root, "train.py", "out")
    plan = plan_fixes(root / "out", root=root)
    assert plan.fixes == [] and plan.files == {}
    why = {(u.finding.code, int(u.finding.call_sites[0].split(":")[1].split()[0])): u.reason
           for u in plan.unfixed}  # fmt: skip
    assert "copied or converted on 4 of 8" in why[("noop-conversion", 14)]
    assert "backward on line 25" in why[("graph-retaining-copy", 16)]
    assert "created more than once (or in the loop)" in why[("deepcopy-in-loop", 18)]
    assert "ambiguous line: 2 torch.tensor calls" in why[("tensor-ctor-copy", 19)]
    # a narrowing chain (float32 -> float16 -> float32) rounds on purpose: the rule itself
    # no longer reports it, so there is nothing to patch (the fixer's own refusal of such a
    # chain stays as a second guard, in fixes/_calls.py)
    assert not [f for f, _ in why if f == "redundant-copy"]
    assert "# no patch: noop-conversion" in format_unfixed(plan)


def test_data_inplace_moves_the_write_after_the_backward(tmp_path: Path) -> None:
    root = _project(tmp_path, "data", DATA)
    _trace(root, "train.py", "out")
    cmd = [sys.executable, "-m", "copytrace", "fix", "out", "--apply", "--verify", "--",
           "python", "train.py"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=600)
    # the gradient is now the true one: the output changes on purpose, so --verify exits 1
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "# copytrace fix: data-inplace at train.py:12:" in proc.stdout
    assert "changes values on purpose" in proc.stdout
    assert "data-inplace at train.py:12: fixed (found before the patch, not after)" in proc.stderr
    assert ("program stdout: DIFFERENT (diff below); exit status: "
            "the same (0 -> 0)") in proc.stderr  # fmt: skip
    assert (root / "train.py").read_text() == DATA.replace(
        "    # decay the weights\n    for p in model.parameters():\n        p.data.mul_(0.5)\n"
        "    out.backward()\n",
        "    out.backward()\n    # decay the weights\n    for p in model.parameters():\n"
        "        with torch.no_grad():\n            p.mul_(0.5)\n",
    )


def test_refuses_files_outside_the_project(exact: dict) -> None:
    sub = exact["root"] / "elsewhere"
    sub.mkdir(exist_ok=True)
    plan = plan_fixes(exact["root"] / "out-before", root=sub)
    assert plan.fixes == [] and plan.unfixed
    assert all("outside the current directory" in u.reason for u in plan.unfixed)


def _synthetic(path: Path, line: int, code: str, op: str) -> tuple[Finding, list[list[Ev]]]:
    site = f"{path}:{line} <module>"
    ev = Ev(seq=0, run=0, op=op, site=site, transfer="h2d", step=1, shape=(4, 2))
    f = Finding(code=code, severity="warning", message="m", fix="Pin it.", call_sites=[site],
                steps=[1, 2, 3], event_seqs=[0])  # fmt: skip
    return f, [[ev]]


def test_refuses_installed_packages() -> None:
    import torch

    path = Path(torch.__file__)
    f, runs = _synthetic(path, 1, "tensor-ctor-copy", "tensor_ctor")
    plan = make_plan([f], runs, "/")
    assert plan.fixes == []
    assert "installed package or the standard library" in plan.unfixed[0].reason


PAGEABLE = '''\
import torch
from torch.utils.data import DataLoader, TensorDataset

loader = DataLoader(TensorDataset(torch.randn(8, 2)), batch_size=4)
for (xb,) in loader:
    xb = xb.to("cuda")  # to the GPU
noise = torch.randn(4, 2)
for step in range(3):
    nb = noise.to("cuda")
'''


def test_pageable_transfer_only_for_a_dataloader_batch(tmp_path: Path) -> None:
    # The rule needs CUDA to fire: the findings are made by hand, the rewrite is real.
    (tmp_path / "train.py").write_text(PAGEABLE)
    batch = _synthetic(tmp_path / "train.py", 6, "pageable-transfer", "to")
    other = _synthetic(tmp_path / "train.py", 9, "pageable-transfer", "to")
    plan = make_plan([batch[0], other[0]], batch[1], tmp_path)
    assert [(f.line, f.exact) for f in plan.fixes] == [(6, True)]
    new = plan.files["train.py"][1]
    assert new == PAGEABLE.replace("batch_size=4)", "batch_size=4, pin_memory=True)").replace(
        'xb.to("cuda")', 'xb.to("cuda", non_blocking=True)')
    assert "not a loop variable over a DataLoader" in plan.unfixed[0].reason


CHECKED = """\
import torch

w = torch.nn.Parameter(torch.ones(3))
opt = torch.optim.SGD([w], lr=0.1)
for step in range(3):
    loss = (w * 2).sum()
    kept = torch.tensor(loss)
    a, b = torch.tensor(loss), torch.tensor(loss)
    loss.backward()
    opt.step()
    opt.zero_grad()
print(kept.item(), (a + b).item())
"""


def test_check_names_the_fix_command_of_each_patched_finding(tmp_path: Path) -> None:
    # line 7 gets a patch; line 8 holds two torch.tensor calls (ambiguous): no patch, no command
    root = _project(tmp_path, "check", CHECKED)
    _trace(root, "train.py", "out")
    cmd = [sys.executable, "-m", "copytrace", "check", "out", "--findings", "--forbid",
           "tensor-ctor-copy"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    err = proc.stderr.splitlines()
    forbidden = [i for i, x in enumerate(err) if "forbidden hazard tensor-ctor-copy" in x]
    assert len(forbidden) == 2
    at7 = [i for i in forbidden if f"{root / 'train.py'}:7 " in err[i]]
    assert len(at7) == 1
    assert err[at7[0] + 1] == "copytrace check:   patch: copytrace fix out --code tensor-ctor-copy"
    assert sum("patch: copytrace fix" in x for x in err) == 1
    assert "copytrace check: FAILED: 2 violation(s)" in proc.stdout
    blocks = proc.stdout.split("\n  warning ")[1:]  # --findings: one block per finding
    patched = [b for b in blocks if "patch: copytrace fix out --code tensor-ctor-copy" in b]
    assert len(patched) == 1 and "train.py:7 " in patched[0]
    assert "copytrace check: patches for some findings: copytrace fix out --code " \
           "tensor-ctor-copy" in proc.stdout  # fmt: skip
    # the command it names prints that patch, and lists the ambiguous line with its reason
    fix = subprocess.run([sys.executable, "-m", "copytrace", "fix", "out", "--code",
                          "tensor-ctor-copy"], cwd=root, capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    assert "+    kept = loss.detach().clone()" in fix.stdout
    assert "# no patch: tensor-ctor-copy at" in fix.stdout and "ambiguous line" in fix.stdout


CONTIGUOUS = """\
import torch

w = torch.nn.Parameter(torch.ones(8, 4))
opt = torch.optim.SGD([w], lr=0.1)
for step in range(6):
    x = (w * 2).t().t()  # contiguous: .contiguous() returns it unchanged
    y = x.contiguous().view(32)
    y.sum().backward()
    opt.step()
    opt.zero_grad()
print(float(w.sum()))
"""


def test_a_contiguous_that_never_copied_is_kept(tmp_path: Path) -> None:
    # Every recorded .contiguous() returned its input (a no-op-conversion finding), yet the
    # fix is refused: contiguity comes from the layout a kernel chose, and the .view() after
    # it raises on a non-contiguous tensor (another device or shape can change that layout).
    root = _project(tmp_path, "contig", CONTIGUOUS)
    _trace(root, "train.py", "out")
    plan = plan_fixes(root / "out", root=root)
    assert plan.fixes == [] and plan.files == {}
    reasons = [u.reason for u in plan.unfixed if u.finding.code == "noop-conversion"]
    assert reasons and "`.contiguous()` is kept" in reasons[0]


# torch.tensor / new_tensor / as_tensor of a sequence of tensors reads their values one by one:
# such a call has no `.detach()` rewrite (the list has none), behind a name as in a literal
SEQUENCES = """\
import torch

w = torch.ones(3, requires_grad=True)
for step in range(2):
    parts = [w[0] * 2, w[1] * 3, w[2] * 4]
    by_name = torch.tensor(parts)
    literal = torch.tensor([parts[0], parts[1]])
    owned = w.new_tensor((parts[2], parts[0]))
    cast = torch.as_tensor(parts)
    single = torch.tensor(parts[0])
print(by_name.tolist(), literal.tolist(), owned.tolist(), cast.tolist(), single.item())
"""


def test_tensor_of_a_sequence_of_tensors_gets_no_patch(tmp_path: Path) -> None:
    root = _project(tmp_path, "seq", SEQUENCES)
    _trace(root, "train.py", "out")
    plan = plan_fixes(root / "out", root=root)
    why = {int(u.finding.call_sites[0].split(":")[1].split()[0]): u.reason
           for u in plan.unfixed if u.finding.code == "tensor-ctor-copy"}  # fmt: skip
    assert sorted(why) == [6, 7, 8, 9]  # by name, literal list, new_tensor of a tuple, as_tensor
    assert all("a sequence of tensors is read value by value" in r for r in why.values())
    # the near miss: the one tensor of line 10 is still rewritten, and only it
    assert [(f.finding.code, f.line) for f in plan.fixes] == [("tensor-ctor-copy", 10)]
    new = plan.files["train.py"][1]
    assert new == SEQUENCES.replace("torch.tensor(parts[0])", "parts[0].detach().clone()")
