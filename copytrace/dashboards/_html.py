"""Render a :class:`~copytrace.dashboards._model.ReportModel` as one self-contained HTML page.

The page is a jinja2 template (autoescaped) around three inlined parts: ``report.css``,
the report data as JSON (see :mod:`copytrace.dashboards._payload`, in a
``<script type="application/json">`` element with ``<``, ``>`` and ``&`` escaped) and
``report.js``, which builds every Plotly figure and table in the browser. plotly.js is
inlined from the installed plotly package (offline, the default), gzip-compressed and
base64-encoded (1.9 MB instead of 4.8 MB), or loaded from the plotly CDN; without it the
page still shows every table and text. plotly.js's partial bundles were measured and are
not used: ``basic`` (1.2 MB) and ``cartesian`` (1.5 MB) lack the treemap, icicle and
scattergl traces the report draws, and ``strict`` (5.2 MB) is larger than the full bundle. Strings from the trace reach the page only as JSON data; the script writes them with
``textContent`` or, for Plotly's text (which understands a little HTML), escaped.
"""

from __future__ import annotations

import base64
import functools
import gzip
import os
import re
import shlex
from importlib import resources
from pathlib import Path

import jinja2
from markupsafe import Markup

from copytrace.dashboards._model import ReportModel
from copytrace.dashboards._payload import MAX_TIMELINE_POINTS, build_payload, dump_payload

__all__ = [
    "render_html",
    "render_page",
    "MAX_TIMELINE_POINTS",
    "plotly_js",
    "short_command",
    "self_contained_command",
]

_TEMPLATE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta name="generator" content="copytrace {{ version }}">
<title>{{ title }}</title>
<style>{{ css }}</style>
{{ plotly_tag }}
</head>
<body data-ct-self-contained="{{ self_contained }}">
<header>
  <div class="bar">
    <div>
      <h1>{{ title }}</h1>
      <div class="cmd mono" id="ct-cmd"></div>
      <div class="meta" id="ct-meta"></div>
    </div>
    <select id="ct-rank" aria-label="run / rank" hidden></select>
  </div>
</header>
<nav>
  <a href="#glance">At a glance</a><a href="#hazards">Hazards</a><a href="#steps">Per step</a>
  <a href="#sources">Where from</a><a href="#timeline">Timeline</a><a href="#kinds">Kinds</a>
  <a href="#transfers">Transfers</a><a href="#events">Events</a><a href="#run">Run details</a>
  <a href="#compiled">Compiled regions</a>
</nav>
<main>
<div id="ct-loading">Building the report&hellip;</div>
<noscript><div class="warn">This report needs JavaScript to draw its figures.</div></noscript>
<div id="ct-warnings"></div>
<section id="glance">
  <h2>At a glance</h2>
  <p class="lead">Real copies write new data; aliases (views, <code>detach</code>) and no-op
    conversions (<code>.to()</code> to the same device and dtype) copy nothing but still cost a
    call. Copy time is the host time spent in these calls.</p>
  <div class="glance">
    <div class="kpis" id="ct-kpis"></div>
    <div class="two">
      <div><h3>Top sources of copy bytes</h3><div id="ct-top-bytes"></div></div>
      <div><h3>Top sources of copy time</h3><div id="ct-top-time"></div></div>
    </div>
  </div>
</section>
<section id="hazards">
  <h2>Hazards</h2>
  <p class="lead">Copies that look like bugs or waste, with the evidence and the fix. Click a row
    to see its events.</p>
  <div id="ct-hazards-body"></div>
</section>
<section id="steps">
  <h2>Per-step overhead</h2>
  <p class="lead">Copy time as a share of each step's wall time, and bytes copied per step.
    Step 0 (tracing start to the first step boundary, plus slow leading steps) is warm-up and
    the last step ends when tracing stops: both are kept apart from the steady state.
    Click a step to see it on the timeline.</p>
  <div class="scroll" style="max-height:none"><table id="ct-stage-table"></table></div>
  <div id="fig-steps" class="fig plotly-graph-div" data-fig="steps"></div>
</section>
<section id="sources">
  <h2>Where they come from</h2>
  <p class="lead">Module &rarr; call site. Click a box or a row to list its events and
    highlight them on the timeline. <span id="ct-groupby-note"></span></p>
  <div class="ctl">
    <span class="tabs" id="ct-metric">size by
      <button data-v="bc">bytes copied</button><button data-v="ba">bytes allocated</button>
      <button data-v="t">copy time</button><button data-v="n">events</button></span>
    <span class="tabs" id="ct-groupby">table by
      <button data-v="site">call site</button><button data-v="module">module</button>
      <button data-v="op">op</button></span>
  </div>
  <div id="fig-treemap" class="fig plotly-graph-div" data-fig="treemap"></div>
  <div class="scroll"><table id="ct-sources-table"></table></div>
  <div id="ct-sources-more" class="note"></div>
</section>
<section id="timeline">
  <h2>Timeline</h2>
  <div class="focus" id="ct-focus-tl" hidden></div>
  <div class="ctl">
    <span id="ct-kinds-toggle">show
      <label><input type="checkbox" value="copy"> <span class="swatch" style="background:#d62728"></span>copies</label>
      <label><input type="checkbox" value="alias"> <span class="swatch" style="background:#6baed6"></span>aliases</label>
      <label><input type="checkbox" value="noop"> <span class="swatch" style="background:#b0b0b0"></span>no-ops</label></span>
    <span class="tabs" id="ct-lanes">lanes
      <button data-v="phase">phase</button><button data-v="thread">thread</button>
      <button data-v="op">op</button><button data-v="site">call site</button></span>
    <span>step <input type="number" id="ct-step" min="0" value="0">
      <button id="ct-step-go">zoom</button><button id="ct-step-prev" title="previous step">&#9664;</button><button id="ct-step-next" title="next step">&#9654;</button>
      <button id="ct-step-all">whole run</button></span>
  </div>
  <div id="fig-timeline" class="fig plotly-graph-div" data-fig="timeline"></div>
  <p class="note" id="ct-tl-note"></p>
  <div class="detail" id="ct-detail" hidden></div>
</section>
<section id="kinds">
  <h2>Kinds: real copies, aliases and no-op conversions</h2>
  <div id="fig-kinds" class="fig plotly-graph-div" data-fig="kinds"></div>
  <div class="scroll"><table id="ct-kinds-table"></table></div>
</section>
<section id="transfers">
  <h2>Transfers between devices</h2>
  <p class="note" id="ct-transfers-note"></p>
  <div id="fig-transfers" class="fig plotly-graph-div" data-fig="transfers"></div>
  <div class="scroll"><table id="ct-transfers-table"></table></div>
</section>
<section id="events">
  <h2>Events</h2>
  <div class="focus" id="ct-focus-ev" hidden></div>
  <div id="ct-events-body"></div>
</section>
<section id="ranks" hidden>
  <h2>Ranks side by side</h2>
  <p class="note" id="ct-ranks-note"></p>
  <div class="scroll"><table id="ct-ranks-table"></table></div>
</section>
<section id="run">
  <h2>Run details</h2>
  <div class="scroll"><table id="ct-runs-table"></table></div>
  <h3>deepcopy groups</h3>
  <div id="ct-groups-body"></div>
</section>
<div id="ct-extra"></div>
</main>
<footer>generated by copytrace {{ version }} from {{ n_files }} trace file(s)</footer>
<script type="application/json" id="ct-data">{{ data }}</script>
<script>{{ js }}</script>
</body>
</html>
"""


def _asset(name: str) -> str:
    return resources.files("copytrace.dashboards").joinpath(name).read_text(encoding="utf-8")


#: Runs before report.js: makes ``window.ctPlotly``, a promise settled once plotly.js is
#: usable (or known missing). Inline, plotly.js is stored gzip-compressed and base64-encoded
#: in ``#ct-plotly`` (about 40% of its size) and unpacked with the browser's own
#: ``DecompressionStream``.
_INLINE_LOADER = """<script>
window.ctPlotly = (async function () {
  const node = document.getElementById("ct-plotly");
  if (typeof DecompressionStream === "undefined") throw new Error("this browser cannot unpack the inlined plotly.js (no DecompressionStream)");
  const bin = Uint8Array.from(atob(node.textContent.trim()), (c) => c.charCodeAt(0));
  const stream = new Blob([bin]).stream().pipeThrough(new DecompressionStream("gzip"));
  const code = await new Response(stream).text();
  node.remove();
  (0, eval)(code);
})();
</script>"""


def plotly_js(offline: bool = True) -> str:
    """Return the HTML that provides plotly.js, for the page's ``<head>``.

    Args:
        offline: Inline the plotly.js bundled with the installed plotly package, gzip
            compressed and base64 encoded (about 1.9 MB instead of 4.8 MB; unpacked by
            the browser, which needs ``DecompressionStream``: Chromium 80, Firefox 113,
            Safari 16.4 or later); if False, a ``<script src=...>`` pointing at the plotly
            CDN (same version). Either way ``window.ctPlotly`` is a promise that report.js
            waits for; when plotly.js cannot load, the page still shows every table and text,
            and says so.

    Returns:
        HTML for the page's ``<head>``.
    """
    import plotly.offline

    if not offline:
        version = plotly.offline.get_plotlyjs_version()
        return (
            f'<script src="https://cdn.plot.ly/plotly-{version}.min.js" charset="utf-8"></script>'
        )
    return (
        f'<script type="application/gzip+base64" id="ct-plotly">{_packed_plotly_js()}</script>'
        + _INLINE_LOADER
    )


@functools.lru_cache(maxsize=1)
def _packed_plotly_js() -> str:
    """plotly.js, gzip (level 6: 0.2% larger than 9 in 70% of the time; mtime 0: the same
    bytes for the same plotly) then base64."""
    import plotly.offline

    raw = plotly.offline.get_plotlyjs().encode("utf-8")
    return base64.b64encode(gzip.compress(raw, compresslevel=6, mtime=0)).decode("ascii")


_PY = re.compile(r"python[0-9.]*(\.exe)?")


def short_command(command: str, limit: int = 80) -> str:
    """The program and its arguments, for a title: ``train.py --epochs 1``.

    Drops ``copytrace run [options]`` (traces written before ``copytrace run`` recorded the
    program's own argv: ``tracefile.program_args``) and a leading python interpreter,
    shortens the script to its file name, and cuts the text at ``limit`` characters.
    """
    from copytrace.tracefile import program_args

    try:
        args = shlex.split(command)
    except ValueError:
        args = command.split()
    args = program_args(args)
    if args and _PY.fullmatch(os.path.basename(args[0])):
        args = args[1:]
    if args and not args[0].startswith("-"):
        args[0] = os.path.basename(args[0]) or args[0]
    text = " ".join(shlex.quote(a) for a in args)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def self_contained_command(model: ReportModel) -> str:
    """The command that writes a self-contained report of the same traces."""
    dirs = {os.path.dirname(str(f)) for f in model.files}
    where = dirs.pop() if len(dirs) == 1 else "TRACE_DIR"
    return f"copytrace report {shlex.quote(where or '.')} -o report.html"


def render_page(
    model: ReportModel,
    *,
    title: str | None = None,
    offline: bool = True,
    max_points: int = MAX_TIMELINE_POINTS,
) -> str:
    """Return the report page as a string.

    Args:
        model: What :func:`~copytrace.dashboards.build_model` returned.
        title: Page title; default ``copytrace: <program and arguments>``.
        offline: Inline plotly.js (True) or load it from the plotly CDN (False).
        max_points: Most events drawn on the timeline (see :func:`render_html`).

    Returns:
        The whole HTML document (about 1.9 MB of inlined, compressed plotly.js when offline,
        plus the data: a few hundred bytes per call site and about 30 bytes per timeline event).
    """
    try:
        from copytrace._version import __version__ as version
    except ImportError:  # pragma: no cover - the package always defines it
        version = ""
    if title is None:
        command = short_command(model.runs[0].command) if model.runs else ""
        title = f"copytrace: {command}" if command else "copytrace report"
    payload = build_payload(model, title=title, max_points=max_points, version=version)
    env = jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined)
    js = _asset("report.js").replace("</script", "<\\/script")
    return env.from_string(_TEMPLATE).render(
        title=title,
        version=version,
        css=Markup(_asset("report.css")),
        plotly_tag=Markup(plotly_js(offline)),
        data=Markup(dump_payload(payload)),
        js=Markup(js),
        n_files=len(model.files),
        self_contained=self_contained_command(model),
    )


def render_html(
    model: ReportModel,
    out_path: str | Path,
    *,
    title: str | None = None,
    offline: bool = True,
    max_points: int = MAX_TIMELINE_POINTS,
) -> Path:
    """Write the report as one HTML page.

    Args:
        model: What :func:`~copytrace.dashboards.build_model` returned.
        out_path: The HTML file to write (parent directories are created).
        title: Page title; default ``copytrace: <program and arguments>``.
        offline: Inline plotly.js (a self-contained page that works offline, about 1.9 MB
            plus the data); if False, load plotly.js from the plotly CDN.
        max_points: Most events drawn on the timeline (hazard and error events are kept
            beyond it); the rest are summarised, never dropped from the totals.

    Returns:
        ``out_path`` as a :class:`~pathlib.Path`.

    Raises:
        OSError: If the file cannot be written.
    """
    out = Path(out_path)
    page = render_page(model, title=title, offline=offline, max_points=max_points)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(page, encoding="utf-8")
    return out
