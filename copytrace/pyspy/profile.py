"""py-spy's independent view of a traced run: parse and measure (plain data).

``copytrace run --py-spy`` starts ``py-spy record --pid <its own pid> --native --idle
--subprocesses`` before the program runs and stops it right after, so py-spy samples the
program while copytrace traces it. py-spy's samples never go through copytrace's timers: the
share of samples inside copy kernels and copy API calls is an independent measure of what
the trace reports as copy time, and the share inside copytrace's own code is a measure of
the tracer's overhead.

Everything here is plain data and plain functions, testable without py-spy:
:func:`load_profile` reads a speedscope JSON or raw (collapsed stacks) file,
:func:`analyze` classifies the samples (:class:`SampleStats` says exactly what each share
counts); :mod:`copytrace.pyspy.compare` sets the trace's own figures beside them.
Starting py-spy is :mod:`copytrace.pyspy.launch`; the report's icicle and section are
:mod:`copytrace.dashboards.sections.pyspy`.

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
    enough that shares stay comparable.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "API",
    "FORMATS",
    "KERNEL",
    "TRACER",
    "Frame",
    "FrameShare",
    "Profile",
    "SampleStats",
    "Stack",
    "ThreadStats",
    "analyze",
    "classify",
    "find_profiles",
    "label",
    "load_profile",
    "scope",
]

KERNEL, API, TRACER = "copy kernel", "copy API", "copytrace"
#: ``--py-spy-format`` value -> file suffix.
FORMATS = {"speedscope": ".speedscope.json", "raw": ".pyspy.txt"}


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


def label(frame: Frame) -> str:
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
    scope_stacks, scope_text = scope(profile, main_pid)
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
        key = (label(profile.frames[fid]), kinds[fid])
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
        scope=scope_text,
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


def scope(profile: Profile, main_pid: Any) -> tuple[list[Stack], str]:
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


