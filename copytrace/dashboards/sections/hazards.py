"""Hazards: the analyser's findings (``copytrace.analysis`` over the event table), or, when
the analysis is not run, the ``copytrace.hazard`` span events the tracer wrote at stop."""

from __future__ import annotations

import gc
import hashlib
import os
from pathlib import Path
from typing import Any

import numpy as np

from copytrace.dashboards._format import as_str, opt_int
from copytrace.dashboards._pack import Strings
from copytrace.dashboards._query import Query, hex_id_sql, id_value_sql
from copytrace.dashboards._rows import HazardRow
from copytrace.schema import HAZARD_ATTRS

__all__ = ["payload_hazards",
    "analysis_findings", "attach_events", "finding_patches", "from_finding", "from_trace",
    "hazard_rows",
    "run_analysis", "sort_hazards",
]  # fmt: skip

_SEVERITY_RANK = {"critical": 0, "error": 1, "high": 1, "warning": 2, "medium": 2, "info": 3,
                  "low": 3}  # fmt: skip


def _get(obj: Any, *names: str) -> Any:
    for name in names:
        value = obj.get(name) if isinstance(obj, dict) else getattr(obj, name, None)
        if value is not None:
            return value
    return None


def _text(value: Any) -> str:
    if value is None:
        return ""
    for attr in ("value", "name"):  # enums
        inner = getattr(value, attr, None)
        if isinstance(inner, str):
            return inner
    return str(value)


def _listify(value: Any) -> list[Any]:
    if value is None:
        return []
    if isinstance(value, (list, tuple, set, frozenset)):
        return list(value)
    return [value]


def _site_text(value: Any) -> str:
    """A call site as the analyser may give it: a string, or an object/dict with file/line."""
    if isinstance(value, str):
        return value
    path = _get(value, "file", "path", "filename", "code.file.path")
    if path is None:
        return _text(value)
    line = _get(value, "line", "lineno", "code.line.number")
    func = _get(value, "function", "func", "code.function.name")
    site = f"{path}:{line}" if line is not None else str(path)
    return f"{site} {func}" if func else site


def from_finding(finding: Any) -> HazardRow:
    """Normalise one analyser finding (object or dict) into a :class:`HazardRow`.

    Args:
        finding: An object or dict with ``code``, ``severity``, ``message``, ``fix``,
            ``call_sites`` (or ``call_site``), ``bytes``, ``steps`` (or ``step``) and
            ``event_ids`` (or ``span_ids``); missing fields are left empty.
    """
    sites = _listify(_get(finding, "call_sites", "call_site", "sites", "site"))
    steps = [s for s in (opt_int(x) for x in _listify(_get(finding, "steps", "step"))) if
             s is not None]  # fmt: skip
    ids = _get(finding, "event_ids", "span_ids", "events")
    nbytes = opt_int(_get(finding, "bytes", "nbytes", "bytes_copied", "bytes_allocated"))
    return HazardRow(
        code=_text(_get(finding, "code", "id", "rule")),
        severity=_text(_get(finding, "severity", "level")).lower(),
        message=_text(_get(finding, "message", "title", "description")),
        fix=_text(_get(finding, "fix", "suggestion", "remedy")),
        call_sites=[_site_text(s) for s in sites],
        bytes=nbytes,
        steps=sorted(set(steps)),
        event_ids=_lower_ids(ids),
        source="analysis",
    )


def _lower_ids(ids: Any) -> Any:
    """Span ids as lower-case text: an :class:`~copytrace.analysis._findings.Ids` over one
    pyarrow string array (a finding can name every event of a 1M-event trace: no Python
    object per event), or a list for a list."""
    arrow = getattr(ids, "arrow", None)
    if arrow is not None:
        import pyarrow as pa
        import pyarrow.compute as pc

        values = arrow()
        if not pa.types.is_string(values.type) and not pa.types.is_large_string(values.type):
            values = pc.cast(values, pa.string())
        if not pc.any(pc.match_substring_regex(values, "[A-Z]")).as_py():
            return type(ids)(values)  # lower-case already (as the tracer writes them): no copy
        return type(ids)(pc.utf8_lower(values))
    ids = _listify(ids)
    if not ids:
        return []
    text = [i if isinstance(i, str) else str(i) for i in ids]
    return "\0".join(text).lower().split("\0")


def from_trace(q: Query, labels: list[str]) -> list[HazardRow]:
    """The hazards the tracer wrote into the trace (``copytrace.hazards`` spans)."""
    rows = []
    for meta, label in zip(q.runs, labels, strict=True):
        for a in meta.hazards:
            get = {f: a.get(k) for f, k in HAZARD_ATTRS.items()}
            rows.append(HazardRow(
                code=as_str(get["code"]), severity=as_str(get["severity"]).lower(),
                message=as_str(get["message"]), fix=as_str(get["fix"]),
                call_sites=[str(s) for s in _listify(get["call_sites"])],
                bytes=opt_int(get["bytes"]),
                event_ids=[str(s).lower() for s in _listify(get["span_ids"])],
                source="trace", runs=[label],
            ))  # fmt: skip
    return rows


def run_analysis(source: Any) -> tuple[list[Any] | None, str]:
    """Run ``copytrace.analysis.analyze`` on ``source`` (a table or loaded trace).

    Returns:
        ``(findings, "ran")``, or None and ``not installed`` / ``failed: <Type>: <message>``.
    """
    try:
        from copytrace.analysis import analyze
    except ImportError:
        return None, "not installed"
    was_enabled = gc.isenabled()
    gc.disable()  # the rules make many small acyclic objects: the cyclic GC only slows them
    try:
        return list(analyze(source) or []), "ran"
    except Exception as err:  # the report must not die with the analyser
        return None, f"failed: {type(err).__name__}: {err}"
    finally:
        if was_enabled:
            gc.enable()


def sort_hazards(hazards: list[HazardRow]) -> tuple[list[HazardRow], list[int]]:
    """Most severe first, then by bytes (desc) and code. Returns the rows and, for each
    original index, its new position."""
    order = sorted(range(len(hazards)), key=lambda i: (
        _SEVERITY_RANK.get(hazards[i].severity, 4), -(hazards[i].bytes or 0), hazards[i].code, i))
    new_pos = [0] * len(hazards)
    for new, old in enumerate(order):
        new_pos[old] = new
    return [hazards[i] for i in order], new_pos


def attach_events(
    q: Query,
    hazards: list[HazardRow],
    first_of: dict[str, int] | None,
    labels: list[str],
    by_value: bool = False,
) -> None:
    """Register ``span id -> hazard index`` as table ``hz`` (None: ``hz`` is registered
    already) and fill in each hazard's call sites, steps and runs from its events (what the
    finding left out), in event order. Leaves table ``hzev``: each event a hazard names,
    ``r`` its row in ``ev`` and ``hz`` the hazard (the timeline joins it by row).
    ``by_value``: ``hz`` keys the ids by their value (see :func:`_register_events`); an event
    whose id is not 16 hex digits is then named by none."""
    import pyarrow as pa

    if first_of is not None:
        q.put("hz", {"span_id": (pa.string(), list(first_of)),
                     "hz": (pa.int32(), list(first_of.values()))})  # fmt: skip
    # the events joined once (three joins of 10M events with the span ids hazards name took
    # 3x as long), then grouped three ways
    none = first_of == {} or (first_of is None and not q.sql("SELECT count(*) FROM hz")[0][0])
    if first_of is None and q.numeric_ids:  # ``ev`` holds the ids' values too
        on = "h.sid = e.span_id"
    elif by_value:
        on = f"h.sid = {id_value_sql('e.span_id')} AND {hex_id_sql('e.span_id')}"
    else:
        on = f"h.span_id = {q.span_text('e.span_id')}"
    q.con.execute(
        "CREATE OR REPLACE TABLE hzev AS SELECT h.hz, e.rowid AS r, e.site, e.step, e.run_idx, "
        f"e.start_ns, e.end_ns, e.span_id FROM ev e JOIN hz h ON {on}"
        + (" WHERE false" if none else "")
    )
    if none:
        return
    rows = q.sql(
        "SELECT hz, site, min((run_idx, start_ns, end_ns, span_id)) AS o "
        "FROM hzev GROUP BY ALL ORDER BY hz, o"
    )
    for hz, site, _o in rows:
        if site not in hazards[hz].call_sites:
            hazards[hz].call_sites.append(site)
    seen = [set(h.steps) for h in hazards]
    for hz, step in q.sql("SELECT DISTINCT hz, step FROM hzev WHERE step >= 0"):
        if step not in seen[hz]:
            seen[hz].add(step)
            hazards[hz].steps.append(step)
    for hz, run_idx in q.sql("SELECT DISTINCT hz, run_idx FROM hzev ORDER BY ALL"):
        if labels[run_idx] not in hazards[hz].runs:
            hazards[hz].runs.append(labels[run_idx])
    for h in hazards:
        h.steps.sort()


def analysis_findings(
    source: Any, findings: Any, analyze: bool
) -> tuple[list[Any] | None, str]:
    """The findings to show and the analysis status (``ran``, ``skipped``, ``not installed``
    or ``failed: ...``): ``findings`` when given, else the analyser's on ``source`` (run
    before the report's own tables exist, and its per-event views dropped after, so that
    the two never share memory)."""
    if findings is not None:
        return list(findings), "ran"
    if not analyze:
        return None, "skipped"
    cache = _findings_cache(source)
    if cache is not None and cache.exists():
        try:
            return _read_findings(cache), "ran"
        except (OSError, ValueError, KeyError):
            pass
    found, status = run_analysis(source)  # (build_model drops the views it left on source)
    if cache is not None and found is not None:
        try:
            _write_findings(cache, found)
        except (OSError, TypeError, ValueError):
            pass
    return found, status


#: The findings cache's columns: a finding's fields, its events as lists (one row a finding).
_LISTS = {"call_sites": "string", "steps": "int64", "event_seqs": "int64", "span_ids": "string"}


def _write_findings(cache: Path, found: list[Any]) -> None:
    """The findings as one Arrow IPC file: a finding's events go as arrays, never as one
    Python object each (a finding can name every event of a 1M-event trace)."""
    import pyarrow as pa

    cols: dict[str, list[Any]] = {k: [] for k in ("code", "severity", "message", "fix",
                                                  "bytes", "run", *_LISTS)}  # fmt: skip
    for f in found:
        for name in cols:
            value = f.get(name) if isinstance(f, dict) else getattr(f, name, None)
            if name in _LISTS:
                arrow = getattr(value, "arrow", None)
                value = arrow() if arrow is not None else pa.array(list(value or ()),
                                                                    getattr(pa, _LISTS[name])())
            cols[name].append(value)
    arrays = {}
    for name, values in cols.items():
        if name in _LISTS:
            typ = getattr(pa, _LISTS[name])()
            flat = [v.cast(typ) for v in values]
            offsets = np.concatenate([[0], np.cumsum([len(v) for v in flat])]).astype(np.int64)
            data = pa.concat_arrays(flat) if flat else pa.array([], typ)
            arrays[name] = pa.LargeListArray.from_arrays(pa.array(offsets), data)
        else:
            arrays[name] = pa.array(values)
    tmp = cache.with_name(cache.name + f".{os.getpid()}.tmp")
    cache.parent.mkdir(parents=True, exist_ok=True)
    with pa.OSFile(str(tmp), "wb") as sink:
        table = pa.table(arrays)
        with pa.ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table)
    os.replace(tmp, cache)


def _read_findings(cache: Path) -> list[dict[str, Any]]:
    """The findings :func:`_write_findings` wrote, as dicts (events as :class:`Ids`)."""
    import pyarrow as pa

    from copytrace.analysis._findings import Ids

    with pa.memory_map(str(cache)) as source:
        table = pa.ipc.open_file(source).read_all()
    out = []
    for i in range(table.num_rows):
        row: dict[str, Any] = {}
        for name in table.column_names:
            value = table.column(name)[i]
            if name in ("event_seqs", "span_ids"):
                row[name] = Ids(value.values)
            else:
                row[name] = value.as_py()
        out.append(row)
    return out


def _findings_cache(source: Any) -> Path | None:
    """Where the findings of ``source`` are cached: a file named by the trace files' size
    and mtime (through their Parquet caches), the processes read and the analyser's own
    source files, in the user's cache folder; None when ``source`` is not read from files
    (or the analyser is not a package on disk)."""
    parts = getattr(source, "parts", None)
    stamps = [p.stamp_files() for p in parts or ()]
    if not parts or any(files is None for files in stamps):
        return None
    try:
        import copytrace.analysis as analysis
    except ImportError:
        return None
    where = getattr(analysis, "__file__", None)
    if not where:
        return None
    key = hashlib.sha1()
    try:
        for f in sorted(Path(where).parent.glob("*.py")):
            st = f.stat()
            key.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns};".encode())
        for p, files in zip(parts, stamps, strict=True):
            for f in files or ():
                st = f.stat()
                key.update(f"{f.resolve()}:{st.st_size}:{st.st_mtime_ns}:{p.runs};".encode())
    except OSError:
        return None
    home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "copytrace"
    return home / f"findings-{key.hexdigest()[:24]}.arrow"


def finding_patches(source: Any, findings: list[Any] | None) -> list[dict[str, Any]]:
    """Each finding's patch (``copytrace fix``), in the findings' order: ``{"patch": diff,
    "reason": line, "exact": bool}``, ``{"no_patch": why}`` for a finding whose code has a
    fix that does not apply here, or ``{}``.

    Planned once for all findings (:func:`copytrace.fixes.plan_findings`: each line is
    rewritten once however many findings share it, and the events are read only when some
    code has a fix), against the files under the current directory. The report must not die
    with the fixer: an error leaves every finding without a patch.
    """
    if not findings:
        return []
    try:
        from copytrace.analysis import Finding
        from copytrace.fixes import FIXES, plan_findings

        found = [Finding(**f) if isinstance(f, dict) else f for f in findings]
        if not any(f.code in FIXES for f in found):
            return [{} for _ in found]
        plan = plan_findings(found, source)
    except Exception:  # a stale findings cache, an unreadable file...
        return [{} for _ in findings]
    by_id: dict[int, dict[str, Any]] = {}
    for fx in plan.fixes:
        by_id[id(fx.finding)] = {"patch": fx.diff, "reason": fx.reason(), "exact": fx.exact}
    for u in plan.unfixed:
        if u.finding.code in FIXES:
            by_id[id(u.finding)] = {"no_patch": u.reason}
    return [by_id.get(id(f), {}) for f in found]


def hazard_rows(
    q: Query,
    findings: list[Any] | None,
    labels: list[str],
    events: bool = True,
    patches: list[dict[str, Any]] | None = None,
) -> list[HazardRow]:
    """The section's hazards, sorted, with their events registered (table ``hz``):
    the findings' when there are (the analysis ran), else those the tracer wrote.
    ``labels``: the run labels, in ``q``'s run order. ``events``: False leaves the call
    sites and steps as the findings name them and registers no events (the timeline then
    marks none), when the trace holds one run. ``patches``: :func:`finding_patches` of the
    findings."""
    rows = [from_finding(f) for f in findings] if findings is not None else from_trace(q, labels)
    for row, p in zip(rows, patches or (), strict=False):
        row.patch, row.patch_reason = p.get("patch", ""), p.get("reason", "")
        row.patch_exact, row.no_patch = p.get("exact"), p.get("no_patch", "")
    rows, new_pos = sort_hazards(rows)
    runs_of = _finding_runs(q, findings, labels, len(rows)) if not events else None
    if runs_of is not None:
        for i, new in enumerate(new_pos):
            rows[new].runs = runs_of[i]
        attach_events(q, rows, {}, labels)  # an empty ``hz``
        return rows
    by_value = _register_events(q, rows, new_pos)
    attach_events(q, rows, None, labels, by_value)
    return rows


def _finding_runs(
    q: Query, findings: list[Any] | None, labels: list[str], n: int
) -> list[list[str]] | None:
    """Each finding's run label, without reading its events: every run of a one-run
    trace, else the run its ``run`` index names in the analysis' run order
    (:attr:`Query.start_order`); None when that order is not known to be the analysis'
    (a file of several processes, a process over several files) or a finding has no run.
    ``n``: the number of hazard rows.
    On 10M events over 64 ranks this saves registering and joining the 4M events the
    findings name (``copytrace summary``)."""
    if len(labels) == 1:
        return [list(labels) for _ in range(n)]
    if findings is None or not q.start_order_known:
        return None
    label_of = {m.trace_id: label for m, label in zip(q.runs, labels, strict=True)}
    out = []
    for f in findings:
        run = opt_int(_get(f, "run"))
        if run is None or not 0 <= run < len(q.start_order):
            return None
        out.append([label_of[q.start_order[run]]])
    return out


def _register_events(q: Query, rows: list[HazardRow], new_pos: list[int]) -> bool:
    """Table ``hz``: each span id a hazard names, and the hazard's position in ``rows``; an
    event named by several hazards takes the first finding's, in the findings' own order.
    Built in Arrow and DuckDB (no Python object per event). Returns whether the ids are
    keyed by their value (column ``sid``, UBIGINT: every id is 16 lower-case hex digits),
    else by their text (``span_id``)."""
    import numpy as np
    import pyarrow as pa

    ids, pos, own = [], [], []
    for i, new in enumerate(new_pos):  # i: the finding's own position
        names = rows[new].event_ids
        if not len(names):
            continue
        arrow = getattr(names, "arrow", None)
        values = arrow() if arrow is not None else pa.array([str(s) for s in names], pa.string())
        if isinstance(values, pa.ChunkedArray):
            values = values.combine_chunks()
        ids.append(values.cast(pa.string()))
        pos.append(np.full(len(values), new, dtype=np.int32))
        own.append(np.full(len(values), i, dtype=np.int32))
    data = pa.table({
        "span_id": pa.chunked_array(ids, pa.string()),
        "hz": np.concatenate(pos) if pos else np.zeros(0, np.int32),
        "own": np.concatenate(own) if own else np.zeros(0, np.int32),
    })  # fmt: skip
    q.con.register("_hz", data)
    # span ids as OTLP writes them (16 lower-case hex digits) are keyed by their value: a
    # join of 10M events with the 4M ids hazards name then fits DuckDB's memory cap (as text
    # it spilled, 12 s of CPU)
    if q.numeric_ids:  # every event's id is hex: an id of another form names none of them
        # (the ids are lower-case here: ``from_finding``, ``from_trace``); NULL joins none
        by_value = True
        key = (f"CASE WHEN length(span_id) = 16 AND NOT contains(span_id, '_') THEN "
               f"{id_value_sql('span_id')} END AS sid")  # fmt: skip
    else:
        by_value = not q.sql(
            f"SELECT count(*) FILTER (WHERE NOT ({hex_id_sql('span_id')})) FROM _hz")[0][0]
        key = f"{id_value_sql('span_id')} AS sid" if by_value else "span_id"
    q.con.execute(f"CREATE OR REPLACE TABLE hz AS SELECT {key}, arg_min(hz, own) AS hz "
                  "FROM _hz GROUP BY ALL")  # fmt: skip
    q.con.unregister("_hz")
    return by_value


# --- the page's payload ------------------------------------------------------------------------
def payload_hazards(model: Any, S: Strings) -> list[dict[str, Any]]:
    """One dict per hazard (at most 2000 of its steps; ``events``: how many it names)."""
    return [
        {
            "code": S(h.code),
            "severity": S(h.severity),
            "message": S(h.message),
            "fix": S(h.fix),
            "sites": [S(s) for s in h.call_sites],
            "bytes": h.bytes,
            "steps": h.steps[:2000],
            "n_steps": len(h.steps),
            "events": len(h.event_ids),
            "source": S(h.source),
            "runs": [S(r) for r in h.runs],
            "patch": S(h.patch) if h.patch else None,
            "patch_reason": S(h.patch_reason) if h.patch else None,
            "patch_exact": h.patch_exact,
            "no_patch": S(h.no_patch) if h.no_patch else None,
        }
        for h in model.hazards
    ]
