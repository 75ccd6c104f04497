"""The differential runner: run the same cases untraced and traced, compare what they saw.

A *case* is a named callable ``scenario(probe)`` built fresh for every run (from PyTorch's own
test databases, see :mod:`._cases`). :func:`observe` runs a list of cases under one
:class:`Config`: untraced, or inside one ``copytrace.trace(write=False, level=...,
observer=...)``. Every case starts from the same seed; what it sees is kept as *fingerprints*
(plain, comparable values: a tensor becomes its type, dtype, shape, stride, storage offset,
layout, device, autograd flags, version counter, which input it aliases, and its bytes), keyed
``step/kind/name``. :func:`compare` then reports each key whose fingerprint differs from the
untraced run's as a :class:`Difference` of one of :data:`KINDS`.

Untraced runs twice first: the first run spends once-per-process warnings and lazy set-up, and
a key whose fingerprint differs between the two untraced runs (uninitialised memory, a
nondeterministic kernel) is *unstable* and left out of the comparison (counted, never hidden).

Bitwise means bitwise: values are compared as bytes (so NaN payloads and the sign of zero
count, and two NaNs in the same place are equal), Python floats by ``float.hex``.
"""

from __future__ import annotations

import gc
import random
import sys
import traceback
import warnings
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

import copytrace

__all__ = [
    "KINDS",
    "FAILED",
    "Config",
    "UNTRACED",
    "configs",
    "Difference",
    "Observation",
    "Probe",
    "Report",
    "fingerprint",
    "observe",
    "compare",
    "run_cases",
]

#: What a difference is about: a step's result (``output``), a gradient (``grad``), a
#: module's or optimizer's state (``state``), an exception (type and message), the warnings
#: (category, message, filename, line), torch's mode stack lengths (``modes``), the weakref
#: count, the reference count, the version counter of the inputs, torch's global hook dicts
#: (``hooks``), an exception sent to ``sys.unraisablehook`` (``unraisable``), and copytrace's
#: own swallowed errors (``internal_error``).
KINDS = (
    "output",
    "grad",
    "state",
    "exception",
    "warnings",
    "modes",
    "weakrefs",
    "refcount",
    "version",
    "hooks",
    "unraisable",
    "internal_error",
)

SEED = 0


class _Failed:
    def __repr__(self) -> str:
        return "FAILED"


#: What :meth:`Probe.step` returns when the step raised.
FAILED: Any = _Failed()


@dataclass(frozen=True)
class Config:
    """One way to run the cases: untraced (``level=None``) or traced at ``level`` with the
    C++ observer (``observer="native"``) or the Python fallback (``"python"``)."""

    level: str | None = None
    observer: str | None = None

    @property
    def name(self) -> str:
        return "untraced" if self.level is None else f"{self.level}/{self.observer}"

    @property
    def modes_are_mechanism(self) -> bool:
        """True where copytrace's modes stay on torch's stacks for the whole trace by design
        (level ``full`` and ``api``, and the Python fallback): there the stack lengths are
        compared relative to the trace's start, elsewhere absolutely."""
        return self.level is not None and not (self.level == "lean" and self.observer == "native")


UNTRACED = Config()


def configs(levels: Iterable[str], observers: Iterable[str]) -> list[Config]:
    """The traced configurations, observer-major: ``[lean/native, full/native, ...]``."""
    return [Config(level, observer) for observer in observers for level in levels]


def seed_all(seed: int = SEED) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def mode_lengths() -> tuple[int, int]:
    """(torch function mode stack length, dispatch mode stack length)."""
    return torch._C._len_torch_function_stack(), torch._C._len_torch_dispatch_stack()


def global_hooks() -> tuple[int, ...]:
    """Sizes of torch's global hook dicts a program can inspect (optimizer step hooks, module
    hooks, the registered-buffer/parameter/module hooks)."""
    from torch.nn.modules import module as m
    from torch.optim import optimizer as o

    return (
        len(o._global_optimizer_pre_hooks),
        len(o._global_optimizer_post_hooks),
        len(m._global_forward_pre_hooks),
        len(m._global_forward_hooks),
        len(m._global_backward_pre_hooks),
        len(m._global_backward_hooks),
        len(m._global_buffer_registration_hooks),
        len(m._global_parameter_registration_hooks),
        len(m._global_module_registration_hooks),
    )


# -- fingerprints -----------------------------------------------------------------------------


def _tensor_bytes(t: torch.Tensor) -> Any:
    try:
        d = t.detach()
        if d.is_meta:
            return None
        if d.is_nested:
            return tuple(_tensor_bytes(x) for x in d.unbind())
        if d.layout != torch.strided:
            d = d.to_dense()
        if d.is_quantized:
            d = d.int_repr()
        d = d.resolve_conj().resolve_neg().contiguous().reshape(-1)
        return d.view(torch.uint8).numpy().tobytes()
    except Exception as err:  # a tensor-like whose values cannot be read: say so
        return ("unreadable", type(err).__name__)


def _storage_key(t: torch.Tensor) -> int | None:
    try:
        if t.layout != torch.strided or t.is_meta or t.is_nested:
            return None
        return t.untyped_storage().data_ptr()
    except Exception:
        return None


def _tensor_print(t: torch.Tensor, inputs: dict[int, int], values: bool) -> tuple:
    strided = t.layout == torch.strided and not t.is_nested
    key = _storage_key(t)
    grad_fn = t.grad_fn
    meta = (
        type(t).__qualname__,
        str(t.dtype),
        tuple(t.shape),
        tuple(t.stride()) if strided else None,
        t.storage_offset() if strided else None,
        str(t.layout),
        str(t.device),
        t.requires_grad,
        t.is_leaf,
        None if grad_fn is None else type(grad_fn).__name__,
        t.is_conj(),
        t.is_neg(),
        t._version if not t.is_inference() else None,
        # which input tensor (by position) this one shares storage with, if any
        inputs.get(key) if key else None,
    )
    return ("tensor", meta, _tensor_bytes(t) if values else "values not compared")


def fingerprint(value: Any, inputs: dict[int, int] | None = None, values: bool = True) -> Any:
    """A plain comparable value for ``value``: nested containers become tuples, tensors
    ``("tensor", meta, bytes)`` (see module doc), floats their ``float.hex``, other objects
    their type's name (never their ``repr``: it may hold an address).

    Args:
        inputs: storage data pointer -> input position, to name which input a tensor aliases.
        values: False for outputs whose values are uninitialised memory (``torch.empty``).
    """
    inputs = inputs or {}
    if isinstance(value, torch.Tensor):
        return _tensor_print(value, inputs, values)
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(fingerprint(v, inputs, values) for v in value))
    if isinstance(value, dict):
        return (
            type(value).__name__,
            tuple((repr(k), fingerprint(v, inputs, values)) for k, v in value.items()),
        )
    if isinstance(value, bool) or value is None or isinstance(value, (int, str, bytes)):
        return value
    if isinstance(value, float):
        return ("float", value.hex())
    if isinstance(value, complex):
        return ("complex", value.real.hex(), value.imag.hex())
    if isinstance(value, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
        return repr(value)
    return ("object", type(value).__qualname__)


def storage_index(tensors: Iterable[Any]) -> dict[int, int]:
    """storage data pointer -> position of the first of ``tensors`` that uses it."""
    out: dict[int, int] = {}
    for i, t in enumerate(tensors):
        if isinstance(t, torch.Tensor):
            key = _storage_key(t)
            if key and key not in out:
                out[key] = i
    return out


# -- probe ------------------------------------------------------------------------------------


class Probe:
    """What one case saw, as fingerprints keyed ``step/kind/name`` (kind one of :data:`KINDS`)."""

    def __init__(
        self, warnlog: list, base_modes: tuple[int, int], relative: bool, config: Config = UNTRACED,
    ) -> None:
        self.seen: dict[str, Any] = {}
        #: the configuration the case runs under
        self.config = config
        self._log = warnlog
        self._base = base_modes
        self._relative = relative
        self.claimed: list[tuple[int, int]] = []

    def note(self, key: str, value: Any, inputs: Iterable[Any] = (), values: bool = True) -> None:
        """Keep ``value``'s fingerprint under ``key`` (``step/kind[/name]``)."""
        self.seen[key] = fingerprint(value, storage_index(inputs), values)

    def step(self, name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Call ``fn``; keep its exception (type, message) and its warnings under ``name``.

        Returns:
            What ``fn`` returned, or :data:`FAILED` if it raised an ``Exception``.
        """
        start = len(self._log)
        try:
            result = fn(*args, **kwargs)
            self.seen[f"{name}/exception"] = None
        except Exception as err:
            self.seen[f"{name}/exception"] = (type(err).__qualname__, str(err))
            result = FAILED
        end = len(self._log)
        self.claimed.append((start, end))
        self.seen[f"{name}/warnings"] = tuple(_warning_print(w) for w in self._log[start:end])
        return result

    def inputs(self, name: str, tensors: list[Any]) -> None:
        """Keep the weakref count, reference count and version counter of ``tensors`` and
        torch's mode stack lengths now, under ``name``."""
        tensors = [t for t in tensors if isinstance(t, torch.Tensor)]
        self.seen[f"{name}/weakrefs"] = tuple(weakref.getweakrefcount(t) for t in tensors)
        # every run holds the same references (the case, its list, the loop): only a
        # reference the tracer keeps can tell the runs apart
        self.seen[f"{name}/refcount"] = tuple(sys.getrefcount(t) for t in tensors)
        self.seen[f"{name}/version"] = tuple(
            None if t.is_inference() else t._version for t in tensors
        )
        fn, disp = mode_lengths()
        if self._relative:
            fn, disp = fn - self._base[0], disp - self._base[1]
        self.seen[f"{name}/modes"] = (fn, disp)


def _warning_print(w: warnings.WarningMessage) -> tuple:
    return (w.category.__qualname__, str(w.message), w.filename, w.lineno)


# -- running ----------------------------------------------------------------------------------

Case = tuple[str, Callable[[Probe], None]]


@dataclass
class Observation:
    """What all cases saw under one :class:`Config`."""

    config: Config
    records: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: seen outside any case: the mode stacks at trace start and after it, stray warnings
    session: dict[str, Any] = field(default_factory=dict)
    errors: int = 0
    first_error: str | None = None
    observer_path: str | None = None


def observe(config: Config, build: Callable[[], list[Case]], group: str = "") -> Observation:
    """Build the cases (seeded, before the trace starts) and run each one, seeded, under
    ``config``. The trace (one per call) is started and stopped here; its internal error
    count and first error are kept on the :class:`Observation`."""
    obs = Observation(config)
    unraisable: list[Any] = []
    saved_hook = sys.unraisablehook
    sys.unraisablehook = lambda u: unraisable.append((type(u.exc_value).__qualname__, str(u.exc_value)))
    try:
        with warnings.catch_warnings(record=True) as log:
            warnings.simplefilter("always")
            seed_all()
            try:
                cases = build()
            except Exception as err:
                obs.session["build/exception"] = (type(err).__qualname__, str(err))
                cases = []
            # no cyclic collection while the cases run: a cycle freed at a random moment (a
            # sample generator's frame) would change reference counts between runs
            gc.collect()
            gc.disable()
            try:
                claimed = _run(config, cases, log, obs)
            finally:
                gc.enable()
            taken = {i for start, end in claimed for i in range(start, end)}
            obs.session["session/warnings"] = tuple(
                _warning_print(w) for i, w in enumerate(log) if i not in taken
            )
    finally:
        sys.unraisablehook = saved_hook
    obs.session["session/unraisable"] = tuple(unraisable)
    obs.session["stop/modes"] = mode_lengths()
    obs.session["stop/hooks"] = global_hooks()
    return obs


def _run(config: Config, cases: list[Case], log: list, obs: Observation) -> list:
    trace = None
    if config.level is not None:
        trace = copytrace.trace(write=False, level=config.level, observer=config.observer)
        trace.start()
    claimed: list = []
    try:
        base = mode_lengths()
        if not config.modes_are_mechanism:
            obs.session["start/modes"] = base
        obs.session["start/hooks"] = global_hooks()
        for name, scenario in cases:
            seed_all()
            probe = Probe(log, base, config.modes_are_mechanism, config)
            try:
                scenario(probe)
            except Exception as err:  # the harness's own trouble shows as a difference
                probe.seen["harness/exception"] = (type(err).__qualname__, str(err))
            obs.records[name] = probe.seen
            claimed.extend(probe.claimed)
            del probe
    finally:
        if trace is not None:
            trace.stop()
            obs.errors = trace.stats["errors"]
            obs.first_error = trace.first_error
            obs.observer_path = trace.observer_path
    return claimed


# -- comparing --------------------------------------------------------------------------------


@dataclass
class Difference:
    """One key whose fingerprint differs from the untraced run's."""

    config: str
    case: str
    key: str
    kind: str
    untraced: Any
    traced: Any

    def describe(self, width: int = 200) -> str:
        where, a, b = _first_change(self.untraced, self.traced, "")
        return (
            f"[{self.config}] {self.case} {self.key} ({self.kind}): at {where or 'top'}\n"
            f"    untraced: {_short(a, width)}\n"
            f"    traced:   {_short(b, width)}"
        )


#: names of a tensor fingerprint's meta fields (see ``_tensor_print``)
META = (
    "type", "dtype", "shape", "stride", "storage_offset", "layout", "device", "requires_grad",
    "is_leaf", "grad_fn", "is_conj", "is_neg", "_version", "aliases_input",
)


def _short(value: Any, width: int) -> str:
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def _first_change(a: Any, b: Any, where: str) -> tuple[str, Any, Any]:
    """The path to the first leaf at which two fingerprints differ, and the two leaves (for
    tensor bytes: how many elements differ and the largest absolute difference)."""
    if isinstance(a, tuple) and isinstance(b, tuple) and a[:1] == b[:1] == ("tensor",):
        for name, x, y in zip(META, a[1], b[1], strict=False):
            if x != y:
                return f"{where}.{name}", x, y
        return f"{where}.values", *_value_detail(a, b)
    if isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b) == 2 and a[0] == b[0]:
        if isinstance(a[1], tuple) and isinstance(b[1], tuple) and len(a[1]) == len(b[1]):
            for i, (x, y) in enumerate(zip(a[1], b[1], strict=True)):
                if x != y:
                    label = x[0] if isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str) else i
                    if label != i and isinstance(y, tuple) and x[0] == y[0]:
                        return _first_change(x[1], y[1], f"{where}[{label}]")
                    return _first_change(x, y, f"{where}[{i}]")
    return where, a, b


def _value_detail(a: tuple, b: tuple) -> tuple[str, str]:
    """Two tensor fingerprints' values side by side, or how far apart they are."""
    if not isinstance(a[2], bytes) or not isinstance(b[2], bytes):
        return a[2], b[2]
    dtype = getattr(torch, a[1][1].removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype) or not (dtype.is_floating_point or dtype.is_complex):
        return "bytes", "other bytes"
    x = torch.frombuffer(bytearray(a[2]), dtype=dtype) if a[2] else torch.empty(0, dtype=dtype)
    y = torch.frombuffer(bytearray(b[2]), dtype=dtype) if b[2] else torch.empty(0, dtype=dtype)
    diff = (x.to(torch.complex128) - y.to(torch.complex128)).abs()
    same = (x == y) | (x.isnan() & y.isnan())
    return "values", (
        f"{int((~same).sum())} of {x.numel()} element(s) differ, max |diff| "
        f"{diff.nan_to_num(nan=0.0).max() if diff.numel() else 0:.3g}"
    )


def _kind(key: str) -> str:
    for part in reversed(key.split("/")):
        if part in KINDS:
            return part
    return "output"


def compare(base: Observation, again: Observation, traced: Observation) -> tuple[list[Difference], int]:
    """Differences of ``traced`` from ``base`` over keys on which the two untraced runs
    ``base`` and ``again`` agree, and the number of keys left out as unstable.

    Stack lengths at the trace's start are compared only where copytrace's modes are not its
    mechanism (:attr:`Config.modes_are_mechanism`). Internal errors are a difference of kind
    ``internal_error`` on the case ``<session>``.
    """
    diffs: list[Difference] = []
    unstable = 0
    name = traced.config.name
    tables = [("<session>", base.session, again.session, traced.session)]
    for case, seen in base.records.items():
        tables.append((case, seen, again.records.get(case, {}), traced.records.get(case, {})))
    for case in traced.records.keys() - base.records.keys():
        tables.append((case, {}, {}, traced.records[case]))
    for case, a, b, t in tables:
        for key in dict.fromkeys([*a, *t]):
            if key == "start/modes" and traced.config.modes_are_mechanism:
                continue
            if key == "start/hooks" and key not in t:
                continue
            if a.get(key, "<absent>") != b.get(key, "<absent>"):
                unstable += 1
                continue
            if a.get(key, "<absent>") != t.get(key, "<absent>"):
                diffs.append(Difference(name, case, key, _kind(key), a.get(key, "<absent>"), t.get(key, "<absent>")))
    if traced.errors:
        diffs.append(
            Difference(name, "<session>", "copytrace/internal_error", "internal_error", 0, (traced.errors, traced.first_error))
        )
    return diffs, unstable


@dataclass
class Report:
    """The outcome of :func:`run_cases` over many groups (one op, module or optimizer each)."""

    configs: list[Config]
    samples: int = 0
    groups: int = 0
    unstable: int = 0
    internal_errors: int = 0
    differences: list[Difference] = field(default_factory=list)
    first_errors: list[str] = field(default_factory=list)
    observer_paths: set = field(default_factory=set)
    #: config name -> copytrace's internal errors counted in its traces
    errors_by_config: dict[str, int] = field(default_factory=dict)
    #: value differences that are torch's reads of uninitialised memory (``_recheck``)
    uninitialised: list[Difference] = field(default_factory=list)
    #: differences the caller already explains (``test_oracle.is_known``): reported as the
    #: others are, but not run again by ``_recheck`` (on the Python fallback every group with
    #: a gradient has one, and the recheck would run such a group six times more)
    known: Callable[[Difference], bool] | None = None

    def by_kind(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for d in self.differences:
            out[d.kind] = out.get(d.kind, 0) + 1
        return dict(sorted(out.items()))

    def by_case(self) -> set[str]:
        return {d.case for d in self.differences}

    def by_config(self) -> dict[str, tuple[int, int]]:
        """config name -> (differences, internal errors), every config of the report."""
        diffs = dict.fromkeys((c.name for c in self.configs), 0)
        for d in self.differences:
            diffs[d.config] = diffs.get(d.config, 0) + 1
        return {name: (n, self.errors_by_config.get(name, 0)) for name, n in diffs.items()}


_FROZEN: list[bool] = []


def run_cases(report: Report, group: str, build: Callable[[], list[Case]]) -> None:
    """Run one group of cases untraced twice, then under each of ``report.configs``, and add
    the samples run, unstable keys, differences and internal errors to ``report``. A value
    difference is looked at again (:mod:`._recheck`): one that is torch's reading of
    uninitialised memory goes to ``report.uninitialised``, one on which more untraced runs
    disagree counts as unstable; one that ``report.known`` explains is not looked at again."""
    if not _FROZEN:  # the databases' objects move out of the collector's way (gc.collect: ms)
        gc.collect()
        gc.freeze()
        _FROZEN.append(True)
    base = observe(UNTRACED, build, group)
    again = observe(UNTRACED, build, group)
    report.groups += 1
    report.samples += len(base.records)
    from . import _recheck  # it runs groups again with observe: imported here, not above

    extra: list[Observation] = []
    filled: list[Observation] = []
    for config in report.configs:
        traced = observe(config, build, group)
        report.observer_paths.add((config.name, traced.observer_path))
        found, unstable = compare(base, again, traced)
        known = {id(d) for d in found if report.known is not None and report.known(d)}
        diffs = [d for d in found if id(d) not in known]
        diffs, uninitialised = _recheck.uninitialised(diffs, base, config, build, group, filled)
        report.uninitialised.extend(uninitialised)
        diffs, flaky = _recheck.confirm(diffs, base, extra, build, group)
        unstable += flaky
        kept = known | {id(d) for d in diffs}
        diffs = [d for d in found if id(d) in kept]  # in compare's order: the error is last
        for d in diffs:
            if d.case == "<session>" and d.kind != "internal_error":
                d.case = f"{group} <session>"
        report.differences.extend(diffs)
        report.unstable += unstable
        report.internal_errors += traced.errors
        report.errors_by_config[config.name] = report.errors_by_config.get(config.name, 0) + traced.errors
        if traced.errors and traced.first_error and len(report.first_errors) < 5:
            report.first_errors.append(f"[{config.name}] {group}: {traced.first_error}")
        if traced.errors:
            report.differences[-1].case = f"{group} <session>"


def format_exception() -> str:
    return traceback.format_exc()
