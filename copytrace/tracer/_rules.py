"""The API-event rules as data: which calls are recorded, which ops copy, and how an API
call's result is classed (alias, copy, write into an existing tensor).

Two readers apply these tables: :meth:`copytrace.tracer._recorder.Recorder._record_api` (the
Python path, with :class:`~copytrace.tracer.watch.Watch`) and the C++ observer's ``record``
and ``fast_finish`` (``_native``). The observer receives :data:`RULES` at set-up
(``set_record_rules``) instead of keeping its own copies, so the decision is written once, here. The op partitions below
(:data:`BEFORE_OPS`, :data:`NOT_C_EVENT_OPS`) reach the observer the same way, as sets built
by :func:`copytrace.tracer._observer.engage`.

Sources (torch 2.13): the aten op names from ``torch._C._dispatch_get_all_op_names()``; the
view/copy split of ``Tensor.__getitem__`` from ``torch/csrc/autograd/python_variable_indexing.cpp``
(basic indexing returns a view, advanced indexing gathers into fresh storage).
"""

from __future__ import annotations

import sys
from typing import Any, NamedTuple

import torch

from copytrace.tracer import _facts as _F
from copytrace.tracer._fresh import INDEX_OPS
from copytrace.tracer._storage_ref import storage_of

__all__ = [
    "RULES", "RecordRules", "HOST_TO_DEVICE", "ALIAS", "COPY", "COPY_INTO", "api_table",
    "aten_table", "aten_name", "transfer", "basic_index", "LEGACY_CTOR",
]  # fmt: skip

_Tensor = torch.Tensor

# --- API-level table: function-mode callable -> op name ----------------------------------
_GETITEM = _Tensor.__getitem__
_BASIC_INDEX = frozenset((int, bool, slice, type(None), type(Ellipsis)))


def _basic_index(args: tuple) -> bool:
    """Whether ``Tensor.__getitem__(*args)`` is basic indexing (ints, slices, None, ...),
    which returns a view: the cheap test on the path every ``x[i]`` takes."""
    index = args[1] if len(args) > 1 else None
    kind = type(index)
    if kind in _BASIC_INDEX:
        return True
    if kind is tuple:
        for item in index:
            if type(item) not in _BASIC_INDEX:
                return False
        return True
    return False

_CONVERSIONS = (
    "to", "cpu", "cuda", "type", "float", "double", "half", "bfloat16", "int", "long",
    "short", "char", "byte", "bool", "contiguous",
)  # fmt: skip


def _api_table() -> dict[Any, str]:
    table: dict[Any, str] = {
        _Tensor.clone: "clone",
        torch.clone: "clone",
        _Tensor.detach: "detach",
        torch.detach: "detach",
        _Tensor.detach_: "detach_",
        _Tensor.data.__get__: "data_get",  # a method-wrapper; dict lookup uses == (see DESIGN)
        _Tensor.data.__set__: "data_set",
        _Tensor.__deepcopy__: "deepcopy",
        _Tensor.copy_: "copy_",
        torch.tensor: "tensor_ctor",
        # of a (nested) list of tensors a copy as torch.tensor's (tensor_new.cpp,
        # internal_new_from_data); of one tensor its alias or a conversion (api_before skips it)
        torch.as_tensor: "as_tensor",
        _Tensor.new_tensor: "new_tensor",
        _Tensor.numpy: "numpy",
        # moves the storage's bytes into a new shared segment the same storage then owns
        _Tensor.share_memory_: "share_memory_",
        # a copy into new page-locked host memory (aten::_pin_memory; needs an accelerator)
        _Tensor.pin_memory: "pin_memory",
        _Tensor.reshape: "reshape",  # a view when strides allow, else a hidden copy
        torch.reshape: "reshape",
        # Advanced indexing gathers into fresh storage (aten::index and its relatives).
        # Tensor.__getitem__ also sees every basic index: FunctionMode lets those through.
        _GETITEM: "index",
    }
    for name in INDEX_OPS[1:]:
        for owner in (torch, _Tensor):
            fn = getattr(owner, name, None)
            if fn is not None:
                table[fn] = name
    for name in _CONVERSIONS:
        fn = getattr(_Tensor, name, None)
        if fn is not None:
            table[fn] = name
    return table


# --- aten-level table: OpOverloadPacket -> kind -------------------------------------------
_ALIAS, _COPY, _COPY_INTO = 1, 2, 3


def _is_copy_op(base: str) -> bool:
    """aten op names that copy an input, from torch's own naming scheme: ``clone``,
    ``_to_copy``, ``copy_``, the ``*_copy`` out-of-place variants of every view op
    (``view_copy``, ``t_copy``, ... used by functionalization), ``_foreach_copy_``,
    ``lift_fresh_copy``, ``_copy_from*``."""
    if base == "clone" or base.startswith("_copy_from"):
        return True
    if base in ("_has_compatible_shallow_copy_type",) or base.startswith("copysign"):
        return False
    return base.rstrip("_").endswith("copy")


def _aten_table() -> dict[Any, int]:
    """OpOverload -> kind for every overload of the aten alias and copy ops.

    The copy ops are found by name among all registered operators
    (``torch._C._dispatch_get_all_op_names()``), so new ``*_copy`` ops are covered without a
    hand-kept list. In-place (``copy_``, ``index_copy_``) and ``out=`` overloads write into an
    existing tensor: kind ``_COPY_INTO`` (0 bytes allocated).
    """
    aten = torch.ops.aten
    kinds: dict[str, int] = {"detach": _ALIAS, "alias": _ALIAS}
    try:
        names = torch._C._dispatch_get_all_op_names()
    except Exception:  # pragma: no cover - very old torch
        names = ["aten::clone", "aten::_to_copy", "aten::copy_", "aten::lift_fresh_copy"]
    for full in names:
        ns, _, rest = full.partition("::")
        base = rest.partition(".")[0]
        if ns == "aten" and _is_copy_op(base):
            kinds[base] = _COPY
    table: dict[Any, int] = {}
    for name, kind in kinds.items():
        try:
            packet = getattr(aten, name)
            overloads = packet.overloads()
        except Exception:
            continue
        for overload in overloads:
            try:
                op = getattr(packet, overload)
            except Exception:
                continue
            if kind == _COPY and (
                name.endswith("_") or "out" in overload or name.startswith("_copy_from")
            ):
                table[op] = _COPY_INTO
            else:
                table[op] = kind
    return table


_ATEN_NAMES: dict[Any, str] = {}


def _aten_name(op: Any) -> str:
    name = _ATEN_NAMES.get(op)
    if name is None:
        # OpOverload 'aten.clone.default' -> 'aten::clone' (overload kept when not default)
        ns, _, rest = str(op).partition(".")
        base, _, overload = rest.partition(".")
        name = f"{ns}::{base}" if overload in ("", "default") else f"{ns}::{base}.{overload}"
        _ATEN_NAMES[op] = sys.intern(name)
    return name


def _storage_nbytes(t: torch.Tensor) -> int:
    """Bytes of ``t``'s storage (its logical bytes where it has none), read without a Python
    storage object on the C++ observer (:mod:`copytrace.tracer._storage_ref`)."""
    found = storage_of(t)
    if found is None or found[1] is None:
        return _F.nbytes(t)
    return found[1]


class RecordRules(NamedTuple):
    """How an API call's result is classed; the one instance is :data:`RULES`.

    A tuple, so that the C++ observer reads it by index, in this order:

    * ``always_alias``: ops whose result shares the input's storage, decided without looking
      at storages (which wrapper subclasses and sparse tensors do not expose).
    * ``writes_into``: ops that write into their first argument (``dst.copy_(src)``): never an
      alias, 0 bytes allocated.
    * ``view_is_no_event``: ops whose alias result is no event (``x[0]``: a zero-dim integer
      index selects a view).
    * ``host_device``: the device name of host memory.
    * ``transfers``: ``(source on host, result on host) -> transfer`` for two *different*
      device names (equal names: ``"none"``). The source's pinning is read for the
      ``(True, False)`` transfer (host to device).
    * ``watched``: ops whose event starts a watch of its own (``Watch._special``: ``.data``
      reads and writes; a ``detach`` only when made by ``state_dict()``, i.e. with a ``via``).
    * ``not_fresh``: ops whose result is not a fresh copy the program goes on using (``copy_``
      writes into its dst, deepcopy results are independent state, implicit copies are
      internal to torch): no in-place write watch (``_fresh.py``).
    * ``no_memory_devices``: device names whose tensors have no real storage (``meta``): a
      copy to or from one allocates nothing and moves nothing (transfer ``"none"``).
    * ``alias_watched``: ops whose alias result may be watched for an in-place write (a call
      that copies on another device, dtype or layout but returned its input or a view of it:
      ``alias-write``, :mod:`copytrace.tracer.watch._surprise`): their alias events take the
      Python tail, which decides by call site.
    """

    always_alias: frozenset[str]
    writes_into: frozenset[str]
    view_is_no_event: frozenset[str]
    host_device: str
    transfers: dict[tuple[bool, bool], str]
    watched: frozenset[str]
    not_fresh: frozenset[str]
    no_memory_devices: frozenset[str]
    alias_watched: frozenset[str]


RULES = RecordRules(
    always_alias=frozenset(("detach", "detach_", "data_get", "numpy", "copy", "swap_tensors")),
    writes_into=frozenset(("copy_",)),
    view_is_no_event=frozenset(("index",)),
    host_device="cpu",
    transfers={(True, False): "h2d", (False, True): "d2h", (True, True): "none", (False, False): "d2d"},
    watched=frozenset(("data_get", "data_set", "detach")),
    not_fresh=frozenset(("copy_", "deepcopy", "implicit", "data_set", "swap_tensors")),
    no_memory_devices=frozenset(("meta",)),
    alias_watched=frozenset((*_CONVERSIONS, "reshape", "copy")),
)
_HOST = RULES.host_device
_TRANSFERS = RULES.transfers
_NO_MEMORY = RULES.no_memory_devices
#: The transfer whose source's pinning is read (host to device).
HOST_TO_DEVICE = _TRANSFERS[(True, False)]


def _transfer(src: str, dst: str) -> str:
    """The transfer direction between device names ``src`` and ``dst`` (:data:`RULES`): none
    where either has no real storage (``meta``: nothing moves)."""
    if src == dst or src in _NO_MEMORY or dst in _NO_MEMORY:
        return "none"
    return _TRANSFERS[(src == _HOST, dst == _HOST)]


def settle_unreal(ev: Any) -> None:
    """Correct an event one of whose tensors has no real storage (a ``meta`` device or a
    FakeTensor), as the C observer's ``record`` does not: transfer ``"none"``, 0 bytes
    allocated, and ``fake`` when the result (the destination) has none. Called only for the
    rare events that involve such a tensor (``ev.fake``, or a ``meta`` device name)."""
    src, dst = ev.src_device, ev.dst_device
    if ev.fake or src in _NO_MEMORY or dst in _NO_MEMORY:
        ev.transfer = "none"
        ev.pinned = False
        if (ev.fake or dst in _NO_MEMORY) and not ev.alias:
            ev.fake = True  # a copy of no real memory (as record.cpp marks a meta result)
            ev.bytes_allocated = 0


def settle_unreal_events(events: list) -> None:
    """:func:`settle_unreal` over a buffer: the C observer finishes some events (a fast
    ``.to("meta")``) without the Python tail. One attribute test per event, at a flush."""
    for ev in events:
        if ev.fake and ev.transfer != "none":
            settle_unreal(ev)


# Ops whose result always shares the input's storage (RULES.always_alias).
_ALWAYS_ALIAS = RULES.always_alias
# Ops whose event the Python path records (record.cpp's record leaves them out).
_IN_PYTHON = frozenset(("numpy", "deepcopy", "share_memory_"))
#: Ops that return their input after moving its storage's bytes into a new allocation the same
#: storage then owns (``share_memory_``: ``torch/storage.py``, ``_share_fd_cpu_``); a move
#: shows as the ``aten::copy_`` folded into the call (none when already shared).
STORAGE_MOVES = frozenset(("share_memory_",))
#: The op of a legacy constructor of a (nested) list holding a tensor: ``torch.Tensor([a, b])``
#: and the typed ones (``torch.FloatTensor([a, b])``...), whose calls reach no function mode
#: (``tp_new`` of ``TensorBase`` and of torch's legacy type objects: ``_legacy.py``). Recorded
#: as ``new_tensor`` is, its data the second argument: ``(cls, data)``.
LEGACY_CTOR = "legacy_ctor"
# Ops whose api_before has work to do for any call (a check before the call, a read of the
# input's state, a memo or basic-index test): never on the C observer's one-call path.
_BEFORE_OPS = frozenset(
    ("backward", "deepcopy", "index", "detach_", "numpy", "as_tensor", LEGACY_CTOR)
)
# Fast ops whose whole event the observer may finish in C (api_mode.cpp's fast_event): not
# those _record_api reads differently (a write into a tensor, a rebinding) nor the gathers (a fresh copy watched
# by identity, _fresh.py), nor new_tensor, whose source is its data argument, not its first
# (the C path reads args[0]: `u.new_tensor(t)` would name u, the owner, as what was copied).
_NOT_C_EVENT_OPS = frozenset(
    ("copy_", "data_set", "data_get", "swap_tensors", "new_tensor", LEGACY_CTOR, *STORAGE_MOVES)
) | frozenset(INDEX_OPS)

# public names for the modules that read the rules
ALIAS, COPY, COPY_INTO = _ALIAS, _COPY, _COPY_INTO
IN_PYTHON, BEFORE_OPS, NOT_C_EVENT_OPS = _IN_PYTHON, _BEFORE_OPS, _NOT_C_EVENT_OPS
api_table, aten_table, aten_name, basic_index = _api_table, _aten_table, _aten_name, _basic_index
transfer = _transfer
NO_MEMORY = _NO_MEMORY
