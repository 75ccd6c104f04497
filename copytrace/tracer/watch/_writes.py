"""``.data`` aliases and rebindings, and the backward passes that may read what they changed.

* A ``.data`` read of a tensor that requires grad is an alias with its own version counter:
  autograd cannot see an in-place write through it. While one is alive
  (:attr:`AliasWrites.aliases` non-empty) each in-place write into it is noted as a *pending
  write*: the dispatch mode calls :meth:`AliasWrites.before_op`, the C handler
  :meth:`AliasWrites.before_api`.
* A ``.data =`` rebinding is noted as a pending rebinding.
* At ``Tensor.backward``, ``torch.autograd.backward`` or ``torch.autograd.grad``
  (:meth:`AliasWrites.check_backward`), while one is pending, the graph about to run is walked
  before it runs: a node created before the write (smaller sequence number) whose saved tensor
  lives in the written storage computes a silently wrong gradient. The finding is written on
  the alias's event (``saved_by``, ``write_site``, ``src_name``: late facts, see
  :data:`copytrace.tracer.watch.LATE_FIELDS`).

The C++ observer reads ``writes``, ``rebinds`` and ``_backward_seq`` of the watch by name.
"""

from __future__ import annotations

import sys
import weakref
from typing import TYPE_CHECKING, Any

import torch

from copytrace.tracer._callsite import user_frame
from copytrace.tracer.watch._graph import _backward_roots, _saved_tensors, _unpacked, _walk

if TYPE_CHECKING:
    from copytrace.schema import CopyEvent
    from copytrace.tracer.watch import WatchHost

__all__ = ["AliasWrites"]

_Tensor = torch.Tensor
_seq_nr = torch._C._autograd._get_sequence_nr


def _site(frame: Any) -> str | None:
    found = user_frame(frame)
    if found is None:
        return None
    return f"{found[0]}:{found[1]} {found[2]}"


class _Alias:
    """A live ``.data`` alias of a tensor that requires grad."""

    __slots__ = ("ref", "src", "ev")

    def __init__(self, ref: weakref.ref, src: weakref.ref, ev: CopyEvent) -> None:
        self.ref = ref
        self.src = src
        self.ev = ev


class _Pending:
    """An in-place write through a ``.data`` alias, or a ``.data =`` rebinding, not yet
    checked against a backward pass."""

    __slots__ = ("ref", "marker", "site", "alias")

    def __init__(self, ref: weakref.ref, marker: int, site: str | None, alias: _Alias) -> None:
        self.ref = ref  # the written storage (write) or the rebound tensor (rebind)
        self.marker = marker  # autograd sequence number at the write: older nodes are < it
        self.site = site
        self.alias = alias


def _written_args(func: Any) -> tuple[tuple[int, str], ...]:
    try:
        arguments = func._schema.arguments
    except AttributeError:
        return ()
    return tuple(
        (i, a.name)
        for i, a in enumerate(arguments)
        if a.alias_info is not None and a.alias_info.is_write
    )


def _written_api(func: Any) -> bool:
    """Whether torch API callable ``func`` writes into its first argument (PyTorch's naming:
    a trailing underscore is in place; ``__setitem__`` and the ``__i*__`` operators too)."""
    name = getattr(func, "__name__", "") or ""
    if name.startswith("__"):
        return name in _INPLACE_DUNDERS
    return name.endswith("_")


_INPLACE_DUNDERS = frozenset(
    "__setitem__ __iadd__ __isub__ __imul__ __itruediv__ __ifloordiv__ __imod__ __ipow__ "
    "__imatmul__ __iand__ __ior__ __ixor__ __ilshift__ __irshift__".split()
)


class AliasWrites:
    """The ``.data`` watches of :class:`~copytrace.tracer.watch.Watch` (a mixin: the state is
    the watch's, set up in its ``__init__``)."""

    host: WatchHost
    aliases: dict[int, _Alias]
    writes: dict[int, _Pending]
    rebinds: dict[int, _Pending]
    _written: dict[Any, Any]
    _backward_seq: int

    def _watch_alias(self, alias: torch.Tensor, src: torch.Tensor, ev: CopyEvent) -> None:
        key = id(alias)
        aliases = self.aliases

        def gone(ref: weakref.ref, key: int = key) -> None:
            entry = aliases.get(key)
            if entry is not None and entry.ref is ref:
                del aliases[key]
                if not aliases:
                    self._watch_writes(False)

        ev.inplace_writes = 0
        aliases[key] = _Alias(weakref.ref(alias, gone), weakref.ref(src), ev)
        self._watch_writes(True)
    def _watch_writes(self, on: bool) -> None:
        """Have every torch call checked for a write (only while a ``.data`` alias of a tensor
        that requires grad is alive): the recorder tells its C handler and level lean's mode."""
        try:
            self.host.watch_writes(on)
        except Exception as err:  # interpreter shutdown
            self.host.note_error(err)


    def _watch_rebind(self, dst: torch.Tensor, ev: CopyEvent) -> None:
        site = f"{ev.file}:{ev.line} {ev.function}" if ev.file else None
        entry = _Alias(weakref.ref(dst), weakref.ref(dst), ev)
        self.rebinds[id(dst)] = _Pending(entry.ref, _seq_nr(), site, entry)

    # -- dispatch mode, only while a `.data` alias is alive --------------------------------
    def before_op(self, func: Any, args: tuple, kwargs: dict) -> None:
        """Note an in-place write through a watched ``.data`` alias. Never raises."""
        try:
            written = self._written.get(func)
            if written is None:
                written = self._written[func] = _written_args(func)
            if not written:
                return
            aliases = self.aliases
            for index, name in written:
                value = args[index] if index < len(args) else kwargs.get(name)
                targets = value if isinstance(value, (list, tuple)) else (value,)
                for t in targets:
                    if not isinstance(t, _Tensor):
                        continue
                    base = t._base
                    root = t if base is None else base
                    entry = aliases.get(id(root))
                    if entry is not None and entry.ref() is root:
                        self._note_write(entry, root)
        except Exception as err:
            self.host.note_error(err)

    def before_api(self, func: Any, args: tuple, kwargs: dict | None) -> None:
        """The API-level form of :meth:`before_op` (the C++ observer's path): a torch call
        that writes in place (``add_``, ``zero_``, ``__setitem__``, ``__iadd__``, ``out=``)
        into a watched ``.data`` alias. Never raises."""
        try:
            written = self._written.get(func)
            if written is None:
                written = self._written[func] = _written_api(func)
            aliases = self.aliases
            if not aliases:
                return
            targets: list[Any] = []
            if written and args:
                targets.append(args[0])
            if kwargs:
                out = kwargs.get("out")
                targets.extend(out if isinstance(out, (list, tuple)) else (out,))
            for t in targets:
                if not isinstance(t, _Tensor):
                    continue
                base = t._base
                root = t if base is None else base
                entry = aliases.get(id(root))
                if entry is not None and entry.ref() is root:
                    self._note_write(entry, root)
        except Exception as err:
            self.host.note_error(err)

    def _note_write(self, entry: _Alias, alias: torch.Tensor) -> None:
        ev = entry.ev
        ev.inplace_writes = (ev.inplace_writes or 0) + 1

        storage = alias.untyped_storage()
        site = _site(sys._getframe(2))
        self.writes[id(storage)] = _Pending(weakref.ref(storage), _seq_nr(), site, entry)

    # -- backward ---------------------------------------------------------------------------
    def backward(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """Run a backward entry point; first check the graph against pending writes."""
        self.check_backward(func, args, kwargs)
        return func(*args, **kwargs)

    def check_backward(self, func: Any, args: tuple, kwargs: dict) -> None:
        """Check the graph a backward entry point is about to run. Never raises."""
        try:
            self._note_backward(func, args, kwargs)
        except Exception as err:
            self.host.note_error(err)
        if self.writes or self.rebinds:
            try:
                self._check_backward(func, args, kwargs)
            except Exception as err:
                self.host.note_error(err)

    def _note_backward(self, func: Any, args: tuple, kwargs: dict) -> None:
        for root in _backward_roots(func, args, kwargs):
            seq = root._sequence_nr()
            if seq > self._backward_seq:
                self._backward_seq = seq

    def _check_backward(self, func: Any, args: tuple, kwargs: dict) -> None:
        roots = _backward_roots(func, args, kwargs)
        writes = {k: w for k, w in self.writes.items() if w.ref() is not None}
        rebinds: dict[int, tuple[torch.Tensor, _Pending]] = {}
        for pending in self.rebinds.values():
            t = pending.ref()
            if t is not None:
                rebinds[id(t.untyped_storage())] = (t, pending)
        markers = [p.marker for p in writes.values()] + [p[1].marker for p in rebinds.values()]
        if not markers:
            self.writes, self.rebinds = {}, {}
            return
        newest = max(markers)
        hits: set[int] = set()
        min_seq = None
        for node in _walk(roots):
            if type(node).__name__ == "AccumulateGrad":
                continue
            seq = node._sequence_nr()
            if min_seq is None or seq < min_seq:
                min_seq = seq
            if seq >= newest:
                continue
            for name, saved in _saved_tensors(node):
                storage = saved.untyped_storage()
                key = id(storage)
                write = writes.get(key)
                if write is not None and seq < write.marker and write.ref() is storage:
                    self._hazard(write, node, name)
                    hits.add(id(write))
                found = rebinds.get(key)
                if found is not None and seq < found[1].marker:
                    dst, pending = found
                    if _unpacked(node, name) is dst:
                        self._hazard(pending, node, name)
                        hits.add(id(pending))

        def keep(p: _Pending) -> bool:
            # Drop what was found, what died, and what only newer graphs could use.
            if id(p) in hits or p.ref() is None:
                return False
            return min_seq is not None and min_seq < p.marker

        self.writes = {k: p for k, p in self.writes.items() if keep(p)}
        self.rebinds = {k: p for k, p in self.rebinds.items() if keep(p)}

    def _hazard(self, pending: _Pending, node: Any, name: str) -> None:
        ev = pending.alias.ev
        label = f"{type(node).__name__}.{name}"
        if label not in ev.saved_by:
            ev.saved_by = (*ev.saved_by, label)
        if ev.write_site is None:
            ev.write_site = pending.site
        if ev.src_name is None:
            src = pending.alias.src()
            if src is not None:
                ev.src_name = self._name_of(src)


    def _name_of(self, t: torch.Tensor) -> str | None:
        """``Module.path.param`` of a parameter or buffer of a module (see
        :meth:`copytrace.tracer._modules.Modules.owner_name`)."""
        return self.host.owner_name(t)
