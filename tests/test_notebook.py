"""copytrace in Jupyter: a real notebook executed by a real kernel (nbclient + ipykernel).

A ``Trace`` (live, then written) and a loaded trace show their summary as rich output;
``t.report()`` shows the interactive report in the cell's output; the report's progress bars
take the notebook's form (a tqdm widget).
"""

from __future__ import annotations

import html
import re
from pathlib import Path

import pytest

from copytrace.dashboards import build_model, load_trace
from copytrace.dashboards._model import format_bytes

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

CELLS = [
    # 0: every progress stage shows at once (its default waits half a second)
    "import copytrace, torch\n"
    "from copytrace.dashboards import _progress\n"
    "_progress._TTY_DELAY_S = 0",
    # 1: start tracing; the cells below run traced until t.stop()
    "t = copytrace.trace('out')\n"
    "t.start()\n"
    "w = torch.nn.Linear(8, 8)\n"
    "for _ in range(3):\n"
    "    x = torch.ones(16, 8).clone()\n"
    "    y = torch.tensor(w(x).sum())\n"
    "    t.step()",
    # 2: a live trace
    "t",
    # 3: stopped and written: its summary
    "t.stop()\nt",
    # 4: the same trace loaded from its file
    "copytrace.load_trace('out')",
    # 5: the report, inline
    "path = t.report('out/report.html')",
]


@pytest.fixture(scope="module")
def executed(tmp_path_factory: pytest.TempPathFactory) -> tuple[list, Path]:
    root = tmp_path_factory.mktemp("nb")
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(src) for src in CELLS]
    client = nbclient.NotebookClient(
        nb, timeout=240, kernel_name="python3", resources={"metadata": {"path": str(root)}}
    )
    client.execute()
    for cell in nb.cells:
        errors = [o for o in cell.outputs if o.output_type == "error"]
        assert errors == [], errors
    return nb.cells, root / "out"


def _rich(cell, kind: str = "execute_result") -> dict:
    (out,) = [o for o in cell.outputs if o.output_type == kind]
    return out["data"]


def test_a_live_trace_shows_its_progress(executed):
    cells, _ = executed
    data = _rich(cells[2])
    # 3 clones and 3 torch.tensor copies (the Linear copies nothing); steps 0-2 ended and
    # step 3 is under way: 4 steps, as a run's step count includes its last step.
    assert "tracing: 6 events in 4 steps so far" in data["text/html"]
    assert data["text/markdown"].startswith("**copytrace**: tracing: ")


def test_a_written_and_a_loaded_trace_show_their_summary(executed):
    cells, out = executed
    (trace_file,) = out.glob("copytrace-*.otlp.jsonl.gz")
    model = build_model(load_trace(trace_file), analyze=True)
    t = model.totals
    for cell in (cells[3], cells[4]):
        data = _rich(cell)
        page = data["text/html"]
        assert f"{t.events:,} in 4 steps: {t.copy_count:,} copies" in page
        assert format_bytes(t.bytes_copied) in page
        assert "Top call sites by bytes copied" in page
        # the hazard of torch.tensor(t), with its fix
        assert "tensor-ctor-copy" in page and [h.code for h in model.hazards] == [
            "tensor-ctor-copy"
        ]
        md = data["text/markdown"]
        assert "| call site | bytes copied |" in md and "`tensor-ctor-copy`" in md
    assert str(trace_file.name) in _rich(cells[3])["text/html"]


def test_report_is_displayed_inline_with_notebook_progress_bars(executed):
    cells, out = executed
    shown = [o["data"] for o in cells[5].outputs if o.output_type == "display_data"]
    frames = [d["text/html"] for d in shown if "text/html" in d and "<iframe" in d["text/html"]]
    assert len(frames) == 1
    srcdoc = html.unescape(re.search(r'srcdoc="([^"]*)"', frames[0]).group(1))
    assert srcdoc == (out / "report.html").read_text(encoding="utf-8")
    # each report stage's bar in the notebook's form: a widget, not text on stderr
    widgets = [d for d in shown if "application/vnd.jupyter.widget-view+json" in d]
    assert len(widgets) == 3  # reading trace, aggregating, writing report
    assert not [o for o in cells[5].outputs if o.output_type == "stream" and "copytrace:" in o.text]
