"""A :class:`~._compare.Diff` as JSON, as a terminal table and as Markdown.

The JSON form is documented field by field in ``docs/diff.md``.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any

from copytrace._units import format_bytes, format_ns
from copytrace.analysis.diff._compare import Diff, Item, number, triple
from copytrace.analysis.diff._source import parse_site

__all__ = ["FORMAT_VERSION", "format_markdown", "format_terminal", "item_json", "short_paths",
           "site_counts", "to_json"]  # fmt: skip

#: ``version`` of the JSON form.
FORMAT_VERSION = 1


def _site_fields(key: Any) -> dict[str, Any]:
    file, line, function = key
    return {"file": file, "line": line, "function": function}


def item_json(i: Item) -> dict[str, Any]:
    """One call-site item as the JSON form's ``ITEM`` (see ``docs/diff.md``)."""
    out: dict[str, Any] = _site_fields(i.key)
    if i.status in ("changed", "time", "same") and i.base_key[1] != i.new_key[1]:
        out["base_line"] = i.base_key[1]
    out["code"] = i.code
    for name in ("copies_per_step", "bytes_per_step", "time_per_step_ns", "aliases_per_step",
                 "noops_per_step", "bytes_logical_per_step"):  # fmt: skip
        out[name] = triple(*i.per_step[name])
    out["transfers_per_step"] = {k.split(".", 1)[1]: triple(*v) for k, v in i.per_step.items()
                                 if k.startswith("transfers.")}  # fmt: skip
    out["totals"] = {"copies": triple(i.base.copies, i.new.copies),
                     "bytes": triple(i.base.bytes, i.new.bytes)}  # fmt: skip
    out["ops"] = sorted(set(i.base.ops) | set(i.new.ops))
    out["time_test"] = i.time.as_dict() if i.time is not None else None
    return out


def _keyed_json(items: list[Item], name: str) -> list[dict[str, Any]]:
    return [{name: i.key, "status": i.status,
             **{f: triple(*i.per_step[f]) for f in ("copies_per_step", "bytes_per_step",
                                                    "time_per_step_ns")}}
            for i in items if i.status != "same"]  # fmt: skip


def _hazard_json(h: tuple[str, str, str, int, str]) -> dict[str, Any]:
    file, line, function = parse_site(h[2])
    return {"code": h[0], "severity": h[1], "file": file, "line": line, "function": function,
            "bytes": h[3], "message": h[4]}  # fmt: skip


def to_json(d: Diff) -> dict[str, Any]:
    """The diff as one JSON-ready object (see ``docs/diff.md``)."""
    totals = d.totals()
    return {
        "version": FORMAT_VERSION,
        "base": {"label": d.base.label, "steps": d.base.n_steps},
        "new": {"label": d.new.label, "steps": d.new.n_steps},
        "totals": {f: triple(*v) for f, v in totals.items()},
        "added": [item_json(i) for i in d.of("added")],
        "removed": [item_json(i) for i in d.of("removed")],
        "changed": [item_json(i) for i in d.of("changed")],
        "time_changed": [item_json(i) for i in d.of("time")],
        "unchanged": len(d.of("same")),
        "modules": _keyed_json(d.modules, "module"),
        "ops": _keyed_json(d.ops, "op"),
        "hazards": {"added": [_hazard_json(h) for h in d.hazards_added],
                    "removed": [_hazard_json(h) for h in d.hazards_removed]},
    }  # fmt: skip


def short_paths(files: list[str]) -> dict[str, str]:
    """Each path shortened to its shortest path suffix that no other of ``files`` shares."""
    parts = {f: f.replace("\\", "/").split("/") for f in set(files)}
    out = {}
    for f, p in parts.items():
        depth = 1
        while depth < len(p) and any(q[-depth:] == p[-depth:] for g, q in parts.items() if g != f):
            depth += 1
        out[f] = "/".join(p[-depth:])
    return out


def _signed(x: Fraction, fmt: Any) -> str:
    if x == 0:
        return "0"
    return ("+" if x > 0 else "-") + fmt(abs(x))


def _count(x: Fraction) -> str:
    return str(number(x))


def _bytes(x: Fraction) -> str:
    return f"{number(x)} B" if abs(x) < 1024 else format_bytes(float(x))


def _ns(x: Fraction) -> str:
    return format_ns(float(x))


def _time_cell(i: Item) -> str:
    t = i.time
    if t is None or t.p_value is None:
        return "n/a" if i.status == "same" else f"{_signed(i.delta('time_per_step_ns'), _ns)} ?"
    shift = Fraction(t.shift_ns).limit_denominator(1000)
    if not t.significant:
        return f"{_signed(shift, _ns)}~"
    if t.low_ns is None or t.high_ns is None:
        return f"{_signed(shift, _ns)}*"
    lo, hi = (Fraction(v).limit_denominator(1000) for v in (t.low_ns, t.high_ns))
    return f"{_signed(shift, _ns)}* [{_signed(lo, _ns)}, {_signed(hi, _ns)}]"


def _site_label(key: Any, names: dict[str, str]) -> str:
    file, line, func = key
    if not file:
        return "(unknown call site)"
    return f"{names.get(file, file)}:{line}" + (f" {func}" if func else "")


#: each listed status as its rows and the counts name it (``time``: only the copy time changed)
_LABELS = {"added": "added", "removed": "removed", "changed": "changed", "time": "time only"}


def site_counts(d: Diff) -> str:
    """How many call sites each row label lists: ``"3 added, 1 removed, 1 changed, 2 time
    only"``, every label, zeros too (the headline of the Markdown form and of ``-o``)."""
    return ", ".join(f"{len(d.of(status))} {label}" for status, label in _LABELS.items())


def _rows(d: Diff, names: dict[str, str]) -> list[list[str]]:
    """One row per listed call site (every status but ``same``), in :attr:`Diff.sites`'
    order, its first cell the label of :data:`_LABELS`."""
    rows = []
    for i in d.sites:
        if i.status == "same":
            continue
        c, b = i.per_step["copies_per_step"], i.per_step["bytes_per_step"]
        where = _site_label(i.key, names)
        if i.status in ("changed", "time") and i.base_key[1] != i.new_key[1]:
            where += f" (was :{i.base_key[1]})"
        rows.append([_LABELS[i.status], where, f"{_signed(c[1] - c[0], _count)} ({_count(c[0])} -> "
                     f"{_count(c[1])})", f"{_signed(b[1] - b[0], _bytes)} ({_bytes(b[0])} -> "
                     f"{_bytes(b[1])})", _time_cell(i), i.code[:60]])  # fmt: skip
    return rows


def _totals_line(d: Diff) -> str:
    t = d.totals()
    c, b, tm = t["copies_per_step"], t["bytes_per_step"], t["time_per_step_ns"]
    return (f"per step: copies {_count(c[0])} -> {_count(c[1])} ({_signed(c[1] - c[0], _count)}), "
            f"bytes {_bytes(b[0])} -> {_bytes(b[1])} ({_signed(b[1] - b[0], _bytes)}), "
            f"copy time {_ns(tm[0])} -> {_ns(tm[1])}")  # fmt: skip


def _hazard_lines(d: Diff, names: dict[str, str]) -> list[str]:
    out = []
    for sign, hs in (("+", d.hazards_added), ("-", d.hazards_removed)):
        for code, sev, site, _n, msg in hs:
            where = _site_label(parse_site(site), names) if site else "(no call site)"
            out.append(f"  {sign} {code} ({sev}) at {where}: {msg}")
    return out


def _names(d: Diff) -> dict[str, str]:
    files = [k[0] for k in d.base.sites] + [k[0] for k in d.new.sites]
    return short_paths([f for f in files if f])


def format_terminal(d: Diff) -> str:
    """The diff as a plain-text table (added, removed and changed call sites, largest byte
    change first), the run totals and the hazards; ends with a newline."""
    names = _names(d)
    lines = [f"copytrace diff: {d.base.label} ({d.base.n_steps} steps) -> {d.new.label} "
             f"({d.new.n_steps} steps)", _totals_line(d)]  # fmt: skip
    rows = _rows(d, names)
    if rows:
        head = ["", "call site", "copies/step", "bytes/step", "time/step", "code"]
        widths = [max(len(r[k]) for r in [head, *rows]) for k in range(len(head))]
        for r in [head, *rows]:
            lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
        lines.append(f"(call sites: {site_counts(d)}, {len(d.of('same'))} unchanged; "
                     f"time: * changed, ~ within noise (Mann-Whitney U over steps after the first {d.warmup}; [95% interval]), ? "
                     "too few steps to tell)")  # fmt: skip
    else:
        lines.append(f"no call site changed ({len(d.of('same'))} unchanged)")
    hz = _hazard_lines(d, names)
    lines.append("hazards:" if hz else "hazards: no change")
    lines.extend(hz)
    return "\n".join(lines) + "\n"


def format_markdown(d: Diff) -> str:
    """The diff as GitHub-flavoured Markdown, for a pull-request comment."""
    names = _names(d)
    out = [f"### copytrace diff: call sites {site_counts(d)}", "", _totals_line(d).replace(
               "per step:", "**Per step:**"), ""]  # fmt: skip
    rows = _rows(d, names)
    if rows:
        out += ["| | call site | copies/step | bytes/step | time/step | code |",
                "|---|---|---|---|---|---|"]  # fmt: skip
        for r in rows:
            code = f"`{r[5]}`" if r[5] else ""
            cells = [r[0], f"`{r[1]}`", r[2], r[3], r[4], code]
            out.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
        out += ["", "_time: \\* changed, ~ within noise (Mann-Whitney U), ? too few steps_"]
    hz = _hazard_lines(d, names)
    if hz:
        out += ["", "**Hazards:**", ""] + [f"- {h.strip()}" for h in hz]
    return "\n".join(out) + "\n"
