"""aten-level events: copies no API call explains, and ``torch.from_numpy``.

:class:`ImplicitEvents` is the part of :class:`copytrace.tracer._recorder.Recorder` that the
dispatch level calls: the Python ``DispatchMode`` (:mod:`copytrace.tracer._modes`) or the C++
observer's kernels (through :func:`copytrace.tracer._observer._implicit`). An aten copy op
(``aten::clone``, ``aten::_to_copy``, ``aten::copy_``...) that runs with no API call in
progress is an ``implicit`` copy: made inside a composite, by autograd in backward, by autocast
or by an optimizer. Dispatch-level tensors carry no autograd metadata, so the graph facts of
these events stay unknown (``"none"``).
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import torch

from copytrace.schema import CopyEvent
from copytrace.tracer import _facts as _F
from copytrace.tracer._api_events import _PROTOTYPE
from copytrace.tracer._rules import _COPY_INTO, NO_MEMORY, _transfer, settle_unreal

if TYPE_CHECKING:
    from copytrace.tracer._recorder import Recorder

__all__ = ["ImplicitEvents"]

_Tensor = torch.Tensor
_current_node = torch._C._current_autograd_node
_sequence_nr = torch._C._autograd._get_sequence_nr
_cache_enabled = torch.is_autocast_cache_enabled
#: autocast's lower-precision dtypes (torch.autocast's ``dtype=``).
_LOWER = frozenset(("bfloat16", "float16"))
_facts = _F.facts
_dtype_name = _F.dtype_name
_device_str = _F.device_str
_shape = _F.shape
_nbytes = _F.nbytes


class ImplicitEvents:
    """The aten-level events of :class:`~copytrace.tracer._recorder.Recorder` (a mixin: every
    attribute read here is the recorder's)."""

    def implicit(
        self: Recorder, name: str, kind: int, args: tuple, kwargs: dict, out: Any, start: int, end: int
    ) -> None:
        """Record an aten copy that no API call explains.

        Args:
            name: the aten op, as ``aten::clone`` (overload appended when not the default).
            kind: ``_COPY`` (a new tensor) or ``_COPY_INTO`` (written into an existing one).
            args, kwargs: the op's arguments; out: its result.
            start, end: host ``perf_counter_ns`` around the op.
        """
        node = _current_node()
        if node is not None and type(node).__name__ == "CompiledFunctionBackward":
            self.compiled_backward_skipped += 1  # a compiled graph's backward: not op by op
            return None
        tensors = [a for a in args if isinstance(a, _Tensor)]
        if kind == _COPY_INTO:
            # copy_(dst, src), index_copy_(dst, dim, index, source), foo_copy(..., out=dst)
            if not tensors and args and isinstance(args[0], (list, tuple)):
                return self._implicit_foreach(name, args, start, end)
            dst = kwargs.get("out") if kwargs else None
            if not isinstance(dst, _Tensor):
                dst = tensors[0] if tensors else None
            src = tensors[-1] if len(tensors) > 1 else dst
            if name.startswith("aten::_copy_from") and len(tensors) > 1:
                src, dst = tensors[0], tensors[1]  # _copy_from(self=src, dst)
            allocated = 0
        else:
            dst = out if isinstance(out, _Tensor) else None
            src = tensors[0] if tensors else None
            allocated = -1  # the new storage's bytes, from its facts below
        if src is None or dst is None:
            return None
        native = self.native
        fs = _facts(native, src)
        fd = fs if dst is src else _facts(native, dst)
        if native is not None:
            ev = native.copy_slots(_PROTOTYPE)
            ev.op = "implicit"
            ev.aten = (name,)
        else:
            ev = CopyEvent(op="implicit", aten=(name,))
        ev.seq = len(self.events) + self.dropped
        ev.start_ns = start
        ev.end_ns = end
        ev.bytes_allocated = fd.storage_bytes if allocated < 0 else allocated
        ev.src_dtype = fs.dtype
        ev.src_device = fs.device
        ev.src_requires_grad = fs.requires_grad
        ev.shape = fd.shape
        ev.dtype = fd.dtype
        ev.dst_device = fd.device
        ev.transfer = _transfer(ev.src_device, ev.dst_device)
        ev.bytes_logical = fd.logical_bytes
        if fd.device in NO_MEMORY or (type(dst) is not _Tensor and _F.is_fake(dst)):
            settle_unreal(ev)  # a meta or fake tensor: nothing allocated, nothing moved
        ev.non_blocking = bool(kwargs.get("non_blocking", False)) if kwargs else False
        # Dispatch-level tensors carry no autograd metadata: graph facts stay unknown ("none").
        self._context(ev)
        _mark_context(self, ev, name)
        if ev.module is not None and ev.phase != "backward" and _made_node(tensors):
            # autograd made this copy's node just before the copy ran (the next sequence
            # number is the node's + 1): a backward copy of that node names this module
            self.modules.note_node(_sequence_nr() - 1, ev.module)
        self.watch.event(ev, "implicit", src, dst, fs, fd)
        if kind == _COPY_INTO and ev.dst_version is not None:
            # Seen below the ADInplaceOrView kernel, which bumps the written tensor's version
            # counter once the op returns (a write-back `x[:, 0] = f(x[:, 0])`): record the
            # version the tensor has afterwards, as for an API-level copy_.
            ev.dst_version += 1
        if kind == _COPY_INTO and ev.via in _STORAGE_COPIES:
            _storage_level(ev, _STORAGE_COPIES[ev.via])
        self._append(ev)
        return None

    def _recomputed(self: Recorder, ev: CopyEvent) -> None:
        """Mark a backward copy made by an activation checkpoint's recomputation (the user's
        forward re-run inside backward, ``torch.utils.checkpoint``) as the user's own call:
        ``recompute`` set, the op, module and ``via`` of the same line's forward event (the
        function mode does not see calls in backward: a recomputed ``x.float()`` reaches
        copytrace as an aten copy only), phase backward. A copy autograd makes for a node
        (the reentrant checkpoint's inner backward, a ``ToCopyBackward0``) is not one."""
        frame = sys._getframe(2)
        if _recompute_frame(frame) is None:
            return
        ev.recompute = True
        ev.via = ev.origin = None
        ev.graph = "attached" if ev.src_requires_grad and torch.is_grad_enabled() else "none"
        # the module call the recomputation re-entered (Module._call_impl below the checkpoint)
        ev.module = self.modules.current(frame)
        aten = ev.aten[0] if ev.aten else None
        key = (ev.file, ev.line, aten)
        found = _FORWARD_OPS.get(key)
        events = self.events
        for i in range(len(events) - 1, max(-1, len(events) - _LOOK_BACK), -1):
            if found is not None:
                break
            e = events[i]
            if (e.line == ev.line and e.file == ev.file and not e.recompute
                    and e.phase != "backward" and aten in e.aten):  # fmt: skip
                if len(_FORWARD_OPS) >= _LOOK_BACK:
                    _FORWARD_OPS.clear()
                found = _FORWARD_OPS[key] = (e.op, e.via)
        if found is not None:
            ev.op, ev.via = found

    def _implicit_foreach(self: Recorder, name: str, args: tuple, start: int, end: int) -> None:
        """``_foreach_copy_(dsts, srcs)``: one event for the whole list (0 bytes allocated)."""
        dsts = [t for t in args[0] if isinstance(t, _Tensor)]
        srcs = args[1] if len(args) > 1 and isinstance(args[1], (list, tuple)) else dsts
        if not dsts:
            return
        first, src = dsts[0], srcs[0] if srcs else dsts[0]
        ev = CopyEvent(op="implicit", aten=(name,))
        ev.seq = len(self.events) + self.dropped
        ev.start_ns = start
        ev.end_ns = end
        ev.tensors = len(dsts)
        ev.bytes_logical = sum(_nbytes(t) for t in dsts)
        ev.shape = _shape(first)
        ev.dtype = _dtype_name(first.dtype)
        ev.src_dtype = _dtype_name(src.dtype)
        ev.src_device = _device_str(src.device)
        ev.dst_device = _device_str(first.device)
        ev.transfer = _transfer(ev.src_device, ev.dst_device)
        self._context(ev)
        self._append(ev)

    def from_numpy(self: Recorder, out: torch.Tensor, start: int, end: int) -> None:
        """Record ``torch.from_numpy(array)``: a tensor over the array's memory (an alias)."""
        ev = CopyEvent(op="from_numpy", aten=(), alias=True)
        ev.seq = len(self.events) + self.dropped
        ev.start_ns = start
        ev.end_ns = end
        ev.shape = _shape(out)
        ev.dtype = ev.src_dtype = _dtype_name(out.dtype)
        ev.src_device = ev.dst_device = "cpu"
        ev.bytes_logical = _nbytes(out)
        self._context(ev)
        self._append(ev)


#: torch/storage.py's storage-level copies: a ``copy_`` into a storage they just allocated,
#: the storage's whole bytes (``clone``), or moved into a new shared segment that the source
#: storage then owns (``_share_fd_cpu_`` / ``_share_filename_cpu_``, by the sharing strategy)
_STORAGE_COPIES = {
    "_StorageBase.clone": False,
    "UntypedStorage._share_fd_cpu_": True,
    "UntypedStorage._share_filename_cpu_": True,
}


def _storage_level(ev: CopyEvent, move: bool) -> None:
    """A storage-level copy (see :data:`_STORAGE_COPIES`): its bytes are a new allocation of
    the whole storage; a move keeps the source storage (``dst_storage`` is its id)."""
    ev.bytes_allocated = ev.bytes_logical  # the copy_ over the whole new storage
    if move:
        ev.storage_move = True
        ev.dst_storage = ev.src_storage


_modules_loaded = sys.modules
_CHECKPOINT = "torch.utils.checkpoint"
#: events searched back for a recomputed line's forward event
_LOOK_BACK = 100_000
#: (file, line, aten op) of a recomputed copy -> (op, via) of that line's forward event
_FORWARD_OPS: dict[tuple, tuple] = {}
_MARKS: dict[Any, bool] = {}


def _recompute_marks() -> dict[Any, bool]:
    """Code objects that decide, walking out from a backward copy, whether it is a
    recomputation (torch 2.13's and 2.14's ``torch/utils/checkpoint.py``): True for the non-reentrant
    checkpoint's ``recompute_fn`` (run by its saved-tensor unpack hook) and the reentrant
    ``CheckpointFunction.backward``; False for ``_engine_run_backward`` (a backward pass,
    such as the reentrant checkpoint's inner one, runs autograd's nodes, not the user's code)."""
    if not _MARKS:
        from torch.autograd import graph
        from torch.utils import checkpoint

        # recompute_fn is a closure of the non-reentrant generator (its ``_impl`` on torch
        # 2.14): found among the nested code objects of every function of the module
        codes = [getattr(fn, "__code__", None) for fn in vars(checkpoint).values()]
        for _ in range(4):  # nesting depth
            nested = []
            for code in codes:
                for const in getattr(code, "co_consts", ()):
                    if hasattr(const, "co_consts"):
                        if const.co_name == "recompute_fn":
                            _MARKS[const] = True
                        nested.append(const)
            codes = nested
        _MARKS[checkpoint.CheckpointFunction.backward.__code__] = True
        _MARKS[graph._engine_run_backward.__code__] = False
    return _MARKS


def _recompute_frame(frame: Any) -> Any:
    """The checkpoint's recompute frame above ``frame`` (see :func:`_recompute_marks`), or
    None when the copy is not a recomputation."""
    marks = _recompute_marks()
    for _ in range(512):
        if frame is None:
            return None
        mark = marks.get(frame.f_code)
        if mark is not None:
            return frame if mark else None
        frame = frame.f_back
    return None


def _made_node(tensors: list) -> bool:
    """Whether autograd recorded the op on ``tensors`` (grad mode on, an input needs grad)."""
    if not torch.is_grad_enabled():
        return False
    for t in tensors:
        if t.requires_grad:
            return True
    return False


def _mark_context(recorder: Recorder, ev: CopyEvent, name: str) -> None:
    """Mark what the context says of implicit copy ``ev`` (aten op ``name``): an autocast cast
    with the weight cache off, or a copy re-run by activation checkpointing."""
    if name == "aten::_to_copy" and ev.dtype in _LOWER and ev.phase == "forward" and (
        not _cache_enabled()
    ):
        # autocast's cast of an argument to its lower precision, with its weight cache off
        # (torch.autocast(..., cache_enabled=False) clears this thread-local flag for the
        # region; autocast's own key is excluded while its cast runs, so
        # is_autocast_enabled() reads False here)
        ev.autocast_nocache = True
    if ev.phase == "backward" and _CHECKPOINT in _modules_loaded:
        recorder._recomputed(ev)
