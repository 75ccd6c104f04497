"""py-spy's independent view: parsing both output formats, classifying samples, the icicle,
the report section, failing to attach, and ``copytrace run --py-spy`` end to end."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from _require import require_or_skip

from copytrace import pyspy
from copytrace.dashboards.sections.pyspy import payload_pyspy, pyspy_figure

SO_PY, SO_CPU = "/t/lib/libtorch_python.so", "/t/lib/libtorch_cpu.so"
FRAMES = [
    ("<module>", "/w/train.py", 1),  # 0
    ("main", "/w/train.py", 5),  # 1
    ("torch::autograd::THPVariable_clone", SO_PY, 0),  # 2
    ("at::_ops::clone::call", SO_CPU, 0),  # 3
    ("at::native::clone", SO_CPU, 0),  # 4
    ("at::native::copy_", SO_CPU, 0),  # 5
    ("at::native::AVX2::direct_copy_kernel", SO_CPU, 0),  # 6
    ("Linear.forward", "/t/torch/nn/modules/linear.py", 125),  # 7
    ("at::_ops::addmm::call", SO_CPU, 0),  # 8
    ("at::native::addmm_impl_cpu_", SO_CPU, 0),  # 9
    ("at::_ops::copy_::call", SO_CPU, 0),  # 10
    ("mkl_blas_sgemm", "/t/lib/libmkl.so", 0),  # 11
    ("FunctionMode.__torch_function__", "/s/copytrace/tracer/_recorder.py", 600),  # 12
    ("user_frame", "/s/copytrace/tracer/_callsite.py", 30),  # 13
    ("pthread_cond_wait", "/lib/libc.so.6", 0),  # 14
    (
        'c10::impl::wrap_kernel_functor_unboxed_<Fn<&f(at::Tensor const&)>, "x">::call',
        SO_CPU,
        0,
    ),  # 15
]
# (stack, samples). 100 main-thread samples of 10 ms; expected shares derived below.
MAIN = [
    ([0, 1, 2, 3, 15, 4, 5, 6], 10),  # A: x.clone(): API call -> clone op -> copy kernel
    ([0, 1, 7, 8, 9, 10, 5, 6], 20),  # B: addmm copying its bias: a kernel inside another op
    ([0, 1, 7, 8, 9, 11], 40),  # C: the matmul itself
    ([0, 1, 12, 13], 10),  # D: copytrace's own bookkeeping
    ([0, 1, 12, 2, 3, 4, 5], 10),  # E: a clone seen through copytrace's handler
    ([0, 1, 2, 12, 13], 10),  # F: copytrace recording a clone, inside the call
]
# copy calls = A + E + F = 30 %, of which copytrace's recording F = 10 %: copy work 20 %;
# kernels = A + B + E = 40 % (B = 20 % inside other ops); API = A + E + F = 30 %;
# copytrace = D + F = 20 %.
OTHER_THREAD = [([14], 30)]  # an idle helper thread: not in the main thread's shares


def _speedscope(path: Path) -> Path:
    def profile(name: str, stacks: list[tuple[list[int], int]]) -> dict:
        samples = [s for s, n in stacks for _ in range(n)]
        return {"type": "sampled", "name": name, "unit": "seconds", "startValue": 0,
                "endValue": len(samples) / 100, "samples": samples,
                "weights": [0.01] * len(samples)}  # fmt: skip

    doc = {
        "$schema": "https://www.speedscope.app/file-format-schema.json",
        "shared": {"frames": [{"name": n, "file": f, "line": ln, "col": None} for n, f, ln in FRAMES]},
        "profiles": [profile('Thread 4242 "MainThread"', MAIN), profile('Thread 4250 "pin"', OTHER_THREAD)],
        "activeProfileIndex": 0,
        "exporter": "py-spy@0.4.3",
        "name": "py-spy profile",
    }  # fmt: skip
    path.write_text(json.dumps(doc))
    return path


def _raw(path: Path) -> Path:
    def frame(i: int) -> str:
        name, file, line = FRAMES[i]
        if line:
            return f"{name} ({file.rsplit('/torch/', 1)[-1] if '/torch/' in file else file}:{line})"
        return f"{name} ({os.path.basename(file)})"

    lines = [
        f'process 4242:"python train.py";{";".join(frame(i) for i in stack)} {n}'
        for stack, n in MAIN
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("fmt", ["speedscope", "raw"])
def test_sampled_shares(tmp_path, fmt):
    path = (_speedscope if fmt == "speedscope" else _raw)(tmp_path / f"p.{fmt}")
    profile = pyspy.load_profile(path)
    stats = pyspy.analyze(profile, main_pid=4242)
    assert stats.format == fmt and stats.native
    assert stats.samples == 100
    assert stats.copy_call_share == pytest.approx(0.30)
    assert stats.copy_call_tracer_share == pytest.approx(0.10)
    assert stats.copy_work_share == pytest.approx(0.20)
    assert stats.kernel_share == pytest.approx(0.40)
    assert stats.kernel_in_ops_share == pytest.approx(0.20)
    assert stats.api_share == pytest.approx(0.30)
    assert stats.tracer_share == pytest.approx(0.20)
    top = {f.label: f for f in stats.top_copy_frames}
    assert top["at::native::copy_"].share == pytest.approx(0.40)
    assert top["torch::autograd::THPVariable_clone"].kind == pyspy.API
    if fmt == "speedscope":
        assert stats.weight == pytest.approx(1.0)  # seconds
        assert "main thread of pid 4242" in stats.scope
        everything = pyspy.analyze(profile)  # both threads: the idle one dilutes the shares
        assert everything.samples == 130
        assert everything.kernel_share == pytest.approx(40 / 130)


def test_frame_classes():
    f = pyspy.Frame
    assert pyspy.classify(f("at::native::copy_", SO_CPU)) == pyspy.KERNEL
    assert pyspy.classify(f("at::native::_to_copy", SO_CPU)) == pyspy.KERNEL
    assert pyspy.classify(f("at::native::copy_nested_tensor", SO_CPU)) == ""
    # a template argument that names a copy kernel does not make its caller one
    assert (
        pyspy.classify(f("c10::function_ref<void ()>::callback_fn<direct_copy_kernel>", SO_CPU))
        == ""
    )
    assert pyspy.classify(f("torch::autograd::THPVariable_to", SO_PY)) == pyspy.API
    assert pyspy.classify(f("deepcopy", "/usr/lib/python3.11/copy.py", 128)) == pyspy.API
    assert pyspy.classify(f("Tensor.__deepcopy__", "/t/torch/_tensor.py", 99)) == pyspy.API
    assert (
        pyspy.classify(f("Recorder.record", "/s/copytrace/tracer/_recorder.py", 9))
        == pyspy.TRACER
    )
    assert pyspy.classify(f("torch::autograd::THPVariable_add", SO_PY)) == ""


def test_icicle_highlights_copy_frames(tmp_path):
    profile = pyspy.load_profile(_speedscope(tmp_path / "p.speedscope.json"))
    fig = pyspy_figure(profile, main_pid=4242)
    assert [t.type for t in fig.data] == ["icicle", "icicle"]
    full, copies = fig.data
    colour = dict(zip(full.labels, full.marker.colors, strict=True))
    assert colour["at::native::copy_"] == "#d62728"  # copy kernel: red
    assert colour["torch::autograd::THPVariable_clone"] == "#ff7f0e"  # copy API: orange
    assert colour["user_frame (_callsite.py:30)"] == "#9467bd"  # copytrace: purple
    assert not any("wrap_kernel_functor" in lb for lb in full.labels)  # plumbing folded
    assert full.values[0] == pytest.approx(1.0)  # main thread only
    # second view: only samples in a copy, cut at the first copy frame
    assert copies.values[0] == pytest.approx(0.50)  # A + B + E + F
    assert "mkl_blas_sgemm" not in copies.labels  # no copy in that stack
    assert "at::native::AVX2::direct_copy_kernel" not in copies.labels  # below the cut
    assert "at::native::copy_" in copies.labels  # addmm's bias copy: its first copy frame
    assert list(fig.layout.updatemenus[0].buttons[1].args) == [{"visible": [False, True]}]


def test_report_section_sets_traced_beside_sampled(tmp_path):
    _speedscope(tmp_path / "copytrace-h-4242.speedscope.json")
    model = SimpleNamespace(
        files=[str(tmp_path / "copytrace-h-4242.otlp.jsonl.gz")],
        runs=[SimpleNamespace(pid=4242, label="pid 4242", duration_ns=10**9, overhead_ns=None)],
        steps=[SimpleNamespace(run="pid 4242", copy_time_ns=150_000_000)],
    )
    (part,) = payload_pyspy(model)
    assert part["name"] == "copytrace-h-4242.speedscope.json"
    shares = {measure: share for measure, share, _ in part["rows"]}
    assert shares["sampled: copy work"] == "20.0%"
    assert shares["traced: copy time"] == "15.0%"  # 150 ms of copies in a 1 s run
    assert [t["type"] for t in part["fig"]["data"]] == ["icicle", "icicle"]
    json.dumps(part)  # plain JSON for the page
    traced = pyspy.traced_numbers(model, 4242)
    line = pyspy.summary_line(pyspy.analyze(pyspy.load_profile(tmp_path / "copytrace-h-4242.speedscope.json"), 4242), traced)  # fmt: skip
    assert "copy work 20.0% (traced copy time: 15.0%) + copytrace recording them 10.0%" in line
    # a report of another process's trace file does not take this profile
    model.files = [str(tmp_path / "copytrace-h-999.otlp.jsonl.gz")]
    assert payload_pyspy(model) == []
    (tmp_path / "copytrace-h-4242.speedscope.json").write_text("{not json")
    model.files = [str(tmp_path / "copytrace-h-4242.otlp.jsonl.gz")]
    (bad,) = payload_pyspy(model)
    assert bad["name"] == "copytrace-h-4242.speedscope.json" and bad["error"] and "rows" not in bad


# --- attaching -----------------------------------------------------------------------------------
def _fake_py_spy(tmp_path: Path, body: str) -> Path:
    exe = tmp_path / "fake-py-spy"
    exe.write_text(f"#!/bin/sh\n{body}\n")
    exe.chmod(0o755)
    return exe


def _real_permission_denied(tmp_path: Path) -> Path | None:
    """A wrapper that runs the real py-spy as ``nobody``: a real ptrace refusal."""
    real = pyspy.find_py_spy()
    setpriv = shutil.which("setpriv")
    if real is None or setpriv is None or os.geteuid() != 0 or os.environ.get("COPYTRACE_PY_SPY"):
        return None
    return _fake_py_spy(
        tmp_path, f'exec {setpriv} --reuid=65534 --regid=65534 --clear-groups {real} "$@"'
    )


@pytest.mark.parametrize("how", ["refused", "missing", "nobody"])
def test_cannot_attach_is_one_line_and_no_recorder(tmp_path, monkeypatch, capsys, how):
    if how == "refused":
        exe = _fake_py_spy(
            tmp_path,
            "echo 'Error: Permission Denied: Try running again with elevated permissions' >&2; exit 1",
        )
    elif how == "missing":
        exe = tmp_path / "no-such-py-spy"
    else:
        exe = _real_permission_denied(tmp_path)
        if exe is None:
            require_or_skip("needs root, setpriv and py-spy")
    monkeypatch.setenv(pyspy.PYSPY_ENV, str(exe))
    assert pyspy.start(tmp_path / "out", timeout_s=20) is None
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1, err
    assert err[0].startswith("copytrace: ") and "running without it" in err[0]
    if how == "refused":
        assert "Permission Denied" in err[0]
    if how == "nobody":  # py-spy --subprocesses words it as "no python processes found"
        assert "ptrace" in err[0] or "Permission" in err[0]


def test_py_spy_runs_with_no_thread_the_program_sees(tmp_path, monkeypatch):
    # copytrace run --py-spy runs the program in this process: py-spy's output goes to a file
    # with no name, not to pipes drained by threading.Threads, which the program's
    # threading.enumerate() listed and its threading.settrace hook traced
    exe = _fake_py_spy(
        tmp_path,
        'while [ $# -gt 0 ]; do [ "$1" = -o ] && out=$2; shift; done\n'
        'trap \'echo profile > "$out"; exit 0\' INT\n'
        "echo 'py-spy> Sampling process 100 times a second. Press Control-C to exit.'\n"
        "while :; do sleep 0.05; done",
    )
    monkeypatch.setenv(pyspy.PYSPY_ENV, str(exe))
    hooked: list[str] = []
    before = sorted((t.name, t.ident) for t in threading.enumerate())
    threading.settrace(lambda frame, event, arg: hooked.append(frame.f_code.co_filename))
    try:
        spy = pyspy.start(tmp_path / "out", timeout_s=20)
        assert spy is not None
        during = sorted((t.name, t.ident) for t in threading.enumerate())
        assert spy.output == [
            "py-spy> Sampling process 100 times a second. Press Control-C to exit."
        ]
        path = spy.stop()
    finally:
        threading.settrace(None)  # type: ignore[arg-type]
    assert during == before and hooked == []
    assert path is not None and path.read_text() == "profile\n"
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [path.name]  # no log left


def _have_py_spy() -> bool:
    return pyspy.find_py_spy() is not None


def test_raw_output_of_real_py_spy_parses(tmp_path):
    if not _have_py_spy():
        require_or_skip("py-spy not installed")
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time\nt = time.time()\nwhile time.time() - t < 20: sum(range(1000))",
        ]
    )
    try:
        spy = pyspy.start(tmp_path, pid=child.pid, fmt="raw", rate=200, subprocesses=False)
        if spy is None:
            require_or_skip("py-spy cannot attach here")
        time.sleep(0.6)
        path = spy.stop()
    finally:
        child.kill()
        child.wait()
    assert path is not None and path.name.endswith(".pyspy.txt")
    stats = pyspy.analyze(pyspy.load_profile(path), main_pid=child.pid)
    assert stats.samples > 5
    assert any(f.line for f in pyspy.load_profile(path).frames)  # Python frames with lines


# --- copytrace run --py-spy ----------------------------------------------------------------------
def test_copytrace_run_py_spy_end_to_end(tmp_path):
    if not _have_py_spy():
        require_or_skip("py-spy not installed")
    script = tmp_path / "copies.py"
    script.write_text(
        textwrap.dedent(
            """
            import sys, time, torch
            x = torch.randn(256, 256)
            t0 = time.time()
            while time.time() - t0 < 1.5:
                y = x.clone()
                z = x.t().contiguous()
                w = x @ x
            sys.exit(4)
            """
        )
    )
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COPYTRACE", "OTEL_"))}
    proc = subprocess.run(
        [sys.executable, "-m", "copytrace", "run", "--py-spy", "-o", str(out), str(script)],
        capture_output=True, text=True, cwd=tmp_path, env={**env, "OMP_NUM_THREADS": "1"},
        timeout=240,
    )  # fmt: skip
    if "cannot attach" in proc.stderr:
        require_or_skip("py-spy cannot attach here: " + proc.stderr)
    assert proc.returncode == 4, proc.stderr  # the program's status, not py-spy's
    profiles = list(out.glob("copytrace-*.speedscope.json"))
    assert len(profiles) == 1, sorted(out.iterdir())
    summary = [ln for ln in proc.stderr.splitlines() if "py-spy:" in ln]
    assert len(summary) == 1, proc.stderr
    stats = pyspy.analyze(pyspy.load_profile(profiles[0]), main_pid=int(profiles[0].stem.split("-")[-1].split(".")[0]))  # fmt: skip
    assert stats.native and stats.samples > 20
    assert stats.kernel_share > 0.02 and stats.copy_work_share > 0.02, summary
    page = (out / "report.html").read_text(encoding="utf-8")
    data = json.loads(page.split('id="ct-data">')[1].split("</script>")[0])
    (part,) = data["pyspy"]  # the page draws the section from it
    assert part["name"] == profiles[0].name and part["fig"]["data"][0]["type"] == "icicle"
