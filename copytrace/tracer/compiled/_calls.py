"""The compiled calls and graphs of a trace: where a call's callable comes from, which graphs
it ran, and the calls and graph spans handed to the export."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from copytrace.tracer.compiled.graphs import CompiledCall, CompiledGraphSpan

if TYPE_CHECKING:
    from copytrace.tracer.compiled.graphs import GraphLogHandler

_MAX_CALLS = 1_000_000  # calls buffered between two flushes; beyond it they are counted only


def _source_of(fn: Any) -> tuple[str, int, str] | None:
    """File, first line and name of the function a compiled callable compiles (read at each
    compiled call: nothing is kept on, or about, the callable; ``compiled.cpp``'s
    ``cc_source`` is the same walk in C)."""
    for _ in range(8):
        owner = getattr(fn, "__self__", None)
        if isinstance(owner, torch.nn.Module) and getattr(fn, "__name__", "") in (
            "__call__", "_call_impl", "_wrapped_call_impl",
        ):  # fmt: skip
            fn = type(owner).forward
            continue
        if isinstance(fn, torch.nn.Module):
            fn = type(fn).forward
            continue
        wrapped = getattr(fn, "__wrapped__", None)
        if wrapped is None:
            break
        fn = wrapped
    code = getattr(fn, "__code__", None)
    if code is None:
        return None
    return code.co_filename, code.co_firstlineno, code.co_name


def _compile_id(code: Any) -> str | None:
    """Compile id of the graph whose dynamo-generated code is ``code`` (``None``: not one)."""
    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list
    from torch._dynamo.utils import orig_code_map

    orig = orig_code_map.get(code)
    if orig is None:
        return None
    for entry in _debug_get_cache_entry_list(orig):
        if entry.code is code:
            return str(entry.compile_id)
    return None



class CallLog:
    """The calls recorded by :class:`~copytrace.tracer.compiled.Compiled` (a mixin: the state
    is its, set up in its ``__init__``)."""

    handler: GraphLogHandler
    graph_runs: dict[str, int]
    calls_dropped: int
    _calls: list[CompiledCall]
    _calls_total: int
    _raw: list[tuple[Any, ...]]
    _code_graphs: dict[Any, Any]

    def _wrapper_source(self, frame: Any, native: Any) -> tuple[str, int, str] | None:
        """:func:`_source_of` the callable that torch.compile's ``compile_wrapper`` (``frame``
        or one of the next frames out) wraps. The wrapper's ``fn`` is read with the observer's ``frame_var`` (no f_locals dict)."""
        for _ in range(4):
            if frame is None or frame.f_code.co_name == "compile_wrapper":
                break
            frame = frame.f_back
        if frame is None:
            return None
        fn = None
        if native is not None:
            try:
                fn = native.frame_var(frame, "fn")
            except NameError:
                return None
        if fn is None:
            fn = frame.f_locals.get("fn")
        return self._source_for(fn)

    def _source_for(self, fn: Any) -> tuple[str, int, str] | None:
        """:func:`_source_of` (compiled.cpp's ``cc_source`` calls this where its own walk
        fails)."""
        return _source_of(fn)

    def resolve(self, codes: list[Any]) -> None:
        """Find the graph ids of codes not seen before (compiled.cpp's cc_leave calls this for
        a call that ran one; it reads ``_code_graphs`` for the rest)."""
        known = self._code_graphs
        for code in codes:
            if code not in known:
                # None (cached too): a disabled function called from code that is not a
                # dynamo graph's (dynamo installs a graph's cache entry before it first runs)
                known[code] = _compile_id(code)

    def _drain(self) -> None:
        """Make the ended calls CompiledCall objects, in their order."""
        raw = self._raw
        if not raw:
            return
        items = raw[:]
        del raw[:]  # the same list: compiled.cpp appends to it
        for start, end, step, src, ids, new_graphs, copies, nbytes, unknown in items:
            self._calls_total += 1
            if len(self._calls) >= _MAX_CALLS:
                self.calls_dropped += 1
                continue
            call = CompiledCall(start, step)
            call.end_ns = end
            if src is not None:
                call.file, call.line, call.function = src
            call.graphs = ids
            call.new_graphs = new_graphs
            call.copies = copies
            call.copy_bytes = nbytes
            call.unknown_graphs = unknown
            self._calls.append(call)

    @property
    def calls(self) -> list[CompiledCall]:
        """The calls recorded (since the last :meth:`take_calls`)."""
        self._drain()
        return self._calls

    @property
    def calls_total(self) -> int:
        """Calls recorded since tracing started (kept or dropped)."""
        self._drain()
        return self._calls_total

    def _graph_ids(self, codes: list[Any]) -> list[str]:
        """The graph ids of the dynamo-generated codes whose graphs ran in a call (noted by the
        ``torch._dynamo.disable`` wrapper's callback), each run counted in ``graph_runs``."""
        ids = []
        self.resolve(codes)
        known = self._code_graphs
        runs = self.graph_runs
        for code in codes:
            gid = known[code]
            if gid is not None:
                ids.append(gid)
                runs[gid] = runs.get(gid, 0) + 1
        return ids

    # -- export -------------------------------------------------------------------------------
    def take_calls(self) -> list[CompiledCall]:
        """The calls recorded since the last take (handed to the export)."""
        self._drain()
        calls, self._calls = self._calls, []
        return calls

    def discard_calls(self, keep: int) -> int:
        """Drop the calls recorded after the first ``keep`` (untraced steps); return how many."""
        self._drain()
        dropped = max(0, len(self._calls) - keep)
        if dropped:
            del self._calls[keep:]
            self._calls_total -= dropped
        return dropped

    def graph_spans(self) -> list[CompiledGraphSpan]:
        """One span per graph whose AOT graphs were logged while tracing."""
        self._drain()
        return [
            CompiledGraphSpan(info, self.graph_runs.get(gid, 0))
            for gid, info in self.handler.graphs.items()
            if info.kinds
        ]

    def run_attributes(self) -> dict[str, Any]:
        attrs: dict[str, Any] = {
            "copytrace.compiled_calls": self.calls_total,
            "copytrace.compiled_graphs": sum(1 for i in self.handler.graphs.values() if i.kinds),
        }
        if self.calls_dropped:
            attrs["copytrace.compiled_calls_dropped"] = self.calls_dropped
        return attrs

