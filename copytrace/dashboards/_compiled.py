"""The "compiled regions" section: calls into torch.compile'd code and the copies their graphs
contain, for the summary and the report.

Compiled code is not traced op by op. Its calls are ``copytrace.compiled`` spans; its copies are
those found in the graphs before the backend fused them (``copytrace.graph_copy`` span events of
``copytrace.compiled_graph`` spans), counted once per graph run. They are kept apart from the
observed copies: never added to the observed totals, only compared with them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from copytrace.dashboards._load import TraceData

__all__ = ["CompiledSection", "GraphCopyRow", "compiled_section", "summary_lines"]


@dataclass(slots=True)
class GraphCopyRow:
    """One copy node of one compiled graph.

    Attributes:
        graph: compile id (``"1/0"``); kind: ``forward``, ``backward`` or ``inference``.
        op: ``aten::clone``...; copy_kind: ``clone``, ``cast``, ``copy_into``, ``gather``...
        shape, dtype, device: the result's, from the node's fake-tensor metadata.
        bytes: logical bytes per run (``None``: symbolic shape).
        runs: how many times its graph ran while traced.
        file, line, code: the user source line, when the node had a stack trace.
        input_mutation: functionalization's write-back of a mutated graph input.
    """

    graph: str
    kind: str
    op: str
    copy_kind: str
    shape: list[Any]
    dtype: str
    device: str
    bytes: int | None
    runs: int
    file: str | None = None
    line: int | None = None
    code: str | None = None
    input_mutation: bool = False

    @property
    def total_bytes(self) -> int:
        """Bytes over the whole run: bytes per run x runs."""
        return (self.bytes or 0) * self.runs

    @property
    def site(self) -> str:
        return f"{self.file}:{self.line}" if self.file else "(no source line)"


@dataclass
class CompiledSection:
    """Compiled regions of every run in a trace.

    Attributes:
        calls: calls into compiled code (outermost, traced thread).
        time_ns: their summed host duration in ns (compile time included).
        graphs: compiled graphs whose AOT graphs were seen while tracing.
        unknown_graph_runs: graph runs whose graphs were compiled before tracing started.
        graph_copy_bytes: bytes of graph copies over all calls (per run x runs).
        rows: one row per copy node, biggest total first.
        mode: the run span's ``copytrace.compiled_mode`` (``compiled``/``eager``), if any.
    """

    calls: int = 0
    time_ns: int = 0
    graphs: int = 0
    unknown_graph_runs: int = 0
    graph_copy_bytes: int = 0
    rows: list[GraphCopyRow] = field(default_factory=list)
    mode: str | None = None

    def share_pct(self, observed_bytes: int) -> float | None:
        """Graph-copy bytes as a percentage of graph-copy plus observed copy bytes."""
        whole = self.graph_copy_bytes + observed_bytes
        return self.graph_copy_bytes / whole * 100 if whole else None


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def compiled_section(trace: TraceData) -> CompiledSection | None:
    """The compiled-regions data of ``trace``; ``None`` when it has none."""
    section = CompiledSection()
    seen = False
    for run in trace.runs:
        mode = run.attrs.get("copytrace.compiled_mode")
        if isinstance(mode, str):
            section.mode = mode
            seen = True
        for call in run.compiled_calls:
            seen = True
            section.calls += 1
            section.time_ns += call.duration_ns
            section.graph_copy_bytes += _int(call.attrs.get("copytrace.compiled.graph_copy_bytes"))
            section.unknown_graph_runs += _int(call.attrs.get("copytrace.compiled.unknown_graphs"))
        for graph in run.compiled_graphs:
            seen = True
            section.graphs += 1
            runs = _int(graph.attrs.get("copytrace.compiled.runs"))
            for name, _, a in graph.span_events:
                if name != "copytrace.graph_copy":
                    continue
                nbytes = a.get("copytrace.bytes_logical")
                section.rows.append(
                    GraphCopyRow(
                        graph=str(a.get("copytrace.compiled.graph", "")),
                        kind=str(a.get("copytrace.compiled.kind", "")),
                        op=str(a.get("copytrace.aten", "")),
                        copy_kind=str(a.get("copytrace.copy_kind", "")),
                        shape=list(a.get("copytrace.shape") or []),
                        dtype=str(a.get("copytrace.dtype", "")),
                        device=str(a.get("copytrace.dst_device", "")),
                        bytes=nbytes if isinstance(nbytes, int) else None,
                        runs=runs,
                        file=a.get("code.file.path"),
                        line=a.get("code.line.number"),
                        code=a.get("copytrace.code"),
                        input_mutation=a.get("copytrace.compiled.input_mutation") is True,
                    )
                )
    if not seen:
        return None
    section.rows.sort(key=lambda r: (-r.total_bytes, r.graph, r.op))
    return section


def _fmt_bytes(n: int) -> str:
    from copytrace.dashboards._model import format_bytes

    return format_bytes(n)


def _fmt_ns(n: int) -> str:
    from copytrace.dashboards._model import format_ns

    return format_ns(n)


def summary_lines(section: CompiledSection, observed_bytes: int, top_n: int = 10) -> list[str]:
    """Terminal lines for ``copytrace summary``.

    Args:
        section: what :func:`compiled_section` returned.
        observed_bytes: bytes copied by the observed (traced) copies.
        top_n: most copy rows listed.
    """
    lines = [""]
    if section.mode == "eager":
        lines.append("compiled regions: ran eagerly (this torch offers no hook), traced op by op")
        return lines
    share = section.share_pct(observed_bytes)
    lines.append(
        f"compiled regions: {section.calls} calls, {section.graphs} graphs, "
        f"{_fmt_ns(section.time_ns)} (not traced op by op)"
    )
    lines.append(
        f"  copies found in their graphs before fusion (not observed, not in the totals "
        f"above): {_fmt_bytes(section.graph_copy_bytes)} ({section.graph_copy_bytes} B) "
        f"= {'-' if share is None else f'{share:.1f}%'} of copy bytes "
        f"(observed {_fmt_bytes(observed_bytes)} + graphs)"
    )
    if section.unknown_graph_runs:
        lines.append(
            f"  {section.unknown_graph_runs} graph runs of graphs compiled before tracing "
            f"started: their copies are unknown"
        )
    for r in section.rows[:top_n]:
        shape = "x".join(str(d) for d in r.shape) or "scalar"
        per = _fmt_bytes(r.bytes) if r.bytes is not None else "? B"
        what = " (input mutation write-back)" if r.input_mutation else ""
        lines.append(
            f"  graph {r.graph} {r.kind:<9} {r.op:<32} {r.dtype}[{shape}] {r.device} "
            f"{per} x {r.runs} runs  {r.site}{what}"
        )
    return lines
