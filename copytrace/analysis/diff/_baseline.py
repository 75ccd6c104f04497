"""A run's profile as a small JSON file: the baseline the pytest plugin keeps per test.

The file holds what :func:`~._compare.compare` needs of BASE, and nothing else (no events):
per call site its totals, per-step copy times, ops and transfers, and its source line as it
was when recorded (so a later edit of the test file is matched, :mod:`._match`); the
module and op totals; the hazards. Call-site paths under ``root`` are written relative to
it, so that a baseline committed to a repository holds no machine path and reads back in
any checkout::

    {"version": 1, "test": "tests/test_step.py::test_step", "steps": [0],
     "sites": [{"file": "tests/test_step.py", "line": 12, "function": "test_step",
                "code": "y = x.clone()", "copies": 1, "aliases": 0, "noops": 0,
                "bytes": 64, "bytes_logical": 64, "time_ns": 2100,
                "step_time_ns": {"0": 2100}, "transfers": {}, "ops": {"clone": 1}}],
     "modules": [{"module": "", ...}], "ops": [{"op": "clone", ...}],
     "hazards": [{"code": "...", "severity": "...", "site": "file:line function",
                  "bytes": 64, "message": "..."}]}
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from copytrace.analysis.diff._profile import METRICS, KeyStats, RunProfile
from copytrace.analysis.diff._source import parse_site

__all__ = ["BASELINE_VERSION", "profile_from_json", "profile_to_json", "read_baseline",
           "write_baseline"]  # fmt: skip

BASELINE_VERSION = 1


def _rel(file: str, root: str) -> str:
    if root and file.startswith(root):
        return file[len(root) :]
    return file


def _abs(file: str, root: str) -> str:
    return file if not file or os.path.isabs(file) or not root else root + file


def _stats(s: KeyStats) -> dict[str, Any]:
    out: dict[str, Any] = {m: getattr(s, m) for m in METRICS}
    out["step_time_ns"] = {str(k): v for k, v in sorted(s.step_time_ns.items())}
    out["transfers"] = dict(sorted(s.transfers.items()))
    out["ops"] = dict(sorted(s.ops.items()))
    return out


def _unstats(d: dict[str, Any]) -> KeyStats:
    s = KeyStats(**{m: int(d.get(m, 0)) for m in METRICS})
    s.step_time_ns = {int(k): int(v) for k, v in (d.get("step_time_ns") or {}).items()}
    s.transfers = {str(k): int(v) for k, v in (d.get("transfers") or {}).items()}
    s.ops = {str(k): int(v) for k, v in (d.get("ops") or {}).items()}
    return s


def _site_text(site: str, conv: Any) -> str:
    file, line, func = parse_site(site)
    if not file:
        return site
    return f"{conv(file)}:{line}" + (f" {func}" if func else "")


def profile_to_json(prof: RunProfile, test: str, root: str) -> dict[str, Any]:
    """``prof`` as the baseline's JSON object (see the module doc).

    Args:
        prof: The profile, its sources filled.
        test: What it is the baseline of (a pytest node id).
        root: Paths starting with it are written relative to it (ends with a separator).
    """
    sites = []
    for key, s in sorted(prof.sites.items()):
        file, line, func = key
        sites.append({"file": _rel(file, root), "line": line, "function": func,
                      "code": prof.sources.get(key, ""), **_stats(s)})  # fmt: skip
    return {
        "version": BASELINE_VERSION, "test": test, "steps": list(prof.steps), "sites": sites,
        "modules": [{"module": k, **_stats(s)} for k, s in sorted(prof.modules.items())],
        "ops": [{"op": k, **_stats(s)} for k, s in sorted(prof.ops.items())],
        "hazards": [{"code": c, "severity": sev, "site": _site_text(site, lambda f: _rel(f, root)),
                     "bytes": n, "message": msg} for c, sev, site, n, msg in prof.hazards],
    }  # fmt: skip


def profile_from_json(data: dict[str, Any], label: str, root: str) -> RunProfile:
    """The :class:`RunProfile` of a baseline object (relative paths joined to ``root``).

    Raises:
        ValueError: If ``data`` is not a baseline object of this version.
    """
    if not isinstance(data, dict) or data.get("version") != BASELINE_VERSION:
        raise ValueError(f"not a copytrace baseline (version {BASELINE_VERSION})")
    prof = RunProfile(label, steps=[int(s) for s in data.get("steps") or []])
    for d in data.get("sites") or []:
        key = (_abs(str(d.get("file") or ""), root), int(d.get("line") or 0),
               str(d.get("function") or ""))  # fmt: skip
        prof.sites[key] = _unstats(d)
        if d.get("code"):
            prof.sources[key] = str(d["code"])
    prof.modules = {str(d.get("module") or ""): _unstats(d) for d in data.get("modules") or []}
    prof.ops = {str(d.get("op") or ""): _unstats(d) for d in data.get("ops") or []}
    prof.hazards = [(str(h["code"]), str(h.get("severity", "")),
                     _site_text(str(h.get("site") or ""), lambda f: _abs(f, root)),
                     int(h.get("bytes") or 0), str(h.get("message", "")))
                    for h in data.get("hazards") or []]  # fmt: skip
    return prof


def write_baseline(path: Path, prof: RunProfile, test: str, root: str) -> None:
    """Write ``prof`` to ``path`` (atomically; parent folders made).

    Raises:
        OSError: If it cannot be written.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(profile_to_json(prof, test, root), indent=1) + "\n", "utf-8")
    os.replace(tmp, path)


def read_baseline(path: Path, root: str) -> RunProfile | None:
    """The baseline at ``path``, or None when there is none.

    Raises:
        ValueError: If the file is there but is not a baseline (corrupt, other version).
    """
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    try:
        data = json.loads(text)
    except ValueError as err:
        raise ValueError(f"{path}: not JSON ({err})") from None
    try:
        return profile_from_json(data, f"baseline {path.name}", root)
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{path}: {err}") from None
