"""The diff page: two runs side by side (``copytrace diff BASE NEW -o diff.html``).

One self-contained HTML page made as the report is (:mod:`._html`): a jinja2 template
(``diff.html.j2``, autoescaped) around ``report.css`` plus ``diff.css``, plotly.js inlined
(or from the CDN), the data as JSON in a ``<script type="application/json">`` element
(:func:`~._payload.dump_payload` escaping) and ``diff.js``, which draws it in the browser:
the per-step totals, the hazards added and removed, the bytes per step of each run side by
side, each call site's change (bars coloured by the sign of the delta, added sites
highlighted), the modules and the ops. Strings from the traces reach the page only as JSON
data, written with ``textContent``.

The data is the diff's JSON form (:func:`copytrace.analysis.diff.to_json`, ``docs/diff.md``)
with the unchanged sites (``same``), the short path of each file (``names``) and each run's
totals per step (``steps``: ``{"base": [{"step", "copies", "bytes", "time_ns"}], ...}``,
bytes in bytes, times in ns).
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any

import jinja2
from markupsafe import Markup

from copytrace.analysis.diff import Diff, RunProfile, item_json, short_paths, to_json
from copytrace.dashboards._html import plotly_js
from copytrace.dashboards._payload import dump_payload

__all__ = ["diff_payload", "render_diff_page", "write_diff_page"]


def _asset(name: str) -> str:
    return resources.files("copytrace.dashboards").joinpath(name).read_text(encoding="utf-8")


def _steps(prof: RunProfile) -> list[dict[str, int]]:
    out = []
    for s in prof.steps:
        k = prof.per_step.get(s)
        out.append({"step": s, "copies": k.copies if k else 0, "bytes": k.bytes if k else 0,
                    "time_ns": k.time_ns if k else 0})  # fmt: skip
    return out


def diff_payload(d: Diff, title: str) -> dict[str, Any]:
    """The page's data (see the module doc)."""
    data = to_json(d)
    data["same"] = [item_json(i) for i in d.of("same")]
    files = [i.key[0] for i in d.sites if i.key[0]]
    for side in ("added", "removed"):
        files += [h["file"] for h in data["hazards"][side] if h["file"]]
    data["names"] = short_paths(files)
    data["steps"] = {"base": _steps(d.base), "new": _steps(d.new)}
    data["title"] = title
    return data


def render_diff_page(d: Diff, *, title: str | None = None, offline: bool = True) -> str:
    """The diff page as a string (about 1.9 MB of inlined plotly.js when ``offline``)."""
    try:
        from copytrace._version import __version__ as version
    except ImportError:  # pragma: no cover - the package always defines it
        version = ""
    title = title or f"copytrace diff: {d.base.label} \u2192 {d.new.label}"
    env = jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined)
    js = _asset("diff.js").replace("</script", "<\\/script")
    return env.from_string(_asset("diff.html.j2")).render(
        title=title,
        version=version,
        base=d.base.label,
        new=d.new.label,
        css=Markup(_asset("report.css") + _asset("diff.css")),
        plotly_tag=Markup(plotly_js(offline)),
        data=Markup(dump_payload(diff_payload(d, title))),
        js=Markup(js),
    )


def write_diff_page(
    d: Diff, out_path: str | Path, *, title: str | None = None, offline: bool = True
) -> Path:
    """Write the diff page (parent folders made).

    Returns:
        ``out_path`` as a :class:`~pathlib.Path`.

    Raises:
        OSError: If it cannot be written.
    """
    out = Path(out_path)
    page = render_diff_page(d, title=title, offline=offline)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(page, encoding="utf-8")
    return out
