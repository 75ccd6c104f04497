"""copytrace names storages without Python storage objects, so a program's storages keep their
use counts, and autograd keeps adding gradients in place where it did untraced.

Once torch has made a Python storage object for a StorageImpl (``t.untyped_storage()``,
``THPStorage_Wrap``) it preserves that object for the storage's whole life, and the object holds
a strong reference (``c10/util/intrusive_ptr.h``, "PyObject preservation for Tensor and
Storages"): ``torch._C._storage_Use_Count`` reads one more. Autograd adds the gradients that reach
one input in place only while the first one's storage count is 1
(``torch/csrc/autograd/input_buffer.cpp``, ``can_accumulate_inplace``); otherwise out of place,
into a new tensor with version 0. So a storage object made by the tracer while it reads a
gradient's facts changes ``x.grad._version``. Here every form of storage read copytrace makes
while tracing is run untraced and traced, and what the program can read is compared: the
version counters of its gradients, and its storages' use counts (read through the storage's
address, ``storage_of``, without making the Python object the test is about). A deepcopy is
not among them: torch's own ``Tensor.__deepcopy__`` makes the storage objects of the tensor and
of its ``.grad`` (whose bytes copytrace adds), untraced too.
"""

from __future__ import annotations

import pytest
import torch

import copytrace
from copytrace.tracer import _native

NATIVE = _native.load()
needs_native = pytest.mark.skipif(NATIVE is None, reason="the C++ observer is not built here")
LEVELS = ["lean", "full"]  # the C++ observer's levels that record autograd's own copies


def _traced(fn, level: str):
    with copytrace.trace(write=False, level=level, observer="native") as t:
        out = fn()
    assert t.stats["errors"] == 0, t.first_error
    return out


# --- gradients added in place ---------------------------------------------------------------
def _transformer_grad_version() -> int:
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(4, 2, 8, dropout=0.0, batch_first=True)
    x = torch.randn(2, 3, 4, requires_grad=True)
    layer(x).backward(torch.ones(2, 3, 4))
    return x.grad._version


def _transpose_grad_version(keep: list | None = None) -> int:
    """``x`` reaches the loss twice: directly and through ``lin(x.transpose(0, 1))``. Autograd
    adds the two gradients in ``x``'s input buffer, in place (version 1) while it holds the
    first one alone; backward's ``reshape`` of the transposed gradient is a copy copytrace
    records. ``keep``: a hook keeps each gradient of ``y`` (the program's own reference)."""
    torch.manual_seed(0)
    lin, norm = torch.nn.Linear(4, 4), torch.nn.LayerNorm(4)
    x = torch.randn(3, 2, 4, requires_grad=True)
    y = lin(x.transpose(0, 1))
    if keep is not None:
        y.register_hook(lambda g: keep.append(g))
    norm(x + y.transpose(0, 1)).backward(torch.ones(3, 2, 4))
    return x.grad._version


@needs_native
@pytest.mark.parametrize("level", LEVELS)
def test_transformer_input_gradient_is_added_in_place_as_untraced(level):
    untraced = _transformer_grad_version()
    assert untraced >= 1  # torch adds x's gradients in place (1 on torch 2.13)
    assert _traced(_transformer_grad_version, level) == untraced


@needs_native
@pytest.mark.parametrize("level", LEVELS)
def test_transposed_linear_gradient_is_added_in_place_as_untraced(level):
    untraced = _transpose_grad_version()
    assert untraced == 1  # one in-place add_ into the first gradient
    assert _traced(_transpose_grad_version, level) == untraced


@needs_native
@pytest.mark.parametrize("level", LEVELS)
def test_gradient_the_program_keeps_is_added_out_of_place_traced_too(level):
    # near miss: the program's hook holds y's gradient, so torch itself adds out of place
    assert _transpose_grad_version([]) == 0
    assert _traced(lambda: _transpose_grad_version([]), level) == 0


# --- storage use counts after each kind of storage read --------------------------------------
def _uses(tensors) -> list[int]:
    """torch's strong count of each tensor's storage, read by address (no storage object)."""
    return [torch._C._storage_Use_Count(NATIVE.storage_of(t)[0]) for t in tensors]


def _copies():
    x = torch.randn(4, 3)
    return [x, x.clone(), x.to(torch.float64), x.t().contiguous(), x.reshape(-1)]


def _alias_write():
    w = torch.randn(3, requires_grad=True)
    alias = w.data
    alias.add_(1.0)  # a write autograd cannot see: watched (level lean: the C++ write watch)
    return [w, alias]


def _alias_write_then_backward():
    w = torch.randn(3, requires_grad=True)
    h = w * 2.0
    loss = (h * h).sum()  # saves h twice
    w.data.mul_(3.0)  # a pending write: the backward's graph is walked for saved tensors
    loss.backward()
    return [w, h, w.grad]


def _rebind():
    p = torch.nn.Parameter(torch.randn(3))
    p.data = torch.randn(3)  # a `.data =` rebinding, followed by its storage
    loss = (p * p).sum()
    loss.backward()
    return [p, p.grad]


def _state_dict_handover():
    src, dst = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    sd = src.state_dict()  # detached aliases: followed by their storages
    dst.load_state_dict(sd, assign=True)  # a handover: the storages now shared
    return [src.weight, dst.weight, sd["bias"]]


def _retained_graph():
    x = torch.randn(3, requires_grad=True)
    h = x.exp()  # ExpBackward0 saves its result
    y = h.clone()  # an attached copy: its graph's saved storages are read at the trace's end
    return [x, h, y]


def _inference_copy():
    with torch.inference_mode():
        a = torch.randn(3)
        b = a.clone()  # no version counter: followed by torch's weak handle on its storage
    return [a, b]


FORMS = {
    "copy facts": _copies,
    "alias write": _alias_write,
    "alias write then backward": _alias_write_then_backward,
    "rebind": _rebind,
    "state_dict handover": _state_dict_handover,
    "retained graph": _retained_graph,
    "inference copy": _inference_copy,
}


@needs_native
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("form", list(FORMS))
def test_storage_use_counts_read_as_untraced(form, level):
    program = FORMS[form]
    untraced = _uses(program())
    assert all(n >= 1 for n in untraced)
    tensors = _traced(program, level)
    assert _uses(tensors) == untraced


@needs_native
def test_storage_of_makes_no_storage_object_and_hold_is_counted_by_nothing():
    t = torch.randn(5)
    key, nbytes = NATIVE.storage_of(t)
    assert nbytes == 20  # 5 float32
    assert torch._C._storage_Use_Count(key) == 1  # t alone: no Python storage object made
    assert NATIVE.storage_hold(key) == key  # torch's weak handle, as _weak_ref() makes
    try:
        assert torch._C._storage_Use_Count(key) == 1 and NATIVE.storage_owners(key) == 1
        view = t[1:]
        assert NATIVE.storage_owners(key) == 2  # the view shares the storage
        assert NATIVE.storage_of(view)[0] == key
        storage = t.untyped_storage()  # the program makes one: torch keeps it with the storage
        assert storage._cdata == key
        del storage
        # torch counts its kept object; storage_owners does not
        assert torch._C._storage_Use_Count(key) == 3 and NATIVE.storage_owners(key) == 2
        del t, view
        assert NATIVE.storage_owners(key) == 0 and torch.UntypedStorage._expired(key)
    finally:
        torch.UntypedStorage._free_weak_ref(key)
    assert NATIVE.storage_of(torch.eye(2).to_sparse()) is None  # no single storage
    assert NATIVE.storage_of([1, 2]) is None


@needs_native
@pytest.mark.parametrize("level", LEVELS)
def test_state_dict_saved_then_dropped_is_not_stale(level, tmp_path):
    """A ``state_dict()`` alias is followed while the storage has an owner besides its source
    (``storage_owners``). ``torch.save`` makes the storages' Python objects, which torch then
    keeps for their whole life: not counted, so once the dict is gone a write into the model
    marks nothing. The near miss: the dict kept, the same write marks the weight's alias."""
    model = torch.nn.Linear(3, 2)
    with copytrace.trace(write=False, level=level, observer="native") as t:
        sd = model.state_dict()  # two detach() aliases: weight and bias
        torch.save(sd, tmp_path / "sd.pt")  # untyped_storage() of each
        del sd
        with torch.no_grad():
            model.weight.mul_(2.0)
        t.step()
        kept = model.state_dict()
        with torch.no_grad():
            model.weight.mul_(2.0)  # written while `kept` holds its alias
        t.step()
    assert len(kept) == 2 and t.stats["errors"] == 0
    snaps = [e for e in t.events if e.snapshot]
    assert [e.stale for e in snaps] == [False, False, True, False]  # only the kept weight's
