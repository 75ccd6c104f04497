"""py-spy's independent view of a traced run: record, parse, measure, draw.

``copytrace run --py-spy`` starts ``py-spy record --pid <its own pid> --native --idle
--subprocesses`` before the program runs and stops it right after, so py-spy samples the
program while copytrace traces it. py-spy's samples never go through copytrace's timers: the
share of samples inside copy kernels and copy API calls is an independent measure of what
the trace reports as copy time, and the share inside copytrace's own code is a measure of
the tracer's overhead.

Everything below :func:`start` is plain data and plain functions, testable without py-spy:
:func:`load_profile` reads a speedscope JSON or raw (collapsed stacks) file,
:func:`analyze` classifies the samples (:class:`SampleStats` says exactly what each share
counts), :func:`pyspy_figure` draws an icicle of them with copy frames highlighted, and
:func:`report_sections` is what the HTML report embeds for each ``*.speedscope.json`` /
``*.pyspy.txt`` it finds beside its trace files.

In short (a sample counts once, at any depth of its stack):

* **copy work**: in a copy API call (``Tensor.clone/to/contiguous/copy_/detach``, ``.data``,
  ``torch.tensor``, ``copy.deepcopy``...) or in an aten copy op that no other op called,
  less copytrace's own frames inside them: what the trace's copy time measures.
* **copytrace**: in copytrace's own code with no torch work below it: the tracer's overhead.
* **copy kernels**: in aten's copy kernels (``at::native::copy_``, ``clone``,
  ``_to_copy``, ``direct_copy_kernel``...), wherever called from, including inside other
  ops (``addmm`` copying its bias into its output), which the trace does not record.

Known limitations:
    py-spy samples at a fixed rate (100 Hz by default): a share is good to about
    ``1/sqrt(samples)``. The kernel shares need native frames (``--native``); the
    copytrace share is approximate (a quick torch query made by the tracer counts as its
    own work). py-spy's sampling with native frames slows the program (1.5-2x here), evenly
    enough that shares stay comparable. py-spy needs ptrace permission on the process (root,
    ``CAP_SYS_PTRACE``, or a Yama ``ptrace_scope`` of 0/1); without it, copytrace says so in
    one line and runs without it.
"""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from copytrace import _env

__all__ = [
    "FORMATS",
    "PYSPY_ENV",
    "PySpy",
    "Frame",
    "Stack",
    "Profile",
    "FrameShare",
    "ThreadStats",
    "SampleStats",
    "find_py_spy",
    "start",
    "profile_path",
    "find_profiles",
    "load_profile",
    "analyze",
    "classify",
    "pyspy_figure",
    "traced_numbers",
    "report_section_html",
    "report_sections",
    "summary_line",
]

#: The variable naming the py-spy executable (see :mod:`copytrace._env`).
PYSPY_ENV = _env.COPYTRACE_PY_SPY
#: ``--py-spy-format`` value -> file suffix.
FORMATS = {"speedscope": ".speedscope.json", "raw": ".pyspy.txt"}

KERNEL, API, TRACER = "copy kernel", "copy API", "copytrace"


# --- recording ---------------------------------------------------------------------------------
def find_py_spy() -> str | None:
    """The py-spy executable: ``$COPYTRACE_PY_SPY``, next to ``sys.executable``, or on PATH."""
    env = _env.setting(PYSPY_ENV)
    if env:
        return str(env)
    here = Path(sys.executable).with_name("py-spy")
    if here.is_file() and os.access(here, os.X_OK):
        return str(here)
    return shutil.which("py-spy")


def profile_path(out_dir: str | os.PathLike[str], fmt: str, pid: int | None = None) -> Path:
    """``<out>/copytrace-<host>-<pid>.speedscope.json`` (or ``.pyspy.txt`` for raw)."""
    import socket

    pid = os.getpid() if pid is None else pid
    host = socket.gethostname() or "host"
    return Path(out_dir) / f"copytrace-{host}-{pid}{FORMATS[fmt]}"


class PySpy:
    """A running ``py-spy record`` attached to a process; see :func:`start`."""

    def __init__(self, proc: subprocess.Popen[str], path: Path, pid: int) -> None:
        self.proc = proc
        self.path = path
        self.pid = pid
        self.output: list[str] = []
        self._sampling = threading.Event()
        self._threads = [
            threading.Thread(target=self._drain, args=(s,), daemon=True, name="copytrace-py-spy")
            for s in (proc.stdout, proc.stderr)
        ]
        for t in self._threads:
            t.start()

    def _drain(self, stream: Any) -> None:
        try:
            for line in stream:
                self.output.append(line.rstrip("\n"))
                if "Sampling process" in line:
                    self._sampling.set()
        except (OSError, ValueError):
            pass

    def wait_sampling(self, timeout_s: float) -> bool:
        """Wait until py-spy samples (True), or exits or times out (False)."""
        step = 0.02
        waited = 0.0
        while waited < timeout_s:
            if self._sampling.wait(step):
                return True
            if self.proc.poll() is not None:
                for t in self._threads:
                    t.join(1.0)
                return self._sampling.is_set()
            waited += step
        return self._sampling.is_set()

    def error_line(self) -> str:
        """py-spy's own explanation of a failure, in one line."""
        lines = [ln.strip() for ln in self.output if ln.strip()]
        for ln in lines:
            low = ln.lower()
            if "error" in low or "permission" in low or "denied" in low or "failed" in low:
                return ln.removeprefix("py-spy> ")
        return lines[-1].removeprefix("py-spy> ") if lines else f"exit status {self.proc.poll()}"

    def stop(self, timeout_s: float = 60.0) -> Path | None:
        """Stop sampling, let py-spy write its file, and return it (None if none written)."""
        if self.proc.poll() is None:
            try:
                self.proc.send_signal(signal.SIGINT)
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            except OSError:
                pass
        for t in self._threads:
            t.join(2.0)
        return self.path if self.path.is_file() and self.path.stat().st_size > 0 else None


def _allow_ptrace_by(pid: int) -> None:
    """Under Yama ``ptrace_scope=1`` only ancestors may ptrace a process: let ``pid`` in."""
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope", encoding="ascii") as fh:
            if fh.read().strip() != "1":
                return
        import ctypes

        pr_set_ptracer = 0x59616D61
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_ptracer, ctypes.c_ulong(pid), 0, 0, 0)
    except (OSError, AttributeError, ValueError):
        pass


def start(
    out_dir: str | os.PathLike[str],
    *,
    pid: int | None = None,
    fmt: str = "speedscope",
    rate: int = 100,
    native: bool = True,
    subprocesses: bool = True,
    idle: bool = True,
    timeout_s: float = 20.0,
) -> PySpy | None:
    """Attach ``py-spy record`` to ``pid`` (default: this process) and wait until it samples.

    Args:
        out_dir: where the profile goes (:func:`profile_path`).
        pid: the process to sample; default this one.
        fmt: ``speedscope`` (JSON) or ``raw`` (collapsed stacks, flamegraph.pl input).
        rate: samples per second.
        native: sample native (C/C++) frames too, which name the copy kernels.
        subprocesses: also sample the process's children (DataLoader workers, ranks).
        idle: keep samples of idle threads, so that shares are of wall time.
        timeout_s: how long to wait for py-spy to start sampling.

    Returns:
        The running recorder, or None when py-spy is missing or cannot attach (no ptrace
        permission...): one ``copytrace:`` line on stderr says why, and the caller carries
        on without it.
    """
    if fmt not in FORMATS:
        raise ValueError(f"py-spy format must be one of {', '.join(FORMATS)}, not {fmt!r}")
    pid = os.getpid() if pid is None else pid
    exe = find_py_spy()
    if exe is None:
        print("copytrace: py-spy not found; running without it", file=sys.stderr)
        return None
    path = profile_path(out_dir, fmt, pid)
    path.parent.mkdir(parents=True, exist_ok=True)
    cmd = [exe, "record", "--pid", str(pid), "--rate", str(int(rate)), "--format", fmt,
           "-o", str(path)]  # fmt: skip
    if native:
        cmd.append("--native")
    if subprocesses:
        cmd.append("--subprocesses")
    if idle:
        cmd.append("--idle")
    try:
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            errors="replace",
            start_new_session=True,  # a Ctrl-C in the terminal stops the program, not py-spy
        )
    except OSError as err:
        print(f"copytrace: cannot start py-spy ({err}); running without it", file=sys.stderr)
        return None
    _allow_ptrace_by(proc.pid)
    spy = PySpy(proc, path, pid)
    if spy.wait_sampling(timeout_s):
        return spy
    reason = spy.error_line() if proc.poll() is not None else f"no sample after {timeout_s:g} s"
    if "no python processes found" in reason.lower():
        reason += " - no ptrace permission?"  # how py-spy --subprocesses words a refusal
    spy.stop(5.0)
    print(f"copytrace: py-spy cannot attach ({reason}); running without it", file=sys.stderr)
    return None


# --- profiles ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Frame:
    """One stack frame as py-spy names it: ``file`` is a source path (Python) or a shared
    library (native); ``line`` is 0 for native frames."""

    name: str
    file: str = ""
    line: int = 0

    @property
    def native(self) -> bool:
        return self.line == 0 and (
            ".so" in self.file or self.name.startswith("0x") or not self.file
        )


@dataclass
class Stack:
    """One distinct stack: ``frames`` index :attr:`Profile.frames`, root first."""

    frames: tuple[int, ...]
    weight: float
    pid: int | None = None
    thread: str = ""  # e.g. ``"12345 MainThread"``; "" when the format does not say
    main: bool = False


@dataclass
class Profile:
    """A parsed py-spy profile.

    Attributes:
        path: The file read.
        format: ``speedscope`` or ``raw``.
        unit: ``seconds`` (speedscope weights) or ``samples`` (raw counts).
        frames: Distinct frames.
        stacks: Samples, merged by identical stack and thread.
        exporter: e.g. ``py-spy@0.4.3`` ('' if unknown).
        rate: Samples per second (speedscope: 1 / one sample's weight), 0 if unknown.
    """

    path: str
    format: str
    unit: str
    frames: list[Frame] = field(default_factory=list)
    stacks: list[Stack] = field(default_factory=list)
    exporter: str = ""
    rate: float = 0.0


_PROC_FRAME = re.compile(r"^process (\d+):")
_THREAD_NAME = re.compile(r'^(?:Process (\d+) )?Thread (\d+)(?: "(.*)")?')


def find_profiles(directory: str | os.PathLike[str]) -> list[Path]:
    """py-spy profiles (``*.speedscope.json``, ``*.pyspy.txt``) in ``directory``, sorted."""
    d = Path(directory)
    if not d.is_dir():
        return []
    return sorted(p for suffix in FORMATS.values() for p in d.glob(f"*{suffix}") if p.is_file())


def load_profile(path: str | os.PathLike[str]) -> Profile:
    """Read a py-spy speedscope JSON or raw (collapsed stacks) file.

    Raises:
        ValueError: the file is neither.
        OSError: it cannot be read.
    """
    p = Path(path)
    text = p.read_text(encoding="utf-8", errors="replace")
    if text.lstrip().startswith("{"):
        return _load_speedscope(p, json.loads(text))
    return _load_raw(p, text)


def _load_speedscope(path: Path, doc: dict[str, Any]) -> Profile:
    try:
        raw_frames = doc["shared"]["frames"]
        raw_profiles = doc["profiles"]
    except (KeyError, TypeError):
        raise ValueError(f"{path}: not a speedscope profile") from None
    frames = [
        Frame(str(f.get("name", "?")), str(f.get("file") or ""), int(f.get("line") or 0))
        for f in raw_frames
    ]
    prof = Profile(str(path), "speedscope", "seconds", frames, [], str(doc.get("exporter", "")))
    index: dict[tuple[tuple[int, ...], int | None, str], Stack] = {}
    for rp in raw_profiles:
        if rp.get("type") != "sampled":
            continue
        m = _THREAD_NAME.match(str(rp.get("name", "")))
        pid = int(m.group(1)) if m and m.group(1) else None
        tid = int(m.group(2)) if m else None
        tname = (m.group(3) or "") if m else str(rp.get("name", ""))
        unit = rp.get("unit", "none")
        samples = rp.get("samples") or []
        weights = rp.get("weights") or [1] * len(samples)
        if unit not in ("seconds", "milliseconds", "microseconds", "nanoseconds"):
            prof.unit = "samples"
        scale = {"milliseconds": 1e-3, "microseconds": 1e-6, "nanoseconds": 1e-9}.get(unit, 1.0)
        for sample, w in zip(samples, weights, strict=False):
            if prof.unit == "seconds" and w and (not prof.rate or 1.0 / (w * scale) > prof.rate):
                prof.rate = 1.0 / (float(w) * scale)
            stack = tuple(int(i) for i in sample)
            # --subprocesses: the stack starts with one "process N:..." frame per process
            # from the sampled root down to the sample's own process.
            spid = pid
            while stack:
                pm = _PROC_FRAME.match(frames[stack[0]].name)
                if not pm:
                    break
                spid = pid if pid is not None else int(pm.group(1))
                stack = stack[1:]
            thread = f"{tid} {tname}".strip() if tid is not None else tname
            main = tname == "MainThread" or (tid is not None and spid is not None and tid == spid)
            key = (stack, spid, thread)
            st = index.get(key)
            if st is None:
                st = index[key] = Stack(stack, 0.0, spid, thread, main)
                prof.stacks.append(st)
            st.weight += float(w) * scale
    return prof


def _parse_raw_frame(text: str) -> Frame:
    name, sep, where = text.rpartition(" (")
    if not sep or not where.endswith(")"):
        return Frame(text)
    where = where[:-1]
    file, colon, line = where.rpartition(":")
    if colon and line.isdigit():
        return Frame(name, file, int(line))
    return Frame(name, where, 0)


def _load_raw(path: Path, text: str) -> Profile:
    prof = Profile(str(path), "raw", "samples")
    frame_ids: dict[Frame, int] = {}
    index: dict[tuple[tuple[int, ...], int | None], Stack] = {}
    for line in text.splitlines():
        line = line.rstrip()
        if not line:
            continue
        body, _, count = line.rpartition(" ")
        if not body or not count.isdigit():
            raise ValueError(f"{path}: not a py-spy raw (collapsed stacks) file")
        parts = body.split(";")
        pid = None
        while parts:
            pm = _PROC_FRAME.match(parts[0])
            if not pm:
                break
            pid = int(pm.group(1))  # the last one is the sample's own process
            parts = parts[1:]
        ids = []
        for part in parts:
            fr = _parse_raw_frame(part)
            fid = frame_ids.get(fr)
            if fid is None:
                fid = frame_ids[fr] = len(prof.frames)
                prof.frames.append(fr)
            ids.append(fid)
        key = (tuple(ids), pid)
        st = index.get(key)
        if st is None:
            st = index[key] = Stack(tuple(ids), 0.0, pid, "", True)
            prof.stacks.append(st)
        st.weight += int(count)
    return prof


# --- classification ----------------------------------------------------------------------------
_KERNEL_RE = re.compile(
    r"^at::native::(?:\(anonymous namespace\)::)?(?:[A-Za-z0-9_]+::)?"
    r"(?:copy_|copy_impl|clone|_to_copy|_copy_from|_copy_from_and_resize|copy_kernel)\b"
    r"|direct_copy_kernel|copy_kernel|copy_same_type_transpose_|copy_device_to_device"
)
_API_NAMES = (
    "clone|to|cpu|cuda|contiguous|copy_|detach|detach_|type|float|double|half|bfloat16|int|long"
    "|short|char|byte|bool|numpy|new_tensor|reshape|tensor|get_data|set_data|from_numpy"
)
_API_RE = re.compile(
    rf"THPVariable_(?:{_API_NAMES})\b|torch::utils::tensor_ctor\b|torch::utils::tensor_new\b"
)
_API_PY_RE = re.compile(r"(?:^|\.)(?:__deepcopy__|deepcopy|_deepcopy_\w+|_traced_deepcopy)$")


def _strip_templates(name: str) -> str:
    out, depth = [], 0
    for ch in name:
        if ch == "<":
            depth += 1
        elif ch == ">" and depth:
            depth -= 1
        elif depth == 0:
            out.append(ch)
    return "".join(out)


def classify(frame: Frame) -> str:
    """``copy kernel``, ``copy API``, ``copytrace`` or '' for one frame."""
    name = _strip_templates(frame.name) if frame.native else frame.name
    file = frame.file.replace("\\", "/")
    if "copytrace/tracer/" in file:
        if _API_PY_RE.search(name):
            return API
        return TRACER
    if _KERNEL_RE.search(name):
        return KERNEL
    if _API_RE.search(name):
        return API
    if _API_PY_RE.search(name) and (
        file.endswith("copy.py") or "torch/" in file or "copytrace/" in file
    ):
        return API
    return ""


@dataclass
class FrameShare:
    """A frame's inclusive samples: ``seconds`` (or samples) and share of the scope."""

    label: str
    kind: str
    weight: float
    share: float


@dataclass
class ThreadStats:
    """Samples of one (process, thread): total and copy weights (see :class:`SampleStats`)."""

    pid: int | None
    thread: str
    main: bool
    weight: float = 0.0
    copy_calls: float = 0.0
    kernel: float = 0.0
    kernel_in_ops: float = 0.0
    api: float = 0.0
    tracer: float = 0.0


@dataclass
class SampleStats:
    """What py-spy's samples say about copies.

    Shares are fractions (0..1) of the scope's weight; the scope is the main thread of
    ``main_pid`` when given and present, else every sample. A sample counts in a share when
    its stack is, at any depth:

    Attributes:
        path, format, unit, exporter: From the profile.
        native: Native frames were recorded (every share but ``api_share``'s deepcopy part
            and ``tracer_share`` needs them).
        scope: What the shares are over, in words.
        weight: The scope's seconds (speedscope) or samples (raw).
        samples: Approximate sample count of the scope (weight x rate for seconds).
        copy_call_share: In a copy the trace records: a copy API call, or an aten copy op
            (``copy_``, ``clone``, ``_to_copy``, ``contiguous``...) that no other aten op
            called (an ``implicit`` copy). Compare it with the traced copy time.
        kernel_share: In a copy kernel (``at::native::copy_``, ``clone``,
            ``direct_copy_kernel``...), wherever it was called from.
        kernel_in_ops_share: In a copy kernel that another aten op ran inside itself
            (``addmm`` copying its bias into the output, ``cat``...): copies the trace does
            not record, because they never reach the dispatcher as ops of their own.
        api_share: In a copy API call (``Tensor.clone/to/contiguous/copy_/detach/.data``,
            ``torch.tensor``, ``copy.deepcopy``...).
        tracer_share: In copytrace's own code (its deepest tracer frame has no aten call
            below it): the tracer's overhead, approximately.
        copy_call_tracer_share: In copytrace's own code inside a copy call (recording it):
            ``copy_call_share - copy_call_tracer_share`` is the copy work itself, what the
            traced copy time measures.
        threads: Per (process, thread) weights.
        top_copy_frames: Copy frames by inclusive weight within the scope.
    """

    path: str
    format: str
    unit: str
    exporter: str
    native: bool
    scope: str
    weight: float
    samples: int
    copy_call_share: float
    kernel_share: float
    kernel_in_ops_share: float
    api_share: float
    tracer_share: float
    copy_call_tracer_share: float = 0.0
    threads: list[ThreadStats] = field(default_factory=list)
    top_copy_frames: list[FrameShare] = field(default_factory=list)

    @property
    def copy_work_share(self) -> float:
        """Copy calls without copytrace's own recording work in them."""
        return max(0.0, self.copy_call_share - self.copy_call_tracer_share)


def _short(name: str, width: int = 90) -> str:
    """Drop C++ template and parameter lists: ``f<T>(int) const`` -> ``f``."""
    short = _strip_templates(name).replace("(anonymous namespace)", "{anon}")
    if "(" in short and not short.startswith("("):
        head = short.split("(", 1)[0]
        short = head if head else short
    short = short.replace("{anon}", "(anonymous namespace)").strip() or name
    return short if len(short) <= width else short[: width - 3] + "..."


def _label(frame: Frame) -> str:
    if frame.line:
        return f"{frame.name} ({os.path.basename(frame.file)}:{frame.line})"
    return _short(frame.name)


#: aten ops (``at::_ops::<op>::call``) that copytrace records as copies or aliases.
_COPY_OPS = frozenset(
    "copy_ clone _to_copy to to_dtype to_device to_dtype_layout to_other contiguous reshape "
    "_reshape_copy _copy_from _copy_from_and_resize lift_fresh_copy _lazy_clone detach "
    "detach_ alias _reshape_alias view_copy".split()
)
_OP_FRAME = re.compile(r"^at::_ops::([A-Za-z0-9_]+)::(?:call|redispatch)$")


def _aten_op(name: str) -> str | None:
    m = _OP_FRAME.match(name)
    return m.group(1) if m else None


def _stack_flags(
    kinds: Sequence[str], names: Sequence[str], files: Sequence[str] = ()
) -> tuple[bool, ...]:
    """``(copy call, kernel, kernel inside another op, api, tracer)`` for one stack."""
    files = list(files) or [""] * len(names)
    kernel = KERNEL in kinds
    api = API in kinds
    top_copy_op = False
    in_other_op = False
    for name, kind in zip(names, kinds, strict=True):
        op = _aten_op(name)
        if op is not None:
            if op in _COPY_OPS:
                top_copy_op = top_copy_op or not in_other_op
            else:
                in_other_op = True
        if kind == KERNEL:
            break  # what runs below the kernel does not change where it was called from
    kernel_in_ops = kernel and not api and not top_copy_op and in_other_op
    tracer = False
    deepest = max((i for i, k in enumerate(kinds) if k == TRACER), default=-1)
    if deepest >= 0:
        tracer = not any(
            _torch_work(n, f)
            for n, f in zip(names[deepest + 1 :], files[deepest + 1 :], strict=True)
        )
    return api or top_copy_op, kernel, kernel_in_ops, api, tracer


_TORCH_WORK = (
    "at::",
    "torch::autograd::Engine",
    "torch::autograd::python::PythonEngine",
    "THPEngine",
)
_TORCH_PLUMBING_FILES = ("torch/overrides.py", "torch/utils/_python_dispatch.py", "torch/_ops.py")


def _torch_work(name: str, file: str) -> bool:
    """A frame that is torch doing real work (an op, autograd's engine, torch's Python code),
    as opposed to plumbing or a quick query that copytrace makes for its bookkeeping."""
    if name.startswith(_TORCH_WORK):
        return True
    file = file.replace("\\", "/")
    in_torch = file.startswith("torch/") or "/torch/" in file
    return in_torch and ".so" not in file and not file.endswith(_TORCH_PLUMBING_FILES)


def analyze(profile: Profile, main_pid: Any = None, top: int = 12) -> SampleStats:
    """Classify every sample; see :class:`SampleStats`.

    Args:
        profile: What :func:`load_profile` returned.
        main_pid: The shares are over the main thread of this pid (or of these pids, a
            collection); None: over every sample.
        top: How many copy frames to list.
    """
    kinds = [classify(f) for f in profile.frames]
    names = [f.name for f in profile.frames]
    files = [f.file for f in profile.frames]
    scope_stacks, scope = _scope(profile, main_pid)
    threads: dict[tuple[int | None, str], ThreadStats] = {}
    incl: dict[int, float] = {}
    sums = [0.0] * 7  # total, copy calls, kernel, kernel in ops, api, tracer, tracer in calls
    scope_ids = {id(s) for s in scope_stacks}
    for st in profile.stacks:
        flags = _stack_flags(
            [kinds[i] for i in st.frames],
            [names[i] for i in st.frames],
            [files[i] for i in st.frames],
        )
        ts = threads.get((st.pid, st.thread))
        if ts is None:
            ts = threads[(st.pid, st.thread)] = ThreadStats(st.pid, st.thread, st.main)
        w = st.weight
        ts.weight += w
        ts.copy_calls += w if flags[0] else 0.0
        ts.kernel += w if flags[1] else 0.0
        ts.kernel_in_ops += w if flags[2] else 0.0
        ts.api += w if flags[3] else 0.0
        ts.tracer += w if flags[4] else 0.0
        if id(st) not in scope_ids:
            continue
        sums[0] += w
        for k, flag in enumerate(flags, start=1):
            if flag:
                sums[k] += w
        if flags[0] and flags[4]:
            sums[6] += w
        for fid in set(st.frames):
            if kinds[fid] in (KERNEL, API):
                incl[fid] = incl.get(fid, 0.0) + w
    total = sums[0]
    by_label: dict[tuple[str, str], float] = {}
    for fid, w in incl.items():
        key = (_label(profile.frames[fid]), kinds[fid])
        by_label[key] = max(by_label.get(key, 0.0), w)
    top_frames = sorted(by_label.items(), key=lambda kv: -kv[1])[:top]
    rate = profile.rate
    samples = int(round(total * rate)) if profile.unit == "seconds" and rate else int(total)
    native = any(f.native and not f.name.startswith("0x") for f in profile.frames)

    def share(x: float) -> float:
        return x / total if total else 0.0

    return SampleStats(
        path=profile.path,
        format=profile.format,
        unit=profile.unit,
        exporter=profile.exporter,
        native=native,
        scope=scope,
        weight=total,
        samples=samples,
        copy_call_share=share(sums[1]),
        kernel_share=share(sums[2]),
        kernel_in_ops_share=share(sums[3]),
        api_share=share(sums[4]),
        tracer_share=share(sums[5]),
        copy_call_tracer_share=share(sums[6]),
        threads=sorted(threads.values(), key=lambda t: -t.weight),
        top_copy_frames=[FrameShare(label, kind, w, share(w)) for (label, kind), w in top_frames],
    )


def _scope(profile: Profile, main_pid: Any) -> tuple[list[Stack], str]:
    """The stacks of the main thread(s) of ``main_pid`` (an int or a collection), and what
    they are in words; every stack when ``main_pid`` is None or has no samples."""
    if main_pid is None:
        return list(profile.stacks), "all sampled threads"
    pids = {main_pid} if isinstance(main_pid, int) else {int(p) for p in main_pid}
    mine = [s for s in profile.stacks if s.main and (s.pid in pids or s.pid is None)]
    if not mine:
        return list(profile.stacks), "all sampled threads"
    listed = ", ".join(str(p) for p in sorted(pids))
    if profile.format == "raw":
        return mine, f"pid {listed}"
    return mine, f"main thread{'s' if len(pids) > 1 else ''} of pid {listed}"


# --- figure --------------------------------------------------------------------------------------
_COLOURS = {KERNEL: "#d62728", API: "#ff7f0e", TRACER: "#9467bd"}
_INSIDE_COPY = "#f7b6a8"
_PYTHON = "#9ecae1"
_NATIVE = "#d9d9d9"
#: Native frames that only pass a call on (dispatcher, boxing, pybind11, CPython's call
#: machinery): folded into their caller so that the icicle shows the frames that matter.
_PLUMBING = re.compile(
    r"^0x|^c10::impl::|^c10::Dispatcher::|^c10::BoxedKernel|^c10::KernelFunction|::redispatch$"
    r"|^torch::jit::|^pybind11::|^_?Py[A-Z]|^_?PyEval|^_?PyObject|^cfunction_|^method_vectorcall"
    r"|^vectorcall|^slot_tp_|^torch::autograd::TypeError_to_NotImplemented_|^std::"
    r"|^torch::handle_torch_function"
)
#: Python frames that only pass a call on: ``nn.Module.__call__``'s layers, torch's
#: decorators and override/op-call helpers.
_PY_PLUMBING = re.compile(
    r"torch/nn/modules/module\.py:(?:Module\._wrapped_call_impl|Module\._call_impl.*)$"
    r"|torch/utils/_contextlib\.py:.*decorate_context$"
    r"|torch/overrides\.py:handle_torch_function$"
    r"|torch/_ops\.py:OpOverload(?:Packet)?\.__call__$"
)
#: Python frames of the launcher (runpy, copytrace's CLI and start-up hook) above the program.
_LAUNCH_FILES = re.compile(r"runpy|copytrace/cli/|copytrace/__main__\.py|copytrace/_bootstrap\.py")


def _visible_frames(profile: Profile, frames: Sequence[int]) -> list[int]:
    """A stack without its launcher prefix and plumbing frames (see :data:`_PLUMBING`)."""
    start = 0
    for k, fid in enumerate(frames):
        fr = profile.frames[fid]
        if fr.line and _LAUNCH_FILES.search(fr.file.replace("\\", "/")):
            start = k + 1
    out = []
    for fid in frames[start:]:
        fr = profile.frames[fid]
        if fr.native and _PLUMBING.search(fr.name):
            continue
        if fr.line and _PY_PLUMBING.search(f"{fr.file.replace(chr(92), '/')}:{fr.name}"):
            continue
        out.append(fid)
    return out


def _tree(
    profile: Profile,
    stacks: Iterable[Stack],
    min_share: float,
    max_nodes: int,
    copies_only: bool = False,
) -> tuple[list[str], list[str], list[str], list[float], list[str], list[str]]:
    """Merged call tree as parallel lists for ``go.Icicle`` (ids, labels, parents, values,
    colours, hover). ``copies_only``: only samples in a copy, each cut at its first copy
    frame (so the tree shows who called the copies)."""
    kinds = [classify(f) for f in profile.frames]
    stacks = list(stacks)
    multi = len({(s.pid, s.thread) for s in stacks}) > 1
    root = "samples in copies" if copies_only else "all samples"
    # (parent id, label) -> [id, value, kind, inside a copy, hover]
    nodes: dict[tuple[str, str], list[Any]] = {}
    order: list[tuple[str, str]] = []
    counter = [0]
    total = 0.0

    def node(parent: str, label: str, kind: str, inside: bool, hover: str, w: float) -> str:
        key = (parent, label)
        entry = nodes.get(key)
        if entry is None:
            counter[0] += 1
            entry = nodes[key] = [f"n{counter[0]}", 0.0, kind, inside, hover]
            order.append(key)
        entry[1] += w
        return str(entry[0])

    for st in stacks:
        frames = _visible_frames(profile, st.frames)
        if copies_only:
            cut = next((k for k, fid in enumerate(frames) if kinds[fid] in (KERNEL, API)), None)
            if cut is None:
                continue
            frames = frames[: cut + 1]
        total += st.weight
        parent = "root"
        if multi:
            label = f"pid {st.pid} {st.thread}".strip() if st.pid else (st.thread or "thread")
            parent = node(parent, label, "", False, html.escape(label), st.weight)
        inside = False
        for fid in frames:
            fr = profile.frames[fid]
            kind = kinds[fid]
            hover = html.escape(fr.name if len(fr.name) < 300 else fr.name[:297] + "...")
            if fr.file:
                hover += "<br>" + html.escape(fr.file + (f":{fr.line}" if fr.line else ""))
            parent = node(parent, _label(fr), kind, inside, hover, st.weight)
            inside = inside or kind in (KERNEL, API)
    total = total or 1.0
    threshold = min_share * total
    kept = [k for k in order if nodes[k][1] >= threshold]
    if len(kept) > max_nodes:
        cut_value = sorted((nodes[k][1] for k in kept), reverse=True)[max_nodes - 1]
        kept = [k for k in kept if nodes[k][1] >= cut_value]
    kept_ids = {nodes[k][0] for k in kept} | {"root"}
    ids, labels, parents = ["root"], [root], [""]
    values, colours, hovers = [total], [_PYTHON], [f"{root}<br>{total:.3g} {profile.unit}"]
    for key in kept:
        parent, label = key
        if parent not in kept_ids:
            continue
        nid, value, kind, inside, hover = nodes[key]
        colour = _COLOURS.get(kind) or (_INSIDE_COPY if inside else None)
        if colour is None:
            colour = _PYTHON if "(" in label and label.endswith(")") and ":" in label else _NATIVE
        ids.append(nid)
        labels.append(html.escape(label))
        parents.append(parent)
        values.append(value)
        colours.append(colour)
        extra = f" · {kind}" if kind else (" · inside a copy" if inside else "")
        hovers.append(f"{hover}<br>{value / total:.1%} of these samples{extra}")
    return ids, labels, parents, values, colours, hovers


def pyspy_figure(
    profile: Profile, main_pid: int | None = None, *, min_share: float = 0.002,
    max_nodes: int = 3000, maxdepth: int = 16,
) -> Any:  # fmt: skip
    """An icicle of py-spy's samples (root on top), copy frames highlighted.

    Two views, switched by buttons: every sample, and only the samples in a copy, each
    stack cut at its first copy frame (who calls the copies). Copy kernels are red, copy
    API calls orange, copytrace's own frames purple and frames below a copy pale red; other
    Python frames are blue, native frames grey. The launcher's frames above the program and
    native plumbing frames (dispatcher, pybind11, CPython calls) are left out. Click a box
    to zoom into it.

    Args:
        profile: What :func:`load_profile` returned.
        main_pid: Draw only this process's main thread (or these processes', a collection)
            when the profile has it.
        min_share: Leave out frames below this share of the samples.
        max_nodes: At most this many boxes per view.
        maxdepth: Levels shown at once.

    Returns:
        A ``plotly.graph_objects.Figure``.
    """
    import plotly.graph_objects as go

    stats = analyze(profile, main_pid)
    stacks, _ = _scope(profile, main_pid)
    fig = go.Figure()
    for copies_only in (False, True):
        ids, labels, parents, values, colours, hovers = _tree(
            profile, stacks, min_share, max_nodes, copies_only
        )
        fig.add_trace(
            go.Icicle(
                ids=ids,
                labels=labels,
                parents=parents,
                values=values,
                branchvalues="total",
                marker={"colors": colours, "line": {"width": 0.5, "color": "#ffffff"}},
                hovertext=hovers,
                hoverinfo="text",
                tiling={"orientation": "v"},
                maxdepth=maxdepth,
                textfont={"size": 11},
                visible=not copies_only,
                name="copies only" if copies_only else "all samples",
            )
        )
    fig.update_layout(
        title={
            "text": (
                f"py-spy samples ({html.escape(stats.scope)}): copy work "
                f"{stats.copy_work_share:.1%}, copy kernels {stats.kernel_share:.1%}, "
                f"copytrace {stats.tracer_share:.1%}"
            ),
            "x": 0.01,
            "xanchor": "left",
        },
        height=640,
        margin={"l": 10, "r": 10, "t": 80, "b": 10},
        template="plotly_white",
        updatemenus=[
            {
                "type": "buttons",
                "direction": "right",
                "x": 1.0,
                "xanchor": "right",
                "y": 1.08,
                "yanchor": "bottom",
                "showactive": True,
                "buttons": [
                    {
                        "label": "all samples",
                        "method": "update",
                        "args": [{"visible": [True, False]}],
                    },
                    {
                        "label": "copies: who calls them",
                        "method": "update",
                        "args": [{"visible": [False, True]}],
                    },
                ],
            }  # fmt: skip
        ],
    )
    return fig


# --- the report section ------------------------------------------------------------------------
def traced_numbers(model: Any, pid: Any) -> dict[str, float | None]:
    """Copy time and overhead the trace itself reports, for the run of ``pid`` (or all).

    Returns:
        ``copy_share`` (summed event duration / run duration), ``overhead_share``
        (copytrace's own recording time / run duration, None when not recorded),
        ``duration_s`` and ``copy_s``.
    """
    runs = list(getattr(model, "runs", []) or [])
    pids = set() if pid is None else ({pid} if isinstance(pid, int) else set(pid))
    chosen = [r for r in runs if getattr(r, "pid", None) in pids] or runs
    labels = {getattr(r, "label", None) for r in chosen}
    duration = sum(int(getattr(r, "duration_ns", 0) or 0) for r in chosen)
    steps = [s for s in getattr(model, "steps", []) or [] if getattr(s, "run", None) in labels]
    if steps:
        copy_ns = sum(int(getattr(s, "copy_time_ns", 0) or 0) for s in steps)
    else:
        copy_ns = int(getattr(getattr(model, "totals", None), "copy_time_ns", 0) or 0)
    overheads = [getattr(r, "overhead_ns", None) for r in chosen]
    overhead = (
        sum(o for o in overheads if o is not None)
        if any(o is not None for o in overheads)
        else None
    )
    return {
        "duration_s": duration / 1e9,
        "copy_s": copy_ns / 1e9,
        "copy_share": copy_ns / duration if duration else None,
        "overhead_share": overhead / duration if (duration and overhead is not None) else None,
    }


def _pid_of(path: Path) -> int | None:
    m = re.search(r"-(\d+)(?:\.speedscope\.json|\.pyspy\.txt)$", path.name)
    return int(m.group(1)) if m else None


def summary_line(stats: SampleStats, traced: dict[str, float | None] | None = None) -> str:
    """One line: the sampled shares, and the traced ones beside them."""
    unit = "s" if stats.unit == "seconds" else " samples"
    line = (
        f"py-spy: {stats.samples} samples ({stats.weight:.3g}{unit}, {stats.scope}): "
        f"copy work {stats.copy_work_share:.1%}"
    )
    if traced and traced.get("copy_share") is not None:
        line += f" (traced copy time: {traced['copy_share']:.1%})"
    line += (
        f" + copytrace recording them {stats.copy_call_tracer_share:.1%}; "
        f"copytrace in all {stats.tracer_share:.1%}"
    )
    if traced and traced.get("overhead_share") is not None:
        line += f" (traced overhead: {traced['overhead_share']:.1%})"
    line += (
        f"; copy kernels {stats.kernel_share:.1%}, of which {stats.kernel_in_ops_share:.1%} "
        "inside other ops (not traced)"
    )
    return line


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def report_sections(model: Any) -> str:
    """The py-spy sections for a report of ``model`` ('' when there is no profile).

    Profiles are looked for beside the model's trace files. A report of one trace file
    takes only that process's profile; a report of several takes every profile beside them.
    """
    files = [Path(f) for f in getattr(model, "files", []) or []]
    if not files:
        return ""
    stems = [f.name.split(".", 1)[0] for f in files]
    found: list[Path] = []
    for d in sorted({f.parent for f in files}):
        for prof in find_profiles(d):
            stem = prof.name.split(".", 1)[0]
            if len(files) > 1 or any(t == stem or t.startswith(stem + "-") for t in stems):
                found.append(prof)
    return _sections(found, model)


def report_section_html(directory: str | os.PathLike[str], model: Any = None) -> str:
    """HTML sections for every py-spy profile in ``directory`` ('' when there is none).

    Each section has the cross-check table (sampled shares next to the traced ones), the top
    copy frames and the icicle (:func:`pyspy_figure`, drawn with the page's plotly.js).
    A profile that cannot be read becomes a one-line note instead.
    """
    d = Path(directory)
    if not d.is_dir():
        d = d.parent
    return _sections(find_profiles(d), model)


def _sections(profiles: Sequence[Path], model: Any) -> str:
    parts = []
    for i, path in enumerate(profiles):
        pid: Any = _pid_of(path)
        traced_pids = {getattr(r, "pid", None) for r in getattr(model, "runs", []) or []}
        traced_pids.discard(None)
        if pid not in traced_pids and traced_pids:
            pid = sorted(traced_pids)  # a launcher sampled with its workers: theirs
        try:
            profile = load_profile(path)
            stats = analyze(profile, pid)
            fig = pyspy_figure(profile, pid)
        except (OSError, ValueError, KeyError, TypeError) as err:
            parts.append(
                f'<section id="pyspy-{i}"><h2>py-spy</h2><p class="note">'
                f"{html.escape(path.name)} could not be read: {html.escape(str(err))}</p></section>"
            )
            continue
        traced = traced_numbers(model, pid) if model is not None else None
        parts.append(_section(i, path, stats, traced, fig))
    return "\n".join(parts)


def _section(i: int, path: Path, stats: SampleStats, traced: Any, fig: Any) -> str:
    e = html.escape
    unit = "s" if stats.unit == "seconds" else "samples"
    rows = [("samples", f"{stats.samples:,} ({stats.weight:.3g} {unit})", stats.scope)]
    rows.append(("sampled: copy work", _pct(stats.copy_work_share),
                 "in copy API calls and aten copy ops that no other op called, less "
                 "copytrace's own frames in them: what the traced copy time measures"))  # fmt: skip
    if traced:
        rows.append(("traced: copy time", _pct(traced.get("copy_share")),
                     "copytrace's timers: summed event duration / run duration"))  # fmt: skip
    rows.append(("sampled: copytrace recording copies", _pct(stats.copy_call_tracer_share),
                 "copytrace's own frames inside those calls"))  # fmt: skip
    rows.append(("sampled: copytrace in all", _pct(stats.tracer_share),
                 "the tracer's own code anywhere (its handlers run on every torch call)"))  # fmt: skip
    if traced and traced.get("overhead_share") is not None:
        rows.append(("traced: overhead", _pct(traced.get("overhead_share")),
                     "copytrace's timers: its own recording time / run duration"))  # fmt: skip
    rows.append(("sampled: copy kernels", _pct(stats.kernel_share),
                 "aten copy kernels, wherever called from"))  # fmt: skip
    rows.append(("... inside other ops", _pct(stats.kernel_in_ops_share),
                 "copy kernels run inside another aten op (addmm copying its bias, cat...): "
                 "not recorded by the trace"))  # fmt: skip
    rows.append(("sampled: copy API calls", _pct(stats.api_share),
                 "clone/to/contiguous/copy_/detach/deepcopy... calls, copytrace's handling "
                 "included"))  # fmt: skip
    if not stats.native:
        rows.append(("note", "no native frames", "kernel shares need py-spy --native"))
    table = "".join(
        f"<tr><td>{e(k)}</td><td class='n'>{e(v)}</td><td>{e(n)}</td></tr>" for k, v, n in rows
    )
    top = (
        "".join(
            f"<tr><td><code>{e(f.label)}</code></td><td>{e(f.kind)}</td>"
            f"<td class='n'>{f.share:.1%}</td></tr>"
            for f in stats.top_copy_frames
        )
        or "<tr><td colspan='3'>no copy frame sampled</td></tr>"
    )
    # Drawn by the page's report.js once plotly.js is ready (inlined compressed, or from
    # the CDN); the figure's JSON is escaped so that no string can close the script element.
    fig_json = fig.to_json().replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    div = (
        f'<div id="copytrace-pyspy-{i}" class="fig plotly-graph-div"></div>'
        f'<script type="application/json" class="ct-fig" data-div="copytrace-pyspy-{i}">'
        f"{fig_json}</script>"
    )
    return (
        f'<section id="pyspy-{i}">'
        f"<h2>py-spy: sampled view ({e(path.name)})</h2>"
        '<p class="lead">Independent of copytrace\'s timers: py-spy sampled the process while '
        "it was traced. Shares are of wall time (idle samples included); compare the sampled "
        "rows with the traced ones.</p>"
        '<div class="scroll"><table><tr><th>measure</th><th class="n">share</th><th>what</th>'
        f"</tr>{table}</table></div>"
        "<h3>Top copy frames (inclusive share of samples)</h3>"
        '<div class="scroll"><table><tr><th>frame</th><th>kind</th><th class="n">share</th>'
        f"</tr>{top}</table></div>"
        f"{div}</section>"
    )
