"""Build, cache and load copytrace's C++ copy observer (the ``*.cpp`` units beside this file).

The observer is a small torch C++ extension: boxed kernels for aten's copy and alias ops only,
on the BackendSelect dispatch key (``kernels.cpp``), the API level's C handler, level lean's
hot-patched pointers, tensor facts and the event record in C. Its units share one header,
``observer.h``, which lists them; ``module.cpp`` holds the one list of entry points, typed in
``observer.pyi``. Units that need no torch header include none (torch.utils.cpp_extension gives
every unit the same flags, so they still get torch's include paths, which cost nothing unread).
It is built once per exact torch build with ``torch.utils.cpp_extension.load`` (g++ and ninja,
the units in parallel) into a cache directory keyed by torch's version, its git revision, the
Python version and a hash of every source and the header, and loaded from there afterwards (a
few ms). After loading, :func:`load` hands the C record the schema's event field names
(``record_setup``) and the rule table :data:`copytrace.tracer._rules.RULES`
(``set_record_rules``).

Where it cannot be built (no C++ compiler, no ninja, a failed build) copytrace falls back to its
Python ``TorchDispatchMode`` and says so once on stderr. ``COPYTRACE_OBSERVER`` chooses:
``auto`` (default: the C++ observer when it can be had), ``native`` (the same, but a failure
to build is reported as an error) or ``python`` (always the Python dispatch mode).
``copytrace doctor`` prints which path is active and why.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import sysconfig
import threading
from pathlib import Path
from types import ModuleType
from typing import Any

from copytrace import _env

__all__ = ["load", "loaded", "status", "cache_dir", "OBSERVER_CHOICES"]

OBSERVER_CHOICES = _env.OBSERVERS
_HERE = Path(__file__).parent
#: The translation units, module.cpp (the entry points) last. torch_units.cpp includes the
#: units that read torch's C++ types (kernels, versions, facts, record, watch_cb): one parse of
#: torch's Tensor headers for the five.
_UNITS = (
    "torch_units.cpp", "api_mode.cpp", "warn_shim.cpp", "lean.cpp", "hotpatch.cpp", "legacy.cpp",
    "frames.cpp", "audit.cpp", "attached.cpp", "compiled.cpp", "columns.cpp", "otlp.cpp",
    "module.cpp",
)  # fmt: skip
_SOURCES = tuple(_HERE / unit for unit in _UNITS)
#: Everything the build reads (every unit, included or not, and the header): a change to any of
#: it is a new cache key.
_INPUTS = tuple(sorted((*_HERE.glob("*.cpp"), *_HERE.glob("*.h"))))
_lock = threading.Lock()
_state: dict[str, Any] = {"module": None, "reason": None, "tried": False, "built": False}


def _key() -> str:
    import torch

    git = (getattr(torch.version, "git_version", None) or "unknown")[:12]
    digest = hashlib.sha256()
    for path in _INPUTS:
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    src = digest.hexdigest()[:12]
    py = f"py{sys.version_info[0]}{sys.version_info[1]}"
    return f"torch{torch.__version__}-{git}-{py}-{src}".replace("+", "_")


def cache_dir() -> Path:
    """Directory of this torch build's observer: ``$COPYTRACE_CACHE_DIR`` or
    ``$XDG_CACHE_HOME/copytrace`` (``~/.cache/copytrace``), then ``observer/<key>``."""
    root = os.environ.get(_env.COPYTRACE_CACHE_DIR)
    if not root:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(xdg, "copytrace")
    return Path(root) / "observer" / _key()


def _compiler() -> str | None:
    cxx = os.environ.get("CXX") or sysconfig.get_config_var("CXX") or "c++"
    exe = cxx.split()[0] if cxx else "c++"
    return shutil.which(exe)


def _ninja() -> bool:
    try:
        from torch.utils.cpp_extension import is_ninja_available

        return bool(is_ninja_available())
    except Exception:
        return False


def _module_name() -> str:
    return "copytrace_observer_" + hashlib.sha256(_key().encode()).hexdigest()[:10]


def _load_cached() -> ModuleType | None:
    """Import an already built observer directly: torch.utils.cpp_extension (which imports
    setuptools) costs about 0.3 s more at start-up. ``None`` when there is none yet."""
    import importlib.util

    import torch  # noqa: F401 - the extension links against libtorch, which torch loads

    name = _module_name()
    path = cache_dir() / f"{name}.so"
    if not path.is_file():
        return None
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            return None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    except Exception:  # a partial file of a build in progress: let cpp_extension decide
        return None


def _build() -> ModuleType:
    import torch
    from torch.utils.cpp_extension import load as load_extension

    directory = cache_dir()
    directory.mkdir(parents=True, exist_ok=True)
    name = _module_name()
    if not any(directory.glob(f"{name}*.so")):
        print(
            f"copytrace: building copytrace's observer for torch {torch.__version__}, once, "
            f"about 30 s (cached in {directory})",
            file=sys.stderr,
            flush=True,
        )
        _state["built"] = True
    return load_extension(
        name=name,
        sources=[str(path) for path in _SOURCES],
        build_directory=str(directory),
        # NDEBUG: torch's release build has it; its headers change struct layouts without it.
        extra_cflags=["-O2", "-DNDEBUG"],
        verbose=False,
    )


def _event_fields() -> tuple[str, ...]:
    """The event's field names as the schema lists them (the C record checks its own against
    them): the schema's one import on the native side."""
    from copytrace import schema

    return schema.EVENT_SLOTS


def _setup(module: ModuleType) -> ModuleType:
    """Hand the C record its tables: the schema's fields (``record_setup``) and the rule
    table (``set_record_rules``); raises where they do not fit it."""
    from copytrace.tracer import _rules

    module.record_setup(_event_fields())
    module.set_record_rules(_rules.RULES)
    return module


def _build_here() -> ModuleType | None:
    """:func:`_build` where a compiler and ninja are found; else None, the reason noted."""
    if _compiler() is None:
        _state["reason"] = "no C++ compiler found (set CXX or install g++)"
    elif not _ninja():
        _state["reason"] = "ninja not found (pip install ninja)"
    else:
        try:
            return _build()
        except Exception as err:  # a failed build: fall back, say why
            first = str(err).strip().splitlines()
            _state["reason"] = f"build failed: {first[0] if first else type(err).__name__}"
    return None


def choice() -> str:
    """``$COPYTRACE_OBSERVER`` (checked by copytrace._env); ``auto`` when not accepted here,
    where nothing may raise (``copytrace run`` and the hook refuse such a value first)."""
    try:
        return str(_env.setting(_env.COPYTRACE_OBSERVER))
    except _env.SettingError:
        return _env.OBSERVERS[0]


def load() -> ModuleType | None:
    """The observer module, building it on first use; ``None`` where it cannot be had (the
    reason is in :func:`status`). Never raises."""
    with _lock:
        if _state["tried"]:
            return _state["module"]
        _state["tried"] = True
        if choice() == "python":
            _state["reason"] = "COPYTRACE_OBSERVER=python"
            return None
        module = _load_cached()
        if module is None:
            module = _build_here()
        if module is not None:
            try:
                _state["module"] = _setup(module)
            except Exception as err:  # the schema and the C record disagree: say so
                _state["reason"] = f"set-up failed: {err}"
        if _state["module"] is None:
            print(
                f"copytrace: C++ observer unavailable ({_state['reason']}): using the Python "
                "dispatch mode instead (about 2-3x the cost per op on op-bound steps; "
                "torch.compile'd code still runs compiled)",
                file=sys.stderr,
                flush=True,
            )
        return _state["module"]


def loaded() -> ModuleType | None:
    """The observer module if :func:`load` has loaded it, else ``None``; never builds."""
    return _state["module"]


def status() -> dict[str, Any]:
    """Which aten-level path tracing uses and why: ``{"path": "native"|"python", "reason",
    "cache_dir", "choice"}``. Loads (and may build) the observer."""
    module = load()
    return {
        "path": "native" if module is not None else "python",
        "reason": _state["reason"] or ("built now" if _state["built"] else "loaded from cache"),
        "cache_dir": str(cache_dir()),
        "choice": choice(),
    }
