"""The copies a compiled graph still contains, read from torch's structured compile log.

While tracing, a handler on torch's structured trace logger (``torch.__trace``, the one
``TORCH_TRACE``/tlparse uses) receives the AOTAutograd graphs of every compile: the forward,
backward and inference graphs after functionalization and decomposition, before the backend
fuses them. torch logs them both when it compiles and when it loads a compile from its caches,
as the text of ``GraphModule.print_readable(include_stride=True, include_device=True)``: one
line per node with the node's fake-tensor metadata (``"f32[32, 64][64, 1]cpu"``) and
``# File: path:line in function, code: ...`` comments from the nodes' stack traces. This module
parses that text; it never touches the graphs themselves, so compiling is unchanged.

A copy is a node whose op allocates new storage holding its input's values or writes values
into an existing tensor: ``clone``, ``_to_copy``, ``prims.convert_element_type`` (a dtype
cast), ``prims.device_put``, ``copy_`` (functionalization's write-back of a mutated input, or
a user ``copy_``), the ``*_copy`` view-copies, and gathers (``index``, ``gather``,
``index_select``, ``take``). Each is counted with the logical bytes of its result
(numel x element size; ``None`` when a dimension is symbolic).

A graph loaded from torch's caches (AOTAutograd's, keyed on the graph, not on where it came
from) carries the ``# File:`` comments of the compile that filled the cache: maybe another
file, or other line numbers. Dynamo traces the frame anew on every compile, so its
``dynamo_output_graph`` record names the lines of this run; a copy whose site is not among
them is moved to the one site there with the same function and code text
(:func:`relocate`); with none, or several, it keeps the site the graph gave.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from typing import Any

__all__ = ["CompiledCall", "CompiledGraphSpan", "GraphCopy", "GraphLogHandler", "parse_graph"]

_NODE = re.compile(
    r"^\s+(?P<name>\w+): \"(?P<type>[^\"]*)\" = torch\.ops\.(?P<ns>\w+)\.(?P<op>\w+)\.(?P<ovl>\w+)"
    r"\((?P<arg0>\w*)"
)
_INPUT = re.compile(r"^(primals_\d+|arg\d+_\d+)$")  # a graph input (placeholder) name
_TYPE = re.compile(r"^(?P<dt>[a-z][a-z0-9]*)\[(?P<shape>[^\]]*)\]\[[^\]]*\](?P<dev>\S*)$")
_FILE = re.compile(r"^\s+# File: (?P<file>.+?):(?P<line>\d+) in (?P<fn>[^,]+), code: (?P<code>.*)$")
_NO_STACK = "# No stacktrace found"

#: (namespace, op) -> kind, for the ops that are copies.
_COPY_OPS: dict[tuple[str, str], str] = {
    ("aten", "clone"): "clone",
    ("aten", "_to_copy"): "cast",
    ("prims", "convert_element_type"): "cast",
    ("prims", "device_put"): "transfer",
    ("aten", "copy_"): "copy_into",
    ("aten", "copy"): "copy",
    ("aten", "lift_fresh_copy"): "copy",
    ("aten", "index"): "gather",
    ("aten", "gather"): "gather",
    ("aten", "index_select"): "gather",
    ("aten", "take"): "gather",
}
_GRAPH_KINDS = {
    "aot_forward_graph": "forward",
    "aot_backward_graph": "backward",
    "aot_inference_graph": "inference",
}
_RESERVED = frozenset(
    ("rank", "compiled_autograd_id", "frame_id", "frame_compile_id", "attempt", "severity",
     "timestamp", "pathname", "thread", "subgraph_name", "has_payload", "stack")
)  # fmt: skip


def _copy_kind(ns: str, op: str) -> str | None:
    kind = _COPY_OPS.get((ns, op))
    if kind is None and ns == "aten" and op.endswith("_copy") and not op.startswith("_foreach"):
        return "copy"  # view_copy, t_copy, ... (functionalization's out-of-place views)
    return kind


def _dtypes() -> dict[str, Any]:
    from torch.utils._dtype_abbrs import dtype_abbrs

    return {abbr: dtype for dtype, abbr in dtype_abbrs.items()}


_DTYPES: dict[str, Any] = {}


class GraphCopy:
    """One copy node of a compiled graph (found in the graph, not observed at run time).

    Attributes:
        graph: compile id of the dynamo frame compile (``"1/0"``).
        kind: ``"forward"``, ``"backward"`` or ``"inference"`` (which AOT graph).
        op: ``"aten::clone"``, ``"prims::convert_element_type"``...
        copy_kind: ``clone``, ``cast``, ``transfer``, ``copy_into``, ``copy`` or ``gather``.
        node: the FX node's name.
        shape: result shape; symbolic dimensions are kept as text (``"s0"``).
        dtype: result dtype name (``"float32"``).
        device: result device (``"cpu"``, ``"cuda:0"``).
        bytes: logical bytes of the result (numel x element size); ``None`` when symbolic.
        file, line, function, code: the user source line the node came from, or ``None``.
        input_mutation: a ``copy_`` into a graph input: functionalization's write-back of an
            input the compiled code mutates.
    """

    __slots__ = ("graph", "kind", "op", "copy_kind", "node", "shape", "dtype", "device",
                 "bytes", "file", "line", "function", "code", "input_mutation")  # fmt: skip

    def __init__(self, **fields: Any) -> None:
        for name in self.__slots__:
            setattr(self, name, fields.get(name))

    def attributes(self) -> dict[str, Any]:
        """Attributes of the ``copytrace.graph_copy`` span event (absent values left out)."""
        attrs: dict[str, Any] = {
            "copytrace.aten": self.op,
            "copytrace.copy_kind": self.copy_kind,
            "copytrace.compiled.graph": self.graph,
            "copytrace.compiled.kind": self.kind,
            "copytrace.compiled.node": self.node,
            "copytrace.shape": [s if isinstance(s, int) else str(s) for s in self.shape or ()],
            "copytrace.dtype": self.dtype,
            "copytrace.dst_device": self.device,
            "copytrace.seen": "graph",
        }
        if self.bytes is not None:
            attrs["copytrace.bytes_logical"] = self.bytes
        if self.input_mutation:
            attrs["copytrace.compiled.input_mutation"] = True
        if self.file:
            attrs["code.file.path"] = self.file
            attrs["code.line.number"] = self.line
            attrs["code.function.name"] = self.function
            if self.code:
                attrs["copytrace.code"] = self.code
        return attrs


def _parse_type(text: str) -> tuple[tuple[Any, ...], str, str, int | None] | None:
    m = _TYPE.match(text)
    if m is None:
        return None
    if not _DTYPES:
        _DTYPES.update(_dtypes())
    dtype = _DTYPES.get(m["dt"])
    shape: list[Any] = []
    numel: int | None = 1
    for dim in (d.strip() for d in m["shape"].split(",")):
        if not dim:
            continue
        if dim.isdigit():
            shape.append(int(dim))
            if numel is not None:
                numel *= int(dim)
        else:
            shape.append(dim)
            numel = None
    name = str(dtype).removeprefix("torch.") if dtype is not None else m["dt"]
    nbytes = numel * dtype.itemsize if numel is not None and dtype is not None else None
    return tuple(shape), name, m["dev"], nbytes


def parse_graph(text: str, graph: str, kind: str) -> list[GraphCopy]:
    """The copy nodes of one printed AOT graph.

    Args:
        text: ``GraphModule.print_readable`` output with strides and devices.
        graph: the compile id to record (``"1/0"``).
        kind: ``"forward"``, ``"backward"`` or ``"inference"``.
    """
    out: list[GraphCopy] = []
    site: tuple[str, int, str, str] | None = None
    for line in text.splitlines():
        stripped = line.lstrip()
        if stripped.startswith("#"):
            m = _FILE.match(line)
            if m is not None:
                site = (m["file"], int(m["line"]), m["fn"].strip(), m["code"].strip())
            elif stripped.startswith(_NO_STACK):
                site = None
            continue
        if " = torch.ops." not in line:
            continue
        m = _NODE.match(line)
        if m is None:
            continue
        copy_kind = _copy_kind(m["ns"], m["op"])
        if copy_kind is None:
            continue
        typed = _parse_type(m["type"])
        shape, dtype, device, nbytes = typed if typed is not None else ((), "", "", None)
        out.append(
            GraphCopy(
                graph=graph, kind=kind, op=f"{m['ns']}::{m['op']}", copy_kind=copy_kind,
                node=m["name"], shape=shape, dtype=dtype, device=device, bytes=nbytes,
                file=site[0] if site else None, line=site[1] if site else None,
                function=site[2] if site else None, code=site[3] if site else None,
                input_mutation=copy_kind == "copy_into" and bool(_INPUT.match(m["arg0"])),
            )
        )  # fmt: skip
    return out


def graph_sites(text: str) -> dict[tuple[str, str], set[tuple[str, int]]]:
    """The ``# File:`` sites of a printed graph: (function, code) -> {(file, line)}."""
    sites: dict[tuple[str, str], set[tuple[str, int]]] = {}
    for line in text.splitlines():
        m = _FILE.match(line)
        if m is not None:
            key = (m["fn"].strip(), m["code"].strip())
            sites.setdefault(key, set()).add((m["file"], int(m["line"])))
    return sites


def relocate(copies: list[GraphCopy], sites: dict[tuple[str, str], set[tuple[str, int]]]) -> None:
    """Point each copy at a site of this compile (``sites``: :func:`graph_sites` of dynamo's
    graph), in place: a site found there is kept; one that is not (a graph from the cache,
    printed by an earlier compile) takes the single site with the same function and code;
    with none or several (a node dynamo's graph does not show) it stays as it is."""
    known = {site for found in sites.values() for site in found}
    for c in copies:
        if c.file is None or (c.file, c.line) in known:
            continue
        found = sites.get((c.function, c.code), set())
        if len(found) == 1:
            c.file, c.line = next(iter(found))


class GraphInfo:
    """What the compile log said about one dynamo frame compile (one graph id).

    Attributes:
        graph: the compile id (``"1/0"``).
        file, line, function: the frame dynamo compiled (``None`` when not logged).
        copies: copy nodes of its AOT graphs, forward (or inference) first.
        logged_ns: ``perf_counter_ns`` when its first AOT graph was logged.
    """

    __slots__ = ("graph", "file", "line", "function", "copies", "logged_ns", "kinds", "sites")

    def __init__(self, graph: str) -> None:
        self.graph = graph
        self.file: str | None = None
        self.line: int | None = None
        self.function: str | None = None
        self.copies: list[GraphCopy] = []
        self.logged_ns = time.perf_counter_ns()
        self.kinds: list[str] = []
        #: (function, code) -> sites of dynamo's graph of this compile (None: not logged)
        self.sites: dict[tuple[str, str], set[tuple[str, int]]] | None = None

    @property
    def copy_bytes(self) -> int:
        return sum(c.bytes or 0 for c in self.copies)


class GraphLogHandler(logging.Handler):
    """Collects :class:`GraphInfo` per compile id from torch's structured trace records.

    Args:
        on_error: called with any exception raised while reading a record (never raised).
    """

    def __init__(self, on_error: Callable[[BaseException], None]) -> None:
        super().__init__(logging.DEBUG)
        self.graphs: dict[str, GraphInfo] = {}
        self._strings: dict[int, str] = {}
        self._on_error = on_error

    def _info(self, meta: dict[str, Any]) -> GraphInfo | None:
        frame, compile_ = meta.get("frame_id"), meta.get("frame_compile_id")
        if frame is None or compile_ is None:
            return None
        prefix = f"!{meta['compiled_autograd_id']}/" if "compiled_autograd_id" in meta else ""
        gid = f"{prefix}{frame}/{compile_}"
        info = self.graphs.get(gid)
        if info is None:
            info = self.graphs[gid] = GraphInfo(gid)
        return info

    def emit(self, record: logging.LogRecord) -> None:
        try:
            meta = getattr(record, "metadata", None)
            if not isinstance(meta, dict):
                return
            name = next((k for k in meta if k not in _RESERVED), None)
            if name == "str":  # interned file names: [text, index]
                text, index = meta["str"]
                self._strings[int(index)] = str(text)
            elif name == "dynamo_start":
                info = self._info(meta)
                stack = (meta.get("dynamo_start") or {}).get("stack") or ()
                if info is not None and stack:
                    top = stack[-1]
                    filename = top.get("filename")
                    if isinstance(filename, int):
                        filename = self._strings.get(filename)
                    info.file, info.line, info.function = filename, top.get("line"), top.get("name")
            elif name == "dynamo_output_graph":
                payload = getattr(record, "payload", None)
                info = self._info(meta)
                if info is not None and isinstance(payload, str):
                    info.sites = graph_sites(payload)
            elif name in _GRAPH_KINDS:
                payload = getattr(record, "payload", None)
                info = self._info(meta)
                if info is None or not isinstance(payload, str):
                    return
                kind = _GRAPH_KINDS[name]
                if kind in info.kinds:  # a restarted attempt logs its graphs again
                    info.copies = [c for c in info.copies if c.kind != kind]
                else:
                    info.kinds.append(kind)
                copies = parse_graph(payload, info.graph, kind)
                if info.sites is not None:
                    relocate(copies, info.sites)
                info.copies.extend(copies)
        except Exception as err:  # a record of another shape: count it, never raise
            self._on_error(err)


class CompiledCall:
    """One outermost call into compiled code on the traced thread.

    Attributes:
        start_ns, end_ns: ``perf_counter_ns`` at the call's entry and exit (host time,
            compile time included on a call that compiled).
        step: step number at entry.
        file, line, function: the function or ``forward`` that was compiled.
        graphs: compile ids (``"1/0"``) of the graphs the call ran, in order, repeats kept.
        new_graphs: graphs compiled during this call.
        copies, copy_bytes: copy nodes in the forward and backward graphs of those graphs, and
            their logical bytes, counted once per graph run (found in the graphs, not observed).
        unknown_graphs: graphs run whose AOT graphs copytrace did not see (compiled before
            tracing started).
    """

    __slots__ = ("start_ns", "end_ns", "step", "file", "line", "function", "graphs",
                 "new_graphs", "copies", "copy_bytes", "unknown_graphs")  # fmt: skip
    op = "compiled"
    span_name = "copytrace.compiled"
    error = None
    group = False
    parent = -1

    def __init__(self, start_ns: int, step: int) -> None:
        self.start_ns = start_ns
        self.end_ns = start_ns
        self.step = step
        self.file: str | None = None
        self.line: int | None = None
        self.function: str | None = None
        self.graphs: list[str] = []
        self.new_graphs = 0
        self.copies = 0
        self.copy_bytes = 0
        self.unknown_graphs = 0

    def span_attributes(self) -> dict[str, Any]:
        attrs: dict[str, Any] = {
            "copytrace.step": self.step,
            "copytrace.compiled.graphs": list(self.graphs),
            "copytrace.compiled.graph_copies": self.copies,
            "copytrace.compiled.graph_copy_bytes": self.copy_bytes,
        }
        if self.file:
            attrs["code.file.path"] = self.file
            attrs["code.line.number"] = self.line
            attrs["code.function.name"] = self.function
        if self.new_graphs:
            attrs["copytrace.compiled.new_graphs"] = self.new_graphs
        if self.unknown_graphs:
            attrs["copytrace.compiled.unknown_graphs"] = self.unknown_graphs
        return attrs

    def span_events(self) -> list[tuple[str, int, dict[str, Any]]]:
        return []


class CompiledGraphSpan:
    """One compiled graph with its copies (a ``copytrace.compiled_graph`` span whose
    ``copytrace.graph_copy`` span events are the copies)."""

    op = "compiled_graph"
    span_name = "copytrace.compiled_graph"
    error = None
    group = False
    parent = -1
    step = None

    def __init__(self, info: Any, runs: int) -> None:
        self.info = info
        self.runs = runs
        self.start_ns = self.end_ns = info.logged_ns

    def span_attributes(self) -> dict[str, Any]:
        info = self.info
        attrs: dict[str, Any] = {
            "copytrace.compiled.graph": info.graph,
            "copytrace.compiled.kinds": list(info.kinds),
            "copytrace.compiled.runs": self.runs,
            "copytrace.compiled.copies": len(info.copies),
            "copytrace.compiled.copy_bytes": info.copy_bytes,
        }
        if info.file:
            attrs["code.file.path"] = info.file
            attrs["code.line.number"] = info.line
            attrs["code.function.name"] = info.function
        return attrs

    def span_events(self) -> list[tuple[str, int, dict[str, Any]]]:
        return [("copytrace.graph_copy", self.start_ns, c.attributes()) for c in self.info.copies]
