"""The hot path: a TorchFunctionMode and a TorchDispatchMode that record copies and aliases.

How the two modes split the work (facts of torch 2.13, see ``docs/trace-format.md``):

* The function mode sees the user's API call (``Tensor.clone``, ``.data``, ``.to``,
  ``Tensor.__deepcopy__``...). For one of those it runs the call, then compares the result
  with the input: same object (no-op), same storage (alias) or new storage (copy), and reads
  the graph facts. While that call runs, the aten copy ops it causes are folded into its
  event, so one user call is one event.
* The dispatch mode sees aten ops. A copy op (``aten::clone``, ``aten::_to_copy``,
  ``aten::copy_``...) with no API call around it is an ``implicit`` copy: made inside a
  composite, by autograd in backward, by autocast or by an optimizer. A bare ``aten::detach``
  or ``aten::alias`` with no API call is autograd's own bookkeeping (saving an output for
  backward, accumulating ``.grad``): it is counted, not recorded as an event.
* Neither mode is re-entered by its own handler: torch pops a mode from its stack while the
  mode's handler runs, and API calls nested in a recorded call are folded into it.

The recorder is split by responsibility: :mod:`copytrace.tracer._rules` (the tables and the
API-event rules, as data the C++ observer also reads), :mod:`copytrace.tracer._api_events` (API
calls), :mod:`copytrace.tracer._implicit` (aten-level copies), :mod:`copytrace.tracer._modes`
(the two Python modes), :mod:`copytrace.tracer._patches` (the active recorder and the patched
functions); this module keeps the buffer, the counters, attribution and deepcopy groups.

Nothing here keeps a tensor alive: events hold shapes, names and integers only. Any error in
the recording code is counted in ``Recorder.errors`` and never raised into the user's code.
"""

from __future__ import annotations

import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

from copytrace._threads import NAMES as _NAMES
from copytrace._threads import current_name as _thread_name
from copytrace.schema import CopyEvent
from copytrace.tracer import _callsite, _modules, _node_tags
from copytrace.tracer import _facts as _F
from copytrace.tracer._api_events import (  # noqa: F401
    _PROTOTYPE,
    ApiEvents,
    _Pending,
    _tag_grad_fn,
    leaf_version,
)
from copytrace.tracer._handover import Handovers
from copytrace.tracer._implicit import ImplicitEvents

# Names other modules and tests read from here (their homes are the modules named above).
from copytrace.tracer._modes import DispatchMode, FunctionMode, ValueMode, warm_up  # noqa: F401
from copytrace.tracer._patches import (  # noqa: F401
    EXTRA_PATCHES,
    MISSING,
    PATCH_FUNCTIONS,
    _here,
    _traced_deepcopy,
    active_recorder,
    install_patches,
    remove_patches,
    set_active,
)
from copytrace.tracer._rules import (  # noqa: F401
    _ALIAS,
    _BEFORE_OPS,
    _COPY,
    _COPY_INTO,
    _IN_PYTHON,
    _NOT_C_EVENT_OPS,
    _api_table,
    _aten_name,
    _aten_table,
    _storage_nbytes,
    _transfer,
)
from copytrace.tracer.watch import BACKWARD_FUNCTIONS, Watch

__all__ = ["FLUSH_NEVER", "Recorder", "active_recorder"]

#: ``Recorder.flush_at`` while no flush by count is armed (fits the C observer's int64).
FLUSH_NEVER = 2**62

_perf_ns = time.perf_counter_ns
_NoTorchFunction = torch._C.DisableTorchFunction
_get_ident = threading.get_ident
_graph_task_id = torch._C._current_graph_task_id
_current_node = torch._C._current_autograd_node
# the tensor readers _handover.py reads from here
_dtype_name = _F.dtype_name
_device_str = _F.device_str
_shape = _F.shape
_nbytes = _F.nbytes


class _Group:
    """An outermost ``copy.deepcopy`` of a non-tensor object in progress."""

    __slots__ = ("seq", "start_ns", "storages", "bytes", "tensors", "children", "failed")

    def __init__(self, seq: int, start_ns: int) -> None:
        self.seq = seq
        self.start_ns = start_ns
        self.storages: set[int] = set()  # result storage pointers already counted
        self.bytes = 0
        self.tensors = 0
        self.children = 0
        #: (id, TensorImpl address, event) of the non-leaf tensor whose deepcopy raised
        self.failed: tuple[int, int, CopyEvent] | None = None



def _holder(x: Any, key: int, cdata: int) -> str | None:
    """Where deep-copied object ``x`` holds the tensor ``(id, TensorImpl address)``: a module
    attribute (``Net.last_hidden``, ``Net.enc.cache``) or a dict key (``dict['out']``); None
    when not found there. Called when a deepcopy of ``x`` raised only."""
    items: list[tuple[str, Any]] = []
    if isinstance(x, torch.nn.Module):
        root = type(x).__name__
        for path, module in x.named_modules():
            prefix = f"{root}.{path}" if path else root
            items.extend((f"{prefix}.{k}", v) for k, v in vars(module).items())
    elif isinstance(x, dict):
        items = [(f"{type(x).__name__}[{k!r}]", v) for k, v in x.items()]
    for name, value in items:
        if id(value) == key and isinstance(value, torch.Tensor) and value._cdata == cdata:
            return name
    return None


#: autograd nodes of a copy (``tools/autograd/derivatives.yaml``: ``_to_copy``, ``clone``;
#: ``copy_``'s ``CopyBackwards``)
_COPY_NODES = frozenset(("ToCopyBackward0", "CloneBackward0", "CopyBackwards"))


def _tag_node(tags: _node_tags.NodeTags, node: Any, module: str | None) -> None:
    """Tag a node of a forward copy copytrace did not see as an API call (autocast's cast of
    a parameter) the first time a backward runs it, with its leaf's version counter then: a
    later backward through the same node (a cast kept across steps, autocast's weight cache)
    compares it (:func:`leaf_version`)."""
    if type(node).__name__ not in _COPY_NODES:
        return
    version = leaf_version(node)
    if version is not None:
        try:
            tags.put(node, (module, None, version))
        except Exception:  # not an autograd node
            pass


class Recorder(ApiEvents, ImplicitEvents):
    """Owns the event buffer, the counters and the attribution state of one trace.

    Args:
        max_events: cap on buffered events; beyond it events are counted in ``dropped``.
        auto_step: advance the step on each ``optimizer.step()`` until :meth:`step` is
            called explicitly.
    """

    def __init__(self, max_events: int = 1_000_000, auto_step: bool = True) -> None:
        self.events: list[CopyEvent] = []
        self.max_events = max_events
        self.dropped = 0
        self.errors = 0
        self.last_error: str | None = None
        #: the first internal error's traceback (text), kept for the report and the oracle
        self.first_error: str | None = None
        self.internal_detaches = 0
        # Nesting depth of torch.compile'd calls running now on the traced thread (set by
        # copytrace.tracer.compiled): inside them copytrace's modes are off the stacks.
        self.compiled_depth = 0
        # aten copies of compiled graphs' backward (CompiledFunctionBackward) left unrecorded:
        # the graph's copies are listed from the graph instead.
        self.compiled_backward_skipped = 0
        # Host ns spent recording events (after the user's op returned): the tracer's own
        # cost per event, reported on the run span as copytrace.overhead_ns. The per-op cost
        # of the modes themselves (the floor) is measured by benchmarks/overhead.py instead.
        self.overhead_ns = 0
        self.step_index = 0
        self.step_starts: list[int] = []  # perf_counter_ns at each step start
        self.auto_step = auto_step
        self.active: _Pending | None = None
        self.group: _Group | None = None
        self.in_optimizer = 0
        #: the Python fallback: (begin, end) of each optimizer step, called by the function
        #: mode at torch's ``Optimizer.step#`` record scope (``_modes.FunctionMode``)
        self.step_scope: tuple[Any, Any] | None = None
        self.node_tags = _node_tags.NodeTags(self)  # the recorded copies' nodes (_node_tags.py)
        # nn.Module paths, from the frames at event time (copytrace/tracer/_modules.py)
        self.modules = _modules.Modules()
        self.api_table = _api_table()
        self.aten_table = _aten_table()
        # Runtime facts for copytrace.analysis (copytrace/tracer/watch/).
        self.watch = Watch(self, Handovers(self))
        #: the C++ observer module while it is engaged (copytrace/tracer/_native), else None
        self.native: Any = None
        #: level lean: no mode; ``.data`` writes are seen by the C++ write watch instead
        #: (``_native/watch_cb.cpp``, set up by ``_observer.install_wrappers``)
        self.lean = False
        self._native_state: tuple | None = None  # record.cpp's record: its first argument
        #: a flush by count (copytrace.tracer._buffer): ``full()`` is called once ``events``
        #: holds ``flush_at`` records (the after-call hook, api_mode.cpp's fast_event); a
        #: flush sets ``flush_at`` back to ``flush_every``; ``on_full``: the session's flush
        self.flush_every = self.flush_at = FLUSH_NEVER
        self.on_full: Callable[[], None] | None = None
        for fn in BACKWARD_FUNCTIONS:
            self.api_table[fn] = "backward"

    def release(self) -> None:
        """Let go of what follows the program's objects once the trace is written: the
        ``state_dict()`` handovers, the node tags' weak pointers, the storage ids' and the module
        paths' weak handles on storages. The events stay."""
        self.modules.release()
        handovers = self.watch.handovers
        handovers.sources = {}
        handovers.watched = []
        self.node_tags = _node_tags.NodeTags(self)
        self.watch.ids.close()

    def full(self) -> None:
        """``events`` holds ``flush_at`` records: the session's flush by count (``on_full``),
        called after a call's event is complete. Never raises (an error is counted)."""
        on_full = self.on_full
        try:
            if on_full is None:
                self.flush_at = FLUSH_NEVER
            else:
                on_full()
        except Exception as err:
            self.note_error(err)

    # -- counters and attribution ---------------------------------------------------------
    def note_error(self, err: BaseException) -> None:
        self.errors += 1
        self.last_error = f"{type(err).__name__}: {err}"
        if self.first_error is None:
            self.first_error = "".join(traceback.format_exception(err))

    def step(self, now_ns: int | None = None) -> int:
        self.watch.step_end()
        self.modules.step()
        self.step_index += 1
        self.step_starts.append(_perf_ns() if now_ns is None else now_ns)
        return self.step_index

    def watch_writes(self, on: bool) -> None:
        """:class:`~copytrace.tracer.watch.WatchHost`: have every torch call checked for an
        in-place write into a ``.data`` alias (``on``), or stop."""
        native = self.native
        if native is not None and not self.lean:  # level lean: the C++ write watch instead
            native.set_watch_writes(on)

    def owner_name(self, t: torch.Tensor) -> str | None:
        """:class:`~copytrace.tracer.watch.WatchHost`: ``Module.path.param`` of ``t``."""
        return self.modules.owner_name(t)

    def owner_name_by_identity(self, key: int, cdata: int) -> str | None:
        """:class:`~copytrace.tracer.watch.WatchHost`: ``Module.path.param`` of the live
        tensor ``(id, TensorImpl address)`` names, or None."""
        return self.modules.owner_name_by_identity(key, cdata)

    def module_name(self, module: torch.nn.Module) -> str:
        """Path of ``module``: ``Root.child.grandchild``, the root named by its class."""
        return self.modules.name(module)

    def _append(self, ev: CopyEvent) -> None:
        if len(self.events) < self.max_events:
            self.events.append(ev)
        else:
            self.dropped += 1

    def _context(self, ev: CopyEvent) -> None:
        native = self.native
        if native is not None:  # the same walk in C, with the user's line cached
            site = native.call_site(_callsite._code_kind)
        else:
            site = _callsite.call_site(sys._getframe(2))
        if site is not None:
            _callsite.put_site(ev, site)
        ev.step = self.step_index
        self._place(ev, sys._getframe(1))

    def _place(self, ev: CopyEvent, frame: Any) -> None:
        """Phase, module, thread and deepcopy group of ``ev`` (the rest of :meth:`_context`);
        ``frame``: where the search for the module call in progress starts (None: none)."""
        node = _current_node() if _graph_task_id() >= 0 else None
        if node is not None:
            ev.phase = "backward"
            # The node running now is the forward output's grad_fn; copytrace tagged it
            # when it recorded that forward call (see _tag_grad_fn).
            ev.via = type(node).__name__
            tag = self.node_tags.get(node)
            if tag is not None:
                ev.module, ev.origin, version = tag
                if version is not None and leaf_version(node) != version:
                    ev.stale = True  # a kept copy used after its leaf changed in place
            else:
                ev.module = self.modules.of_node(node)
                _tag_node(self.node_tags, node, ev.module)
        else:
            ev.module = self.modules.current(frame)
            if _graph_task_id() >= 0:
                ev.phase = "backward"
            elif self.in_optimizer:
                ev.phase = "optimizer"
            elif ev.module is not None:
                ev.phase = "forward"
            else:
                ev.phase = "other"
        name = getattr(_NAMES, "name", None)
        if name is None:
            name = _NAMES.name = _thread_name()
        ev.thread_id = _get_ident()
        ev.thread_name = name
        group = self.group
        if group is not None:
            ev.parent = group.seq


    # -- deepcopy groups ----------------------------------------------------------------------
    def deepcopy_group(self, orig: Any, x: Any, memo: Any, nil: Any) -> Any:
        """Run the outermost ``copy.deepcopy(x)`` as one group span over its tensor copies."""
        seq = len(self.events) + self.dropped
        group = _Group(seq, _perf_ns())
        self.group = group
        # Reserve the group's slot so it precedes its children in the buffer.
        placeholder = CopyEvent(op="deepcopy", group=True)
        placeholder.seq = seq
        self._append(placeholder)
        error = None
        try:
            return orig(x, memo, nil)
        except BaseException as err:
            error = type(err).__name__
            raise
        finally:
            end = _perf_ns()
            self.group = None
            try:
                with _NoTorchFunction():
                    self._close_group(placeholder, group, x, end, error)
            except Exception as err:
                self.note_error(err)

    def _close_group(
        self, ev: CopyEvent, group: _Group, x: Any, end: int, error: str | None
    ) -> None:
        if group.tensors == 0 and error is None and self.events and self.events[-1] is ev:
            self.events.pop()  # deepcopy of an object holding no tensor: not a copy event
            return
        ev.start_ns = group.start_ns
        ev.end_ns = end
        ev.bytes_allocated = group.bytes
        ev.tensors = group.tensors
        ev.object_type = f"{type(x).__module__}.{type(x).__qualname__}"
        ev.error = error
        ev.dtype = ev.src_dtype = ""
        ev.src_device = ev.dst_device = ""
        self._context(ev)
        ev.parent = -1
        if error is not None and group.failed is not None:
            failed = group.failed
            failed[2].src_name = _holder(x, failed[0], failed[1])

