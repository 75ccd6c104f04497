"""In-place writes through a result that aliases its input where a copy was likely meant.

Some calls copy on one run and alias on another: ``.to()``, ``.cpu()``, ``.float()``,
``.type()``, ``.contiguous()`` return their input itself when there is nothing to convert
(torch's docs for ``Tensor.to``: "If ... already has the correct dtype and device, then self
is returned"); ``reshape()`` returns a view when the input's strides allow one, else a copy
(``Tensor.reshape``'s docs: "you should not depend on the copying vs. viewing behavior");
``copy.copy(t)`` rebuilds a new tensor on the *same* storage (``Tensor`` has no ``__copy__``;
``__reduce_ex__`` rebuilds it with ``set_``). An in-place write through such a result changes
the input too (``alias-write``).

Which alias events are watched (:meth:`SurpriseAliases._watch_surprise`): an API call of one
of :data:`~copytrace.tracer._rules.RULES` ``alias_watched`` ops, made by the user (no
``via``), outside ``optimizer.step()``, whose result is an alias (a no-op conversion, a
reshape view, a ``copy.copy``), of an input that does not require grad (a write into a tensor
that requires grad is checked by autograd's version counter: loud, not silent). At most
:data:`_PER_SITE` results per call site are watched, each until its step ends or it dies:
a hot loop pays for its first steps only.

How a write is seen: at levels ``full`` and ``api`` the C handler calls
:meth:`AliasWrites.before_api` for every torch call while something is watched, which hands
the written tensor to :meth:`SurpriseAliases.surprise_write`; the Python fallback's dispatch
mode the same through ``before_op``; at level ``lean`` (no mode) the C++ write watch
(``_native/watch_cb.cpp``) reports a write into a watched version counter. The written tensor
is named by its root (``t._base`` or ``t``): a result, its input and their views share it
where they share a version counter, so a write through any of them counts.

A write counts when the input is still held by the program: a no-op conversion's result is
its input (any write changes what every holder of it sees); for a view or a ``copy.copy`` the
input must still be referenced from Python, found by a search of the heap for its identity at
the first write only (torch keeps a tensor's Python object alive while a view's ``_base``
holds its TensorImpl, ``torch/csrc/autograd/python_variable.cpp``, ``THPVariable_clear``: so a
base that only views keep has one reference more than the program's, and is not held). The
event then gets ``write_site``.
"""

from __future__ import annotations

import dis
import gc
import sys
from types import CodeType
from typing import TYPE_CHECKING, Any

import torch

from copytrace.tracer._callsite import user_frame, user_frame_object
from copytrace.tracer._fresh import WATCH_ALIAS
from copytrace.tracer._rules import RULES
from copytrace.tracer._storage_ref import storage_ref

if TYPE_CHECKING:
    from copytrace.schema import CopyEvent
    from copytrace.tracer._fresh import Fresh
    from copytrace.tracer.watch import WatchHost

__all__ = ["SurpriseAliases"]

_Tensor = torch.Tensor
_NoTorchFunction = torch._C.DisableTorchFunction
_OPS = RULES.alias_watched
#: results watched per call site (a site whose write was found is watched no more)
_PER_SITE = 2
#: results watched at once (a program making many is watched for its first ones)
_MAX_LIVE = 16


def _root(t: Any) -> tuple[int, int]:
    """``(id, TensorImpl address)`` of ``t``'s root: its ``_base``, or ``t`` itself."""
    with _NoTorchFunction():
        base = t._base
        root = t if base is None else base
        return id(root), root._cdata


def _held(ident: tuple[int, int], views: bool) -> bool:
    """Whether the tensor ``ident`` names is referenced from Python, besides the one
    reference torch keeps while views hold its TensorImpl (``views``: it is the ``_base`` of
    a live view). A search of the heap (``gc.get_objects``): for the first write only."""
    with _NoTorchFunction():
        for obj in gc.get_objects():
            if id(obj) == ident[0] and isinstance(obj, _Tensor) and obj._cdata == ident[1]:
                # references but this loop's: the heap list, the loop variable, the argument
                return sys.getrefcount(obj) - 3 - (1 if views else 0) > 0
    return False


_STORES = frozenset(("STORE_FAST", "STORE_NAME", "STORE_GLOBAL", "STORE_DEREF", "STORE_ATTR",
                     "STORE_SUBSCR"))  # fmt: skip
_NAME_LOADS = frozenset(("LOAD_FAST", "LOAD_NAME", "LOAD_GLOBAL", "LOAD_DEREF"))
_TARGET_LOADS = _NAME_LOADS | {"LOAD_CONST", "LOAD_ATTR"}
_INSTRUCTIONS: dict[CodeType, list[dis.Instruction]] = {}


def _instructions(code: CodeType) -> list[dis.Instruction]:
    found = _INSTRUCTIONS.get(code)
    if found is None:
        if len(_INSTRUCTIONS) > 4096:
            _INSTRUCTIONS.clear()
        found = _INSTRUCTIONS[code] = list(dis.get_instructions(code))
    return found


def _dotted(loads: list[dis.Instruction]) -> str | None:
    """``self.buf`` for the loads ``LOAD_FAST self, LOAD_ATTR buf``; None for anything else (a
    call's result, a subscript, a constant)."""
    if not loads or loads[0].opname not in _NAME_LOADS:
        return None
    if any(ins.opname != "LOAD_ATTR" for ins in loads[1:]):
        return None
    return ".".join(str(ins.argval) for ins in loads)


def _receiver(ins: list[dis.Instruction], at: int, method: str) -> str | None:
    """The name (``t``, ``self.buf``) whose method ``method`` the call at ``ins[at]`` calls;
    None when the receiver is a temporary (``f(x).to(d)``)."""
    i = at - 1
    while i >= 0 and not (ins[i].opname in ("LOAD_METHOD", "LOAD_ATTR")
                          and ins[i].argval == method):  # fmt: skip
        i -= 1
    j = i - 1
    while j >= 0 and ins[j].opname == "LOAD_ATTR":
        j -= 1
    return _dotted(ins[j:i]) if j >= 0 else None


def _target(ins: list[dis.Instruction], start: int, store: int) -> str | None:
    """What ``ins[store]`` stores to (``y``, ``self.buf``; None: a subscript), the target's
    loads being ``ins[start:store]``."""
    op = ins[store].opname
    if op == "STORE_SUBSCR":
        return None
    if op != "STORE_ATTR":
        return str(ins[store].argval)
    loads = [i for i in ins[start:store] if i.opname in _TARGET_LOADS]
    base = _dotted(loads[-1:] if loads and loads[-1].opname in _NAME_LOADS else loads)
    return None if base is None else f"{base}.{ins[store].argval}"


def _store_after(ins: list[dis.Instruction], at: int) -> tuple[bool, str | None]:
    """How the result of the call ``ins[at]`` is kept: ``(kept, target)``. Kept: stored at once
    (``y = t.to(d)``, ``self.buf = t.cpu()``, ``d[k] = t.cpu()``), or first written in place
    in the same expression (``y = t.to(d).div_(255)``; target: the store that follows on the
    line, if any); not kept: handed to another call, returned, chained into another conversion
    (whose own result is the one looked at). ``target``: see :func:`_target`."""
    after = ins[at + 1] if at + 1 < len(ins) else None
    if after is None:
        return False, None
    if after.opname in _STORES:
        return True, _target(ins, at + 1, at + 1)
    name = after.argval
    inplace = (after.opname in ("LOAD_METHOD", "LOAD_ATTR") and isinstance(name, str)
               and name.endswith("_") and not name.startswith("_"))  # fmt: skip
    if not inplace:  # `obj.attr = t.cpu()`, `d[k] = t.cpu()`: the target's loads, the store
        for k in range(at + 1, min(at + 5, len(ins))):
            if ins[k].opname in ("STORE_ATTR", "STORE_SUBSCR"):
                return True, _target(ins, at + 1, k)
            if ins[k].opname not in _TARGET_LOADS:
                break
        return False, None
    line = after.positions.lineno if after.positions else None
    for k in range(at + 2, len(ins)):
        if ins[k].positions and ins[k].positions.lineno not in (None, line):
            break
        if ins[k].opname in _STORES:
            back = k - 1
            while back > at and ins[back].opname in _TARGET_LOADS:
                back -= 1
            return True, _target(ins, back + 1, k)
    return True, None


def _kept_apart(method: str) -> bool:
    """Whether the user's call ``t.<method>(...)`` that returned ``t`` itself (a no-op
    conversion) keeps the result apart from the name of its input: ``staging = t.to(d)``,
    ``self.buf = t.cpu()``, ``out = t.to(d).div_(255)`` yes; ``x = x.to(d)`` (a rebinding:
    nothing else holds the input by that name), ``f(x).to(d)`` (a temporary), ``f(t.to(d))``
    no. Read from the names in the user's code around the call (``f_lasti``), never from its
    values (reading ``f_locals`` would keep them alive)."""
    frame = user_frame_object(sys._getframe(2))
    if frame is None:
        return False
    ins = _instructions(frame.f_code)
    lasti = frame.f_lasti
    at = next((i for i, x in enumerate(ins) if x.offset >= lasti), None)
    if at is None:
        return False
    kept, target = _store_after(ins, at)
    if not kept:
        return False
    receiver = _receiver(ins, at, method)
    return receiver is not None and receiver != target


class _Surprise:
    """A watched alias result: ``root`` (the key its writes are found by), the input's
    identity ``src``, whether the result is the input itself (``same``) or a view whose base
    is the input (``views``), the event, its call site, and how it is followed: the C++
    observer's handle on its version counter (``version``), or on the Python fallback torch's
    weak handle on its storage (``ref``); ``counter``: its key in level lean's write watch."""

    __slots__ = ("root", "src", "same", "views", "ev", "site", "version", "ref", "counter")


class SurpriseAliases:
    """The ``alias-write`` watches of :class:`~copytrace.tracer.watch.Watch` (a mixin: the
    state is set up by :meth:`_init_surprise`)."""

    host: WatchHost
    copies: Fresh
    aliases: dict
    alias_counters: dict
    _watch_writes: Any  # AliasWrites'

    def _init_surprise(self) -> None:
        #: root identity -> the watched results with that root
        self.surprise: dict[tuple[int, int], list[_Surprise]] = {}
        #: level lean: C++ write-watch key -> the watched results on that counter
        self.surprise_counters: dict[int, list[_Surprise]] = {}
        #: (file, line) -> results watched there so far (``_PER_SITE``: no more)
        self.surprise_sites: dict[tuple[Any, Any], int] = {}

    def _watch_surprise(self, ev: CopyEvent, op: str, src: Any, out: Any) -> None:
        """Watch the alias result ``out`` of ``src`` (event ``ev``) for an in-place write,
        when its op, input and call site call for it (see the module docstring)."""
        if (
            op not in _OPS
            or ev.via is not None
            or ev.src_requires_grad
            or ev.phase == "optimizer"
            or ev.file is None
            or not isinstance(out, _Tensor)
            or (op != "copy" and op != "reshape" and out is not src)
        ):
            return
        key = (ev.file, ev.line)
        sites = self.surprise_sites
        seen = sites.get(key, 0)
        if seen >= _PER_SITE or sum(map(len, self.surprise.values())) >= _MAX_LIVE:
            return
        copies = self.copies
        version_of = copies.version_of
        entry = _Surprise()
        entry.version = version_of(out) if version_of is not None else None
        entry.ref = None
        if entry.version is None:
            if version_of is not None:  # an inference tensor: no counter, no write is seen
                return
            entry.ref = storage_ref(out)
            if entry.ref is None:
                return
        sites[key] = seen + 1
        if out is src and not _kept_apart(op):
            return
        entry.root = root = _root(out)
        with _NoTorchFunction():
            entry.src = (id(src), src._cdata)
            entry.same = out is src
            entry.views = not entry.same and out._base is src
        entry.ev = ev
        entry.site = key
        entry.counter = None
        self.surprise.setdefault(root, []).append(entry)
        lean = copies.lean
        if lean is not None and entry.version is not None:  # level lean: the C++ write watch
            counter = lean[0](out, WATCH_ALIAS)
            if counter is not None:
                entry.counter = counter
                self.surprise_counters.setdefault(counter, []).append(entry)
        self._watch_writes(True)

    def surprise_write(self, t: Any, frame: Any) -> None:
        """An in-place write into tensor ``t`` (full, api, the fallback) made below ``frame``."""
        entries = self.surprise.get(_root(t))
        if entries:
            self._surprise_hits(list(entries), frame)

    def surprise_counter_write(self, key: int, frame: Any) -> None:
        """Level lean: a write into the watched version counter ``key``."""
        entries = self.surprise_counters.get(key)
        if entries:
            self._surprise_hits(list(entries), frame)

    def _surprise_hits(self, entries: list[_Surprise], frame: Any) -> None:
        site = None
        for entry in entries:
            if not self._surprise_alive(entry):
                self._drop_surprise(entry)
                continue
            if entry.same or _held(entry.src, entry.views):
                if site is None:
                    found = user_frame(frame)
                    site = f"{found[0]}:{found[1]} {found[2]}" if found else "?"
                ev = entry.ev
                if ev.write_site is None:
                    ev.write_site = site
                    ev.inplace_writes = 1
                self.surprise_sites[entry.site] = _PER_SITE  # found: the site is watched no more
            self._drop_surprise(entry)  # written: its first write decided

    def _surprise_alive(self, entry: _Surprise) -> bool:
        if entry.ref is not None:
            return not entry.ref.expired()
        return self.copies.version_final(entry.version) is None

    def _drop_surprise(self, entry: _Surprise) -> None:
        listed = self.surprise.get(entry.root)
        if listed is not None and entry in listed:
            listed.remove(entry)
            if not listed:
                del self.surprise[entry.root]
        counter = entry.counter
        if counter is not None:
            on = self.surprise_counters.get(counter)
            if on is not None and entry in on:
                on.remove(entry)
                if not on:
                    del self.surprise_counters[counter]
                    lean = self.copies.lean
                    if lean is not None and counter not in self.alias_counters:
                        lean[1](counter, WATCH_ALIAS)
        if not self.surprise and not self.aliases:
            self._watch_writes(False)

    def end_surprise(self) -> None:
        """A step boundary (or the stop): each result is watched within its own step."""
        for entries in list(self.surprise.values()):
            for entry in list(entries):
                self._drop_surprise(entry)
