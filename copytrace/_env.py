"""Environment variables that configure copytrace, each with its default.

They are read by the start-up hook (``COPYTRACE=1``) and by ``copytrace run``. The
standard ``OTEL_*`` variables (``OTEL_SERVICE_NAME``, ``OTEL_RESOURCE_ATTRIBUTES``,
``OTEL_TRACES_SAMPLER``...) are honoured by the OpenTelemetry SDK itself.

============================= ================= ============================================
variable                      default           meaning
============================= ================= ============================================
``COPYTRACE``                 unset (off)       ``1`` traces every Python process started
                                                with it in its environment (see below)
``COPYTRACE_OUTPUT``          ``copytrace-out`` output directory for trace files and the
                                                report
``COPYTRACE_REPORT``          ``1``             write ``report.html`` when the launch ends
``COPYTRACE_MAX_EVENTS``      ``1000000``       cap on records buffered between two flushes
                                                (beyond it: dropped and counted)
``COPYTRACE_AUTO_STEP``       ``1``             each ``optimizer.step()`` ends a step (until
                                                the program calls ``Trace.step()`` itself)
``COPYTRACE_REPORT_WAIT``     ``30``            seconds the report writer waits for other
                                                traced processes still writing their traces
                                                (and a process for its window's report)
``COPYTRACE_SCHEDULE``        unset (all)       steps traced, as ``torch.profiler.schedule``:
                                                ``wait=1,warmup=1,active=3,repeat=2``
``COPYTRACE_COMPRESSION``     ``gzip``          trace file compression: ``gzip`` or ``none``
``COPYTRACE_FLUSH_EVENTS``    ``4096``          flush records to the trace file at the first
                                                step boundary with this many buffered, within
                                                a step at 4x this many (0: at the end only)
``COPYTRACE_FLUSH_SECONDS``   ``5``             ... or this many seconds after the previous
                                                one
``COPYTRACE_LEVEL``           ``lean``          ``lean``: no Python mode on the hot path
                                                (needs the C++ observer; without it, as
                                                ``full``); ``full``: copytrace's function
                                                mode on torch's stack; ``api``: the
                                                function mode only (no implicit copies)
``COPYTRACE_OBSERVER``        ``auto``          how aten-level copies are seen: ``auto``
                                                (copytrace's C++ observer where it can be
                                                built, else the Python mode), ``native``
                                                (the same; a failed build is an error) or
                                                ``python``
``COPYTRACE_CACHE_DIR``       (user cache)      where the C++ observer is built and cached
``COPYTRACE_PY_SPY``          (found)           the py-spy executable for ``copytrace run
                                                --py-spy``; default: beside the interpreter,
                                                else on ``PATH``
``COPYTRACE_REDACT``          ``1``             redact secrets in the recorded command line
                                                (``0``: record it as it is)
``COPYTRACE_REDACT_PATTERNS`` unset             more option-name patterns to redact (comma
                                                separated regular expressions)
``COPYTRACE_TRIGGER``         ``none``          ``signal``: armed and idle until the trigger
                                                signal, then trace a window of steps
``COPYTRACE_TRIGGER_SIGNAL``  ``SIGUSR2``       the signal that starts a window
``COPYTRACE_TRIGGER_STEPS``   ``10``            steps traced per window
``COPYTRACE_RING``            ``0`` (off)       flight recorder: keep only the last N
                                                records, written when something goes wrong
``COPYTRACE_RING_SIGNAL``     ``SIGUSR1``       the signal that writes the ring
``COPYTRACE_LIBRARY_PATHS``   unset             more path prefixes (``os.pathsep``-separated)
                                                whose code counts as a library's, not the
                                                user's (an editable or vendored library)
============================= ================= ============================================

Every process of a launch (the process started with ``COPYTRACE=1``, its ``torchrun``
ranks, ``multiprocessing`` children and DataLoader workers) writes its own trace file. The
first one, the *root*, writes the one merged report when it exits; see
:mod:`copytrace.launch`. ``COPYTRACE_LAUNCH`` is set by the root for its descendants and
is not meant to be set by hand.
"""

from __future__ import annotations

import operator
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from copytrace._errors import SettingError
from copytrace._outdir import unwritable

__all__ = [
    "COPYTRACE",
    "unwritable",
    "COPYTRACE_OUTPUT",
    "COPYTRACE_REPORT",
    "COPYTRACE_MAX_EVENTS",
    "COPYTRACE_AUTO_STEP",
    "COPYTRACE_REPORT_WAIT",
    "COPYTRACE_LAUNCH",
    "COPYTRACE_PY_SPY",
    "COPYTRACE_SCHEDULE",
    "COPYTRACE_LEVEL",
    "COPYTRACE_COMPRESSION",
    "COPYTRACE_FLUSH_EVENTS",
    "COPYTRACE_FLUSH_SECONDS",
    "COPYTRACE_OBSERVER",
    "COPYTRACE_CACHE_DIR",
    "COPYTRACE_REDACT",
    "COPYTRACE_REDACT_PATTERNS",
    "COPYTRACE_TRIGGER",
    "COPYTRACE_TRIGGER_SIGNAL",
    "COPYTRACE_TRIGGER_STEPS",
    "COPYTRACE_RING",
    "COPYTRACE_RING_SIGNAL",
    "COPYTRACE_LIBRARY_PATHS",
    "TRIGGERS",
    "DEFAULT_OUTPUT_DIR",
    "DEFAULT_MAX_EVENTS",
    "DEFAULT_REPORT_WAIT_S",
    "DEFAULT_FLUSH_EVENTS",
    "DEFAULT_FLUSH_SECONDS",
    "LEVELS",
    "COMPRESSIONS",
    "OBSERVERS",
    "SCHEDULE_FIELDS",
    "SettingError",
    "Setting",
    "SETTINGS",
    "setting",
    "settings",
    "check",
    "enabled",
    "output_dir",
    "trace_options",
    "parse_level",
    "parse_compression",
    "parse_observer",
    "parse_schedule",
    "TORCH_TESTED",
    "torch_tested",
    "parse_signal",
    "parse_trigger",
]

#: Set to 1 to trace any Python program with no code change (read by the start-up hook).
COPYTRACE = "COPYTRACE"
#: Output directory for trace files and the report. Default: ``./copytrace-out``.
COPYTRACE_OUTPUT = "COPYTRACE_OUTPUT"
#: Write ``report.html`` at exit under ``COPYTRACE=1`` (1, the default) or not (0).
COPYTRACE_REPORT = "COPYTRACE_REPORT"
#: Cap on records buffered between two flushes (beyond it they are dropped and counted).
#: Default: 1000000.
COPYTRACE_MAX_EVENTS = "COPYTRACE_MAX_EVENTS"
#: Let ``optimizer.step()`` mark step boundaries (1, the default) or not (0).
COPYTRACE_AUTO_STEP = "COPYTRACE_AUTO_STEP"
#: Seconds the process that writes the report waits for the other traced processes of the
#: launch to finish writing their traces. Default: 30.
COPYTRACE_REPORT_WAIT = "COPYTRACE_REPORT_WAIT"
#: Internal: the launch id, set by the root process for its descendants (``<pid>-<ns>``).
COPYTRACE_LAUNCH = "COPYTRACE_LAUNCH"
#: The py-spy executable for ``copytrace run --py-spy``. Default: ``py-spy`` beside the
#: Python interpreter, else on ``PATH``.
COPYTRACE_PY_SPY = "COPYTRACE_PY_SPY"
#: Steps traced, torch.profiler-style: ``wait=1,warmup=1,active=3,repeat=2,skip_first=10``.
#: Unset: every step.
COPYTRACE_SCHEDULE = "COPYTRACE_SCHEDULE"
#: One of :data:`LEVELS`. Default: ``lean``.
COPYTRACE_LEVEL = "COPYTRACE_LEVEL"
#: Trace file compression, one of :data:`COMPRESSIONS`. Default: ``gzip``.
COPYTRACE_COMPRESSION = "COPYTRACE_COMPRESSION"
#: Records buffered before they are flushed at a step boundary. Default: 4096 (0: at the end).
COPYTRACE_FLUSH_EVENTS = "COPYTRACE_FLUSH_EVENTS"
#: Seconds after which buffered records are flushed at the next step boundary. Default: 5.
COPYTRACE_FLUSH_SECONDS = "COPYTRACE_FLUSH_SECONDS"
#: One of :data:`OBSERVERS`. Default: ``auto``.
COPYTRACE_OBSERVER = "COPYTRACE_OBSERVER"
#: Directory where the C++ observer is built and cached. Default: ``$XDG_CACHE_HOME/copytrace``
#: (``~/.cache/copytrace``).
COPYTRACE_CACHE_DIR = "COPYTRACE_CACHE_DIR"
#: Redact secrets in the recorded command line (1, the default) or not (0); see
#: :mod:`copytrace._redact`.
COPYTRACE_REDACT = "COPYTRACE_REDACT"
#: More option-name patterns to redact, comma separated regular expressions (added to
#: ``copytrace._redact.DEFAULT_PATTERNS``).
COPYTRACE_REDACT_PATTERNS = "COPYTRACE_REDACT_PATTERNS"
#: One of :data:`TRIGGERS`: ``none`` traces from the start; ``signal`` stays armed and idle
#: until ``COPYTRACE_TRIGGER_SIGNAL`` arrives, then traces ``COPYTRACE_TRIGGER_STEPS`` steps.
COPYTRACE_TRIGGER = "COPYTRACE_TRIGGER"
#: The signal that starts a traced window (a name: ``SIGUSR2``, the default, or ``USR2``).
COPYTRACE_TRIGGER_SIGNAL = "COPYTRACE_TRIGGER_SIGNAL"
#: Steps traced per window under ``COPYTRACE_TRIGGER=signal``. Default: 10.
COPYTRACE_TRIGGER_STEPS = "COPYTRACE_TRIGGER_STEPS"
#: Flight recorder: keep only the last N records (0, the default: off), written with the
#: run span on an uncaught exception, SIGTERM or ``COPYTRACE_RING_SIGNAL``.
COPYTRACE_RING = "COPYTRACE_RING"
#: The signal that writes the flight recorder's ring. Default: ``SIGUSR1``.
COPYTRACE_RING_SIGNAL = "COPYTRACE_RING_SIGNAL"
#: Path prefixes whose code is a library's call site (beside site-packages / dist-packages);
#: read by copytrace.tracer._callsite when the first call site is classified.
COPYTRACE_LIBRARY_PATHS = "COPYTRACE_LIBRARY_PATHS"

DEFAULT_OUTPUT_DIR = "copytrace-out"
DEFAULT_MAX_EVENTS = 1_000_000
DEFAULT_REPORT_WAIT_S = 30.0
DEFAULT_FLUSH_EVENTS = 4096
DEFAULT_FLUSH_SECONDS = 5.0
DEFAULT_TRIGGER_STEPS = 10
#: ``COPYTRACE_TRIGGER`` values (the default first).
TRIGGERS: tuple[str, ...] = ("none", "signal")

#: Tracing levels, the default first: ``lean`` (the C++ observer for the aten level and C
#: wrappers for the API, no Python mode on the hot path), ``full`` (copytrace's function mode on
#: torch's stack for the API) and ``api`` (the function mode only). The accepted set of
#: ``level=`` and ``COPYTRACE_LEVEL``.
LEVELS: tuple[str, ...] = ("lean", "full", "api")
#: Trace file compressions: the accepted set of ``compression=`` and ``COPYTRACE_COMPRESSION``.
COMPRESSIONS: tuple[str, ...] = ("gzip", "none")
#: How aten-level copies are seen: the accepted set of ``observer=`` and
#: ``COPYTRACE_OBSERVER`` (the default first).
OBSERVERS: tuple[str, ...] = ("auto", "native", "python")
#: The fields of a schedule, as ``torch.profiler.schedule`` names them.
SCHEDULE_FIELDS: tuple[str, ...] = ("wait", "warmup", "active", "repeat", "skip_first")

#: The torch releases the test suite runs on (CI: 2.13.0 and 2.14.1), as the oldest and newest
#: ``(major, minor)``. pyproject.toml's ``torch>=2.13,<2.15`` admits exactly these (a test
#: checks that the two agree) and ``copytrace doctor`` warns on any other: older releases
#: lack torch facts the hazards read (2.9.1: no ``SavedTensor.data``, and
#: ``torch._C._storage_Use_Count`` one lower once an alias is gone).
TORCH_TESTED: tuple[tuple[int, int], tuple[int, int]] = ((2, 13), (2, 14))

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _choices(values: tuple[str, ...]) -> str:
    """``"a or b"``, ``"a, b or c"``."""
    return values[0] if len(values) == 1 else ", ".join(values[:-1]) + " or " + values[-1]


def _refuse(name: str, value: str, accepted: str) -> SettingError:
    return SettingError(f"{name}: not {value!r}; use {accepted}")


# --- parsers: text -> typed value, or SettingError naming the variable --------------------
def _flag(name: str, text: str) -> bool:
    low = text.strip().lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise _refuse(name, text, "1 or 0 (or true/false, yes/no, on/off)")


def _whole(name: str, text: str) -> int:
    try:
        value = int(text.strip().replace("_", ""))
    except ValueError:
        value = -1
    if value < 0:
        raise _refuse(name, text, "a whole number >= 0")
    return value


def _seconds(name: str, text: str) -> float:
    try:
        value = float(text.strip())
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):  # also refuses nan
        raise _refuse(name, text, "a number of seconds >= 0")
    return value


def _one_of(values: tuple[str, ...]) -> Callable[[str, str], str]:
    def parse(name: str, text: str) -> str:
        low = text.strip().lower()
        if low not in values:
            raise _refuse(name, text, _choices(values))
        return low

    return parse


def _text(name: str, text: str) -> str:
    return text.strip()


def _positive(name: str, text: str) -> int:
    value = _whole(name, text) if text.strip().replace("_", "").isdigit() else 0
    if value < 1:
        raise _refuse(name, text, "a whole number >= 1")
    return value


def parse_trigger(value: Any, name: str = "trigger") -> str:
    """A trigger, one of :data:`TRIGGERS` (``None``: ``"none"``).

    Raises:
        SettingError: any other value (``trigger: not 'usr2'; use none or signal``).
    """
    return "none" if value is None else _one_of(TRIGGERS)(name, str(value))


#: Signal names of POSIX and Windows: a name here that this platform's :mod:`signal` lacks
#: is accepted (the session says once that it has no such signal); any other is refused.
_SIGNAL_NAMES = frozenset(
    "SIGHUP SIGQUIT SIGILL SIGTRAP SIGABRT SIGBUS SIGFPE SIGUSR1 SIGSEGV SIGUSR2 SIGPIPE "
    "SIGALRM SIGTERM SIGCHLD SIGCONT SIGTSTP SIGTTIN SIGTTOU SIGURG SIGXCPU SIGXFSZ SIGVTALRM "
    "SIGPROF SIGWINCH SIGIO SIGPOLL SIGPWR SIGSYS SIGEMT SIGINFO SIGBREAK".split()
)
#: Signals a setting may not name: SIGKILL and SIGSTOP cannot be handled (the kernel acts on
#: them alone), and SIGINT is Ctrl-C, whose handler raises KeyboardInterrupt in the program.
_UNTAKEN = {
    "SIGKILL": "SIGKILL cannot be handled",
    "SIGSTOP": "SIGSTOP cannot be handled",
    "SIGINT": "SIGINT is Ctrl-C: the program's KeyboardInterrupt",
}


def parse_signal(value: Any, name: str = "signal") -> str:
    """A signal name (``SIGUSR2``, ``usr2``) -> ``"SIGUSR2"``. A POSIX or Windows name that
    this platform lacks is accepted (the session says so once where it installs it).

    Raises:
        SettingError: not a signal name, or SIGKILL, SIGSTOP or SIGINT (one line naming
            ``name``: ``COPYTRACE_RING_SIGNAL: not 'SIGBOGUS'; use a signal name ...``).
    """
    import signal

    text = str(value).strip().upper()
    sig = text if text.startswith("SIG") else "SIG" + text
    if sig in _UNTAKEN:
        raise _refuse(name, str(value), f"another signal such as SIGUSR2 or SIGUSR1 "
                      f"({_UNTAKEN[sig]})")  # fmt: skip
    known = sig in _SIGNAL_NAMES or isinstance(getattr(signal, sig, None), signal.Signals)
    if not known or sig.startswith(("SIG_", "SIGRT")):
        raise _refuse(name, str(value), "a signal name such as SIGUSR2 or SIGUSR1")
    return sig


def _signal(name: str, text: str) -> str:
    return parse_signal(text, name)


def _patterns(name: str, text: str) -> tuple[str, ...]:
    import re

    parts = tuple(p.strip() for p in text.split(",") if p.strip())
    for part in parts:
        try:
            re.compile(part)
        except re.error as err:
            raise _refuse(
                name, text, f"comma separated regular expressions ({part!r}: {err})"
            ) from None
    return parts


def parse_count(value: Any, name: str, least: int = 0) -> int:
    """A whole number >= ``least`` given as an option (an int or numpy integer; not a bool,
    a float or a string), e.g. ``trace(max_events=...)``.

    Raises:
        SettingError: anything else (``max_events: not -1; use a whole number >= 0``).
    """
    try:
        number = operator.index(value) if not isinstance(value, bool) else -1
    except TypeError:
        number = least - 1
    if number < least:
        raise SettingError(f"{name}: not {value!r}; use a whole number >= {least}")
    return number


def parse_seconds(value: Any, name: str) -> float:
    """A finite number of seconds >= 0 given as an option (``trace(flush_seconds=...)``).

    Raises:
        SettingError: anything else (``flush_seconds: not -5; use a number of seconds >= 0``).
    """
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or not 0 <= value < float("inf"):  # also refuses nan
        raise SettingError(f"{name}: not {value!r}; use a number of seconds >= 0")
    return float(value)


def parse_level(value: Any, name: str = "level") -> str:
    """A tracing level, one of :data:`LEVELS` (case and blanks ignored).

    Raises:
        SettingError: any other value (``level: not 'fast'; use lean, full or api``).
    """
    return _one_of(LEVELS)(name, str(value))


def parse_compression(value: Any, name: str = "compression") -> str:
    """A trace file compression, one of :data:`COMPRESSIONS`.

    Raises:
        SettingError: any other value (``compression: not 'zstd'; use gzip or none``).
    """
    return _one_of(COMPRESSIONS)(name, str(value))


def parse_observer(value: Any, name: str = "observer") -> str:
    """An observer choice, one of :data:`OBSERVERS`.

    Raises:
        SettingError: any other value (``observer: not 'cuda'; use auto, native or python``).
    """
    return _one_of(OBSERVERS)(name, str(value))


def parse_schedule(text: str, name: str = "schedule") -> dict[str, int]:
    """``"wait=1,warmup=1,active=3,repeat=2,skip_first=10"`` (any subset, any order, ``,``
    or ``;`` between fields) -> ``{"wait": 1, ...}``; every value a whole number >= 0 and
    ``active`` >= 1.

    Raises:
        SettingError: an unknown field, a value that is not a whole number, ``active=0``.
    """
    values: dict[str, int] = {}
    for part in text.replace(";", ",").split(","):
        if not part.strip():
            continue
        field, sep, value = part.partition("=")
        field = field.strip().replace("-", "_")
        if not sep or field not in SCHEDULE_FIELDS or not value.strip().isdigit():
            values = {}
            break
        values[field] = int(value)
    if not values or values.get("active", 1) < 1:
        raise _refuse(
            name, text, "e.g. wait=1,warmup=1,active=3,repeat=2,skip_first=10 "
            f"(fields {', '.join(SCHEDULE_FIELDS)}: whole numbers, active >= 1)",
        )  # fmt: skip
    return values


def _schedule(name: str, text: str) -> dict[str, int]:
    return parse_schedule(text, name)


@dataclass(frozen=True)
class Setting:
    """One variable: its name, its value when unset (or empty) and its parser."""

    name: str
    default: Any
    parse: Callable[[str, str], Any]


#: Every variable copytrace reads, in the order of the table above.
SETTINGS: dict[str, Setting] = {
    s.name: s
    for s in (
        Setting(COPYTRACE, False, _flag),
        Setting(COPYTRACE_OUTPUT, DEFAULT_OUTPUT_DIR, _text),
        Setting(COPYTRACE_REPORT, True, _flag),
        Setting(COPYTRACE_MAX_EVENTS, DEFAULT_MAX_EVENTS, _whole),
        Setting(COPYTRACE_AUTO_STEP, True, _flag),
        Setting(COPYTRACE_REPORT_WAIT, DEFAULT_REPORT_WAIT_S, _seconds),
        Setting(COPYTRACE_SCHEDULE, None, _schedule),
        Setting(COPYTRACE_COMPRESSION, COMPRESSIONS[0], _one_of(COMPRESSIONS)),
        Setting(COPYTRACE_FLUSH_EVENTS, DEFAULT_FLUSH_EVENTS, _whole),
        Setting(COPYTRACE_FLUSH_SECONDS, DEFAULT_FLUSH_SECONDS, _seconds),
        Setting(COPYTRACE_LEVEL, LEVELS[0], _one_of(LEVELS)),
        Setting(COPYTRACE_OBSERVER, OBSERVERS[0], _one_of(OBSERVERS)),
        Setting(COPYTRACE_CACHE_DIR, None, _text),
        Setting(COPYTRACE_PY_SPY, None, _text),
        Setting(COPYTRACE_LAUNCH, None, _text),
        Setting(COPYTRACE_REDACT, True, _flag),
        Setting(COPYTRACE_REDACT_PATTERNS, (), _patterns),
        Setting(COPYTRACE_TRIGGER, TRIGGERS[0], _one_of(TRIGGERS)),
        Setting(COPYTRACE_TRIGGER_SIGNAL, "SIGUSR2", _signal),
        Setting(COPYTRACE_TRIGGER_STEPS, DEFAULT_TRIGGER_STEPS, _positive),
        Setting(COPYTRACE_RING, 0, _whole),
        Setting(COPYTRACE_RING_SIGNAL, "SIGUSR1", _signal),
        Setting(COPYTRACE_LIBRARY_PATHS, None, _text),
    )
}


def setting(name: str, environ: Mapping[str, str] | None = None) -> Any:
    """The typed value of variable ``name`` (its default when unset or empty).

    Raises:
        SettingError: the value is not accepted; the message names the variable, the value
            and the accepted values.
        KeyError: ``name`` is not one of :data:`SETTINGS`.
    """
    spec = SETTINGS[name]
    text = (os.environ if environ is None else environ).get(name)
    if text is None or not text.strip():
        return spec.default
    return spec.parse(name, text)


def ring_and_trigger(
    ring: int, trigger: str, ring_name: str = COPYTRACE_RING, trigger_name: str = COPYTRACE_TRIGGER
) -> None:
    """Refuse the flight recorder together with the trigger: the ring records every step to
    keep the last N events, the trigger records nothing until its signal, and each writes
    at a different moment (on a failure; at the end of a window).

    Raises:
        SettingError: ``ring`` > 0 and ``trigger`` is ``"signal"`` (one line naming both).
    """
    if ring and trigger == "signal":
        raise SettingError(
            f"{ring_name}={ring} and {trigger_name}=signal do not go together: the flight "
            f"recorder records every step to keep the last {ring} events, the trigger records "
            f"nothing until its signal; use one of them"
        )


def check(environ: Mapping[str, str] | None = None) -> list[SettingError]:
    """Every variable whose value is not accepted, as errors (empty: all are fine), and
    then settings that do not go together (:func:`ring_and_trigger`)."""
    errors = []
    for name in SETTINGS:
        try:
            setting(name, environ)
        except SettingError as err:
            errors.append(err)
    if not errors:
        try:
            ring_and_trigger(setting(COPYTRACE_RING, environ), setting(COPYTRACE_TRIGGER, environ))
        except SettingError as err:
            errors.append(err)
    return errors


def settings(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """``{variable: typed value}`` for every variable.

    Raises:
        SettingError: the first variable whose value is not accepted, or settings that do
            not go together (:func:`ring_and_trigger`).
    """
    values = {name: setting(name, environ) for name in SETTINGS}
    ring_and_trigger(values[COPYTRACE_RING], values[COPYTRACE_TRIGGER])
    return values


def enabled() -> bool:
    """True when ``COPYTRACE`` asks for tracing.

    Raises:
        SettingError: ``COPYTRACE`` is neither on nor off (``COPYTRACE=banana``).
    """
    return bool(setting(COPYTRACE))


def output_dir() -> str:
    """The output directory from ``COPYTRACE_OUTPUT`` or the default."""
    return str(setting(COPYTRACE_OUTPUT))


def trace_options(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Keyword arguments for :class:`copytrace.Trace` from the variables above: every
    option the environment sets (``max_events``, ``auto_step``, ``schedule`` (a dict or
    None), ``level``, ``observer``, ``compression``, ``flush_events``, ``flush_seconds``).

    Raises:
        SettingError: a variable holds a value that is not accepted.
    """
    return {
        "max_events": setting(COPYTRACE_MAX_EVENTS, environ),
        "auto_step": setting(COPYTRACE_AUTO_STEP, environ),
        "schedule": setting(COPYTRACE_SCHEDULE, environ),
        "level": setting(COPYTRACE_LEVEL, environ),
        "observer": setting(COPYTRACE_OBSERVER, environ),
        "compression": setting(COPYTRACE_COMPRESSION, environ),
        "flush_events": setting(COPYTRACE_FLUSH_EVENTS, environ),
        "flush_seconds": setting(COPYTRACE_FLUSH_SECONDS, environ),
        "trigger": setting(COPYTRACE_TRIGGER, environ),
        "trigger_steps": setting(COPYTRACE_TRIGGER_STEPS, environ),
        "ring": setting(COPYTRACE_RING, environ),
    }


def torch_tested(version: str) -> bool:
    """True when torch ``version`` (``torch.__version__``: ``"2.14.1+cu130"``,
    ``"2.13.0a0+git1234"``) is a release of :data:`TORCH_TESTED`'s range; False for any
    other, and for a string that does not start with ``major.minor``."""
    found = re.match(r"(\d+)\.(\d+)", str(version))
    if found is None:
        return False
    release = (int(found.group(1)), int(found.group(2)))
    return TORCH_TESTED[0] <= release <= TORCH_TESTED[1]
