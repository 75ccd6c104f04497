"""torch.compile'd code under tracing: compiled exactly as untraced, and visible in the trace.

Real programs in real subprocesses, run untraced and traced, compared line for line: printed
results (floats as hex, so to the bit), exceptions and dynamo's counters (graphs, frames,
recompiles, graph breaks). Compiling is slow on small machines, so each program runs once per
mode and every assertion shares those runs; ``aot_eager`` everywhere except one inductor run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]

# A compiled training step (a mixed-precision cast, a clone of an activation, a compiled
# region per step; the line numbers below are this text's: `.float()` on line 15, `clone` on
# 16, `.to` on 28).
CASE_30 = """import sys

import torch
import torch.nn as nn

backend = sys.argv[1] if len(sys.argv) > 1 else "inductor"


class Block(nn.Module):
    def __init__(self, d=64):
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x):
        h = self.lin(x.float())
        snap = h.clone()
        if snap.abs().mean() > 100:          # data-dependent branch: a graph break
            h = h * 0.5
        return torch.relu(h) + snap


torch.manual_seed(0)
model = torch.compile(nn.Sequential(Block(), Block()), backend=backend)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
device = "cpu"
losses = []
for step in range(6):
    xb = torch.randn(32, 64, dtype=torch.float64).to(device)
    loss = model(xb).square().mean()
    opt.zero_grad(); loss.backward(); opt.step()
    losses.append(loss.detach())
print("losses", [f"{v.item():.6f}" for v in losses])
from torch._dynamo.utils import counters  # noqa: E402

print("graphs", counters["stats"]["unique_graphs"], "frames", counters["frames"]["ok"])
"""
FLOAT_LINE, CLONE_LINE = 15, 16

# Compiled callables of every kind, with an explicit trace so that one is compiled before
# tracing starts; argv: "traced"|"plain" and the trace directory.
FEATURES = r"""import contextlib, json, sys
import torch, torch.nn as nn
import copytrace
from torch._dynamo.utils import counters

torch.manual_seed(0)
def bits(t):
    return [float(v).hex() for v in t.detach().flatten().tolist()]

@torch.compile(backend="aot_eager")
def early(x):
    return (x.float() * 2).clone().sum(0)

x = torch.randn(8, dtype=torch.float64)
print("early0", bits(early(x)))
traced = sys.argv[1] == "traced"
ctx = copytrace.trace(sys.argv[2], compression="none") if traced else contextlib.nullcontext()
with ctx:
    print("early1", bits(early(x)))                                   # cached before tracing
    print("early2", bits(early(torch.randn(8, 3, dtype=torch.float64))))  # recompiled here

    @torch.compile(backend="aot_eager", fullgraph=True)
    def full(a, b):
        return (a @ b).relu().clone()
    print("full", bits(full(torch.randn(4, 4), torch.randn(4, 4))))

    @torch.compile(backend="aot_eager", fullgraph=True)
    def breaks(a):
        print("never printed")
        return a + 1
    try:
        breaks(torch.ones(2))
    except Exception as err:
        print("fullgraph raised", type(err).__name__, str(err).splitlines()[0])

    model = torch.compile(nn.Sequential(nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 1)),
                          backend="aot_eager")
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    for step in range(3):
        loss = model(torch.randn(5, 6)).pow(2).mean()
        opt.zero_grad(); loss.backward(); opt.step()
        print("loss", step, loss.item().hex())

    def data_mul(w):        # a .data write: compiled and eager gradients differ
        h = w.exp()
        h.data.mul_(2)
        return h.sum()
    def data_rebind(w):     # a .data rebinding: backward raises, naming the compiled node
        h = w.exp()
        h.data = torch.zeros(5)
        return h.sum()
    for fn in (data_mul, data_rebind):
        w = torch.randn(4, requires_grad=True)
        try:
            torch.compile(fn, backend="aot_eager")(w).backward()
            print(fn.__name__, bits(w.grad))
        except RuntimeError as err:
            print(fn.__name__, "raised", str(err).splitlines()[0])
keep = ("frames", "stats", "aot_autograd", "recompiles", "graph_break", "resumes")
print("counters", json.dumps({k: dict(v) for k, v in counters.items() if k in keep},
                             sort_keys=True))
"""


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    for key in ("COPYTRACE", "COPYTRACE_OUTPUT", "TORCH_TRACE", "TORCH_LOGS"):
        env.pop(key, None)
    env.update(extra)
    return env


def _run(args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [sys.executable, *args], cwd=cwd, env=_env(**env), capture_output=True, text=True,
        timeout=400,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _spans(trace_dir: Path) -> list[dict[str, Any]]:
    (path,) = trace_dir.glob("*.otlp.jsonl")
    out = []
    for line in path.read_text().splitlines():
        for rs in json.loads(line)["resourceSpans"]:
            for ss in rs["scopeSpans"]:
                out.extend(ss["spans"])
    return out


def _value(v: dict[str, Any]) -> Any:
    if "intValue" in v:
        return int(v["intValue"])
    if "arrayValue" in v:
        return [_value(x) for x in v["arrayValue"].get("values", [])]
    return next(iter(v.values()))


def _attrs(items: list[dict[str, Any]]) -> dict[str, Any]:
    return {a["key"]: _value(a["value"]) for a in items}


@pytest.fixture(scope="module")
def case30(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    d = tmp_path_factory.mktemp("case30")
    (d / "case30.py").write_text(CASE_30)
    traced = _run(
        ["-m", "copytrace", "run", "-o", str(d / "out"), "case30.py", "aot_eager"], d,
        COPYTRACE_COMPRESSION="none",
    )  # fmt: skip
    from copytrace.cli.summary import format_summary
    from copytrace.dashboards import build_model, load_trace

    summary = format_summary(build_model(load_trace(d / "out")))
    return {"dir": d, "traced": traced, "summary": summary, "spans": _spans(d / "out")}


@pytest.fixture(scope="module")
def features(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    d = tmp_path_factory.mktemp("features")
    (d / "features.py").write_text(FEATURES)
    plain = _run(["features.py", "plain", str(d / "out")], d)
    traced = _run(["features.py", "traced", str(d / "out")], d)
    return {"plain": plain, "traced": traced, "spans": _spans(d / "out")}


def test_case30_unchanged_under_copytrace_run(case30: dict[str, Any]) -> None:
    # The untraced output of CASE_30 (the same with aot_eager and inductor): the region stays
    # compiled under tracing, with the same graphs and frames.
    assert case30["traced"].stdout.splitlines() == [
        "losses ['0.770755', '0.675191', '0.744450', '0.669049', '0.719034', '0.714393']",
        "graphs 3 frames 4",
    ]
    assert "Warning" not in case30["traced"].stderr  # e.g. OptimizedModule's global-hook warning


def test_case30_compiled_calls_and_graph_copies_in_the_trace(case30: dict[str, Any]) -> None:
    spans = case30["spans"]
    calls = [_attrs(s["attributes"]) for s in spans if s["name"] == "copytrace.compiled"]
    assert len(calls) == 6  # one per training step (model(xb))
    for step, call in enumerate(calls):
        assert call["copytrace.step"] == step
        # Block 0's graph up to the break (1/0), its resume (2/0), block 1 recompiled for a
        # float32 input (1/1), its resume (2/0 again).
        assert call["copytrace.compiled.graphs"] == ["1/0", "2/0", "1/1", "2/0"]
        # the .float() cast and the clone in 1/0, the clone in 1/1: 3 x 32x64 float32 = 24576 B
        assert call["copytrace.compiled.graph_copies"] == 3
        assert call["copytrace.compiled.graph_copy_bytes"] == 3 * 32 * 64 * 4
        assert call["code.function.name"] == "forward"  # nn.Sequential.forward was compiled
    graphs = {
        _attrs(s["attributes"])["copytrace.compiled.graph"]: s
        for s in spans if s["name"] == "copytrace.compiled_graph"
    }  # fmt: skip
    assert sorted(graphs) == ["1/0", "1/1", "2/0"]
    copies = sorted(
        (a["copytrace.compiled.graph"], a["copytrace.aten"], a["code.line.number"],
         a["copytrace.shape"], a["copytrace.dtype"], a["copytrace.bytes_logical"],
         a["copytrace.seen"])
        for g in graphs.values() for ev in g.get("events", []) for a in [_attrs(ev["attributes"])]
    )  # fmt: skip
    assert copies == [
        ("1/0", "aten::_to_copy", FLOAT_LINE, [32, 64], "float32", 8192, "graph"),
        ("1/0", "aten::clone", CLONE_LINE, [32, 64], "float32", 8192, "graph"),
        ("1/1", "aten::clone", CLONE_LINE, [32, 64], "float32", 8192, "graph"),
    ]
    assert _attrs(graphs["1/0"]["attributes"])["copytrace.compiled.runs"] == 6
    assert _attrs(graphs["2/0"]["attributes"])["copytrace.compiled.runs"] == 12
    # Eager code around the region is traced as before: the no-op .to() of each batch.
    eager = [_attrs(s["attributes"]) for s in spans if s["name"] == "copytrace.to"]
    assert [(a["copytrace.noop"], a["code.line.number"]) for a in eager] == [(True, 28)] * 6
    run = _attrs(next(s for s in spans if s["name"] == "copytrace.run")["attributes"])
    assert run["copytrace.compiled_mode"] == "compiled"
    assert run["copytrace.compiled_calls"] == 6 and run["copytrace.errors"] == 0


def test_case30_summary_gives_compiled_share(case30: dict[str, Any]) -> None:
    out = case30["summary"]
    # 6 calls x 24576 B = 147456 B found in the graphs; the observed copies are 0 B (the
    # .to() is a no-op, detach an alias), so the graphs hold 100% of the copy bytes.
    assert "compiled regions: 6 calls, 3 graphs" in out
    assert "(147456 B) = 100.0% of copy bytes" in out
    assert f"case30.py:{FLOAT_LINE}" in out and f"case30.py:{CLONE_LINE}" in out


def test_compiled_features_unchanged(features: dict[str, Any]) -> None:
    plain = features["plain"].stdout.splitlines()
    traced = features["traced"].stdout.splitlines()
    assert traced == plain
    assert "never printed" not in plain
    assert any(line.startswith("fullgraph raised Unsupported") for line in plain)
    # .data rebinding: the compiled backward's own error, not eager's SumBackward0 one
    assert any("CompiledFunctionBackward returned an invalid gradient" in line for line in plain)
    counters = json.loads(next(x for x in plain if x.startswith("counters ")).split(" ", 1)[1])
    # AOT graphs: early (1-d, then recompiled for 2-d), full, the model, data_mul, and
    # data_rebind's two graphs around its graph break (the .data rebinding) = 7.
    assert counters["aot_autograd"] == {"ok": 7, "total": 7}


def test_compile_before_and_after_tracing_starts(features: dict[str, Any]) -> None:
    calls = [
        _attrs(s["attributes"]) for s in features["spans"] if s["name"] == "copytrace.compiled"
    ]
    names = [c.get("code.function.name") for c in calls]
    # early x2, full, breaks (raised while compiling: still a call), model x3, data_* x2
    assert names[:4] == ["early", "early", "full", "breaks"]
    # `early` was compiled before tracing: its first traced call runs a graph copytrace never
    # saw compiled; the recompile for a 2-d input happened while tracing and is known.
    assert calls[0]["copytrace.compiled.unknown_graphs"] == 1
    assert "copytrace.compiled.unknown_graphs" not in calls[1]
    assert calls[1]["copytrace.compiled.new_graphs"] == 1
    # early's 2-d graph holds the float() cast and the clone; the recompile made the shapes
    # dynamic (automatic dynamic shapes), so their sizes are symbolic: counted, 0 known bytes.
    assert calls[1]["copytrace.compiled.graph_copies"] == 2
    assert calls[1]["copytrace.compiled.graph_copy_bytes"] == 0
    assert [c["copytrace.compiled.graphs"] for c in calls[:3]] == [["0/0"], ["0/1"], ["1/0"]]


@pytest.mark.skipif(sys.platform != "linux", reason="inductor's C++ compiler on Linux")
def test_case30_inductor_compiled_and_unchanged(tmp_path: Path) -> None:
    (tmp_path / "case30.py").write_text(CASE_30)
    traced = _run(["case30.py", "inductor"], tmp_path, COPYTRACE="1",
                  COPYTRACE_OUTPUT=str(tmp_path / "out"), COPYTRACE_COMPRESSION="none")  # fmt: skip
    # The recorded inductor output (the same losses and counters as untraced).
    assert traced.stdout.splitlines()[:2] == [
        "losses ['0.770755', '0.675191', '0.744450', '0.669049', '0.719034', '0.714393']",
        "graphs 3 frames 4",
    ]
    spans = _spans(tmp_path / "out")
    assert sum(s["name"] == "copytrace.compiled" for s in spans) == 6
    ops = {
        _attrs(ev["attributes"])["copytrace.aten"]
        for s in spans if s["name"] == "copytrace.compiled_graph" for ev in s.get("events", [])
    }  # fmt: skip
    # inductor's decompositions turn the cast into prims.convert_element_type
    assert ops == {"prims::convert_element_type", "aten::clone"}


@pytest.mark.skipif(sys.platform != "linux", reason="inductor's C++ compiler on Linux")
def test_graph_loaded_from_compile_cache_names_this_programs_lines(tmp_path: Path) -> None:
    # AOTAutograd's cache is keyed on the graph, not on where it came from: a second program
    # with the same model, in another file and 3 lines lower, loads the graphs the first one
    # compiled, and their printed stack traces name the first file. Its copies must still be
    # listed at the second program's own lines.
    cache = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache")}
    (tmp_path / "first.py").write_text(CASE_30)
    hits = 'print("cache hits", counters["aot_autograd"]["autograd_cache_hit"])\n'
    (tmp_path / "second.py").write_text("# the same program, moved down\n\n\n" + CASE_30 + hits)
    _run(["first.py", "inductor"], tmp_path, **cache)
    second = _run(["second.py", "inductor"], tmp_path, COPYTRACE="1", **cache,
                  COPYTRACE_OUTPUT=str(tmp_path / "out"), COPYTRACE_COMPRESSION="none")  # fmt: skip
    assert int(second.stdout.splitlines()[-1].split()[-1]) > 0  # the graphs came from the cache
    sites = {
        (Path(a["code.file.path"]).name, a["code.line.number"])
        for s in _spans(tmp_path / "out") if s["name"] == "copytrace.compiled_graph"
        for ev in s.get("events", []) for a in [_attrs(ev["attributes"])]
    }  # fmt: skip
    assert sites == {("second.py", FLOAT_LINE + 3), ("second.py", CLONE_LINE + 3)}


@pytest.mark.parametrize("observer", ["auto", "python"])
def test_copytrace_modes_step_aside_under_a_user_mode_during_a_compiled_call(observer: str) -> None:
    # In-process, backend "eager": the stacks seen by eager code inside a compiled region (a
    # torch.compiler.disable'd helper) hold the user's own modes only, in their order; after
    # the call copytrace's modes are back below the user's mode.
    import torch
    from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    import copytrace

    class UserMode(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    seen: list[tuple[list[Any], list[Any]]] = []

    @torch.compiler.disable
    def look(x):
        seen.append((_get_current_function_mode_stack(), _get_current_dispatch_mode_stack()))
        return x

    @torch.compile(backend="eager")
    def fn(x):
        return look(x * 2) + 1

    x = torch.ones(3)
    # level full: copytrace's function mode is on the stack (lean has none to step aside)
    with copytrace.trace(write=False, observer=observer, level="full") as t:
        ours = list(t.session._engagement.modes)  # the function mode, and on the Python path the dispatch mode
        with UserMode() as mine:
            before = (_get_current_function_mode_stack(), _get_current_dispatch_mode_stack())
            assert before == ([ours[0], mine], ours[1:])
            fn(x)
            after = (_get_current_function_mode_stack(), _get_current_dispatch_mode_stack())
    assert seen == [([mine], [])]
    assert after == before
    assert t.stats["errors"] == 0


@pytest.mark.parametrize("level", ["full", "lean"])
def test_patches_and_hooks_stand_aside_while_dynamo_compiles_and_in_cached_code(
    level: str,
) -> None:
    # In-process, real torch.compile with a backend that looks at what dynamo sees as it
    # compiles: torch's own copy.deepcopy, torch.from_numpy, nn.Module.state_dict and no
    # global optimizer hook of copytrace's (they are taken away from dynamo's first callback of
    # a compiled call to its end). In cached compiled code the patches stay in place and stand
    # aside by themselves: a deepcopy and an optimizer step there leave no event and no step.
    import copy

    import numpy as np
    import torch
    import torch.nn as nn
    from torch._dynamo.utils import counters
    from torch.optim import optimizer as optim_module

    import copytrace

    orig = (copy.deepcopy, torch.from_numpy, nn.Module.__dict__["state_dict"])
    hooks = (
        list(optim_module._global_optimizer_pre_hooks),
        list(optim_module._global_optimizer_post_hooks),
    )

    def torch_own() -> bool:
        return (copy.deepcopy, torch.from_numpy, nn.Module.__dict__["state_dict"]) == orig and (
            list(optim_module._global_optimizer_pre_hooks),
            list(optim_module._global_optimizer_post_hooks),
        ) == hooks

    compiling: list[bool] = []
    running: list[tuple[bool, bool]] = []

    def backend(gm: Any, example_inputs: Any) -> Any:
        compiling.append(torch_own())
        return gm.forward

    torch.manual_seed(0)
    lin = nn.Linear(4, 4)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)

    @torch.compiler.disable
    def inside(x: Any) -> Any:  # eager code inside the compiled region (a graph break)
        running.append((torch_own(), copy.deepcopy is orig[0]))
        copy.deepcopy(x)
        opt.step()
        return x

    @torch.compile(backend=backend)
    def simple(x: Any) -> Any:
        return inside(x * 2) + 1

    ones = np.ones(4, dtype=np.float32)

    @torch.compile(backend=backend)
    def reads_from_numpy(x: Any) -> Any:  # its guards read torch.from_numpy (an ID_MATCH)
        return lin(x) + torch.from_numpy(ones)

    def program() -> dict[str, Any]:
        counters.clear()
        x = torch.ones(4)
        for _ in range(2):
            simple(x)
        after_simple = len(compiling)
        for _ in range(3):
            reads_from_numpy(x)
        keep = ("frames", "stats", "recompiles", "graph_break", "resumes")
        out = {k: dict(v) for k, v in counters.items() if k in keep}
        out["graph_breaks"] = sum(out.pop("graph_break", {}).values())
        out["compiled_after_simple"] = after_simple
        return out

    torch._dynamo.reset()
    untraced = program()
    assert running == [(True, True), (True, True)]
    assert compiling == [True] * 3
    compiling.clear()
    running.clear()
    torch._dynamo.reset()  # before tracing: nothing compiled (nothing whose guards read a patch)
    with copytrace.trace(write=False, level=level) as t:
        steps = t.stats["steps"]
        traced = program()
        sticky = t.session._engagement.compiled.sticky
        in_region = (t.stats["events"], t.stats["steps"])
        copy.deepcopy(torch.ones(2))  # outside any compiled region: recorded, one step
        opt.step()
        outside = (t.stats["events"], t.stats["steps"])
    # simple: two graphs around the graph break (x * 2, then + 1); reads_from_numpy: one, and
    # no recompile for its 2nd and 3rd calls (its guards would fail if they saw the patch).
    # How many ops each graph captures is torch's business: compared, not pinned.
    assert untraced["stats"]["unique_graphs"] == 3
    assert untraced["frames"] == {"total": 3, "ok": 3}  # simple, its resume, reads_from_numpy
    assert untraced["graph_breaks"] == 1  # simple's, none in reads_from_numpy
    assert "recompiles" not in untraced
    assert untraced["compiled_after_simple"] == 2
    assert traced == untraced
    assert compiling == [True] * 3
    # 1st call: dynamo compiled (copytrace stood aside from its callback on); 2nd: cached code,
    # the patches in place, recording nothing.
    assert running == [(True, True), (False, False)]
    assert sticky  # reads_from_numpy's guards read a patched attribute: swapped at each call
    assert in_region == (0, steps)
    assert outside == (1, steps + 1)
    assert t.stats["errors"] == 0


def test_depth_callback_pauses_in_compiled_calls_for_copytrace_alone() -> None:
    # In-process, backend "aot_eager" (a compiled region that runs aten ops). copytrace's depth
    # callback (kernels.cpp, paused by compiled.cpp) pauses while a compiled call or its compiled backward runs, on
    # this thread and for itself only: a user's torch.profiler around them records the same
    # aten ops traced as untraced, and the depth is balanced after each region, so the eager
    # backward around it still has its implicit copy recorded, every time.
    from collections import Counter

    import torch

    import copytrace

    @torch.compile(backend="aot_eager")
    def f(x: Any) -> Any:
        return (x @ x.t()).relu() + 1

    x = torch.randn(8, 8, requires_grad=True)

    def program() -> list[tuple[str, int]]:
        x.grad = None
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(2):
                # ToCopyBackward0 casts the float64 gradient back to float32 (aten::_to_copy,
                # implicit) before the compiled graph's backward runs
                f(x).double().sum().backward()
        names = Counter(e.name for e in prof.events() if e.name.startswith("aten::"))
        return sorted(names.items())

    torch._dynamo.reset()
    f(x)  # compiled before either run
    untraced = program()
    with copytrace.trace(write=False) as t:
        traced = program()
        depth = t.session._rec.native.depth() if t.session._rec.native is not None else 0
    assert traced == untraced
    assert dict(untraced)["aten::mm"] >= 2  # the regions' matmuls, seen by the user's profiler
    assert depth == 0
    implicit = [(e.op, e.aten, e.phase) for e in t.events if e.op == "implicit"]
    assert implicit == [("implicit", ("aten::_to_copy",), "backward")] * 2
    assert t.stats["errors"] == 0
