"""The C++ observer's per-event helpers against their Python counterparts: a tensor's facts
(``facts`` vs ``copytrace.tracer._facts.py_facts``), new events (``copy_slots``) and the call
site (``call_site`` vs ``copytrace.tracer._callsite.user_frame``)."""

from __future__ import annotations

import gc
import os
import sys
from typing import Any

import pytest
import torch

import copytrace
from copytrace.schema import CopyEvent
from copytrace.tracer import _callsite, _native
from copytrace.tracer import _facts as F

NATIVE = _native.load()
pytestmark = pytest.mark.skipif(
    NATIVE is None and not os.environ.get("COPYTRACE_REQUIRE_INTEGRATION"),
    reason="C++ observer unavailable here",
)


class _Sub(torch.Tensor):
    """A plain Python subclass: its facts are read by the Python reader."""


def _plain_tensors() -> dict[str, torch.Tensor]:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    leaf = torch.randn(3, 4, requires_grad=True)
    with torch.inference_mode():
        inference = torch.ones(2, 3)
    written = torch.zeros(5)
    written.add_(1)  # version counter 1
    return {
        "contiguous": base,
        "leaf requiring grad": leaf,
        "clone with grad_fn": leaf.clone(),
        "view with grad_fn": leaf[1:, ::2],
        "slice, offset and strides": base[1:3, 2:5],
        "transposed": base.t(),
        "expanded (stride 0)": torch.ones(3, 1).expand(3, 4),
        "0-size": torch.empty(0, 3),
        "0-dim": torch.tensor(2.5, dtype=torch.float64),
        "int64": torch.arange(5),
        "bool": torch.ones(3, dtype=torch.bool),
        "complex": torch.zeros(2, dtype=torch.complex64),
        "channels_last": torch.zeros(2, 3, 4, 5).to(memory_format=torch.channels_last),
        "meta": torch.empty(7, 2, device="meta"),
        "inference (no version counter)": inference,
        "written in place": written,
        "parameter": torch.nn.Parameter(torch.ones(2, 2)),
        "detached alias": leaf.detach(),
    }


def _same(c: tuple, p: tuple, with_grad_fn: bool) -> None:
    assert len(c) == len(p) == 14
    for i, (a, b) in enumerate(zip(c, p, strict=True)):
        if i == F.GRAD_FN and with_grad_fn:
            assert a is b  # the node's one Python object
        else:
            assert a == b and type(a) is type(b), (i, a, b)


@pytest.mark.parametrize("with_grad_fn", [False, True])
@pytest.mark.parametrize("name", list(_plain_tensors()))
def test_facts_match_the_python_reader(name: str, with_grad_fn: bool) -> None:
    t = _plain_tensors()[name]
    with torch._C.DisableTorchFunction():
        c = NATIVE.facts(t, with_grad_fn)
        p = F.py_facts(t, with_grad_fn)
    assert c is not None
    _same(c, p, with_grad_fn)


def test_facts_values_of_a_strided_view() -> None:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    view = base[1:3, 2:5]  # rows 1-2, columns 2-4 of a 4x6 float32 tensor
    c = NATIVE.facts(view, True)
    assert c[F.SHAPE] == (2, 3)
    assert c[F.DTYPE] == "float32" and c[F.DEVICE] == "cpu"
    assert c[F.REQUIRES_GRAD] is False and c[F.IS_LEAF] is True and c[F.GRAD_FN] is None
    assert c[F.STORAGE_BYTES] == 24 * 4  # the whole base storage: 24 floats
    assert c[F.LOGICAL_BYTES] == 6 * 4  # 2 x 3 floats
    assert c[F.OFFSET] == 1 * 6 + 2 and c[F.STRIDE] == (6, 1)  # row 1, column 2
    assert c[F.VERSION] == 0 and c[F.FAKE] is False
    # the storage's key: its StorageImpl's address, an int (no Python storage object)
    assert type(c[F.STORAGE]) is int and c[F.STORAGE] == base.untyped_storage()._cdata


def test_facts_grad_fn_only_when_asked() -> None:
    out = torch.randn(2, requires_grad=True).clone()
    c = NATIVE.facts(out, False)
    assert c[F.IS_LEAF] is None and c[F.GRAD_FN] is None and c[F.GRAD_FN_NAME] is None
    c = NATIVE.facts(out, True)
    assert c[F.IS_LEAF] is False and c[F.GRAD_FN_NAME] == "CloneBackward0"
    assert c[F.GRAD_FN] is out.grad_fn


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_facts_leave_other_tensors_to_the_python_reader() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fake = torch.empty(3)
    others = {
        "sparse": torch.eye(3).to_sparse(),
        "nested": torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]),
        "subclass": torch.ones(2).as_subclass(_Sub),
        "FakeTensor": fake,
        "not a tensor": [1, 2],
    }
    for name, t in others.items():
        assert NATIVE.facts(t, True) is None, name
    with torch._C.DisableTorchFunction():
        sub = F.facts(NATIVE, others["subclass"], True)  # the Python reader answers
        fake_facts = F.facts(NATIVE, fake, True)  # a result: FAKE is read
    assert sub[F.SHAPE] == (2,) and sub[F.STORAGE] is not None
    assert fake_facts[F.FAKE] is True and fake_facts[F.LOGICAL_BYTES] == 12  # 3 float32
    sparse = F.facts(NATIVE, others["sparse"], False)
    assert sparse[F.STORAGE] is None and sparse[F.OFFSET] is None  # no single storage


def test_facts_keep_nothing_alive() -> None:
    import weakref

    t = torch.randn(3, requires_grad=True).clone()
    ref = weakref.ref(t)
    facts = NATIVE.facts(t, True)
    del facts, t
    gc.collect()
    assert ref() is None


def test_copy_slots_copies_the_prototype() -> None:
    proto = CopyEvent()
    ev = NATIVE.copy_slots(proto)
    assert type(ev) is CopyEvent and ev is not proto
    assert ev.as_dict() == proto.as_dict()
    assert not gc.is_tracked(ev)  # holds strings, numbers and tuples only: never in a cycle
    ev.op, ev.shape = "clone", (2, 3)
    assert proto.op is None and proto.shape == ()
    with pytest.raises(TypeError):
        NATIVE.copy_slots(object())


def _site_here():
    """(C call site, Python call site) of this function's caller's line, from user code."""
    return NATIVE.call_site(_callsite._code_kind), _callsite.call_site(sys._getframe(0))


# A helper whose code lies in torch's package directory: a library frame between the user's
# line and the call-site walk, named as the `via`.
_LIB_NS: dict = {}
exec(  # noqa: S102
    compile(
        "def lib_helper(native, kind, call_site, sys):\n"
        "    return native.call_site(kind), call_site(sys._getframe(0))\n",
        torch.__file__,
        "exec",
    ),
    _LIB_NS,
)


def test_call_site_matches_user_frame() -> None:
    c, p = _site_here()
    assert c == p
    assert c[0] == __file__ and c[2] == "_site_here" and c[3] is None and c[4] is None
    first = _site_here()[0]
    second = _site_here()[0]  # same code, same instruction: from the cache
    assert first == second
    c, p = _LIB_NS["lib_helper"](NATIVE, _callsite._code_kind, _callsite.call_site, sys)
    assert c == p
    assert c[2] == "test_call_site_matches_user_frame" and c[3] == "lib_helper"
    assert c[4] is None  # torch's own code is no library site
    assert c[1] == sys._getframe(0).f_lineno - 4  # the line that called lib_helper


def _package_helper(path: str) -> Any:
    """A function whose code lies in ``path`` (need not exist) and that calls torch's
    lib_helper: user line -> package -> torch -> the walk."""
    ns: dict = {"lib_helper": _LIB_NS["lib_helper"]}
    src = "def pkg_helper(*a):\n    return lib_helper(*a)\n"
    exec(compile(src, path, "exec"), ns)  # noqa: S102
    return ns["pkg_helper"]


def test_call_site_names_the_library_frame(monkeypatch: pytest.MonkeyPatch) -> None:
    sep = os.sep
    installed = f"{sep}opt{sep}env{sep}site-packages{sep}fakelib{sep}core.py"
    helper = _package_helper(installed)
    c, p = helper(NATIVE, _callsite._code_kind, _callsite.call_site, sys)
    here = sys._getframe(0).f_lineno - 1
    assert c == p
    # the user's line, the innermost torch-or-library function (torch's lib_helper), and
    # the innermost frame of the installed package: pkg_helper's line 2
    assert c[:4] == (__file__, here, "test_call_site_names_the_library_frame", "lib_helper")
    assert c[4] == (installed, 2, "pkg_helper")
    # COPYTRACE_LIBRARY_PATHS: a prefix outside site-packages counts as a library too
    _callsite._kind(__file__)  # the prefixes are read on first use
    vendored = os.path.join(os.path.dirname(os.path.realpath(__file__)), "vendored_lib", "")
    monkeypatch.setattr(_callsite, "_EXTRA", (vendored,))
    helper = _package_helper(vendored + "mod.py")
    c, p = helper(NATIVE, _callsite._code_kind, _callsite.call_site, sys)
    assert c == p and c[4] == (vendored + "mod.py", 2, "pkg_helper")


def test_call_site_lines_per_instruction() -> None:
    helper = _LIB_NS["lib_helper"]
    sites = [helper(NATIVE, _callsite._code_kind, _callsite.call_site, sys) for _ in range(2)]
    other = helper(NATIVE, _callsite._code_kind, _callsite.call_site, sys)
    here = sys._getframe(0).f_lineno
    # the loop's line twice (the second from the cache), then the next line
    assert [c[1] for c, _ in sites] == [here - 2, here - 2]
    assert other[0][1] == here - 1
    assert all(c == p for c, p in [*sites, other])


def _traced_events(observer: str, level: str) -> list[dict]:
    import copytrace

    x = torch.randn(4, 3, requires_grad=True)
    y = torch.randn(4, 3)
    idx = torch.tensor([0, 2])

    def program() -> None:
        a = x.clone()
        b = y.detach()
        c = y.to(torch.float64)
        d = c.to(torch.float64)  # a no-op: returns its input
        e = x.data
        f = y[idx]  # advanced indexing: a fresh gather
        g = x.t().reshape(-1)  # a hidden copy
        h = y.contiguous()  # already contiguous: a no-op
        y.copy_(b)
        y[1]  # basic indexing: no event
        f.zero_()  # an in-place write into a fresh copy
        _ = (a, d, e, f, g, h)

    with copytrace.trace(write=False, observer=observer, level=level) as t:
        program()
    skip = ("start_ns", "end_ns", "thread_id")
    return [{k: v for k, v in e.as_dict().items() if k not in skip} for e in t.events]


class _Everything(frozenset):
    def __contains__(self, item: object) -> bool:
        return True


@pytest.mark.parametrize("level", ["full", "lean"])
def test_record_sets_every_field_as_the_python_path(level: str, monkeypatch) -> None:
    from copytrace.tracer import _api_events

    native = _traced_events("auto", level)
    python = _traced_events("python", "full")
    monkeypatch.setattr(_api_events, "_IN_PYTHON", _Everything())  # no op through record
    readers = _traced_events("auto", level)
    # clone, detach, to, to (no-op), data_get, index, t+reshape, contiguous, copy_: 9 events,
    # every field equal (storage ids, views, versions, call sites, graph state, writes)
    assert [e["op"] for e in native] == [
        "clone", "detach", "to", "to", "data_get", "index", "reshape", "contiguous", "copy_",
    ]  # fmt: skip
    assert native == readers
    # the Python dispatch mode also sees .data's aten::detach, which no kernel sees
    assert [{**e, "aten": ()} for e in native] == [{**e, "aten": ()} for e in python]
    assert native[3]["noop"] and native[3]["dst_storage"] == native[3]["src_storage"]
    assert native[5]["inplace_writes"] == 1 and native[8]["bytes_allocated"] == 0


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@pytest.mark.parametrize("layout", ["sparse_coo", "sparse_csr"])
def test_record_of_a_sparse_source_leaves_it_to_the_python_readers(layout: str) -> None:
    # record() reads the source's facts first; a sparse source has none (no single storage),
    # so the result's are never read and record() must answer None, not crash
    dense = torch.eye(3)
    sparse = dense.to_sparse() if layout == "sparse_coo" else dense.to_sparse_csr()
    with copytrace.trace(write=False) as t:
        out = sparse.detach()
    assert out.layout == sparse.layout and torch.equal(out.to_dense(), dense)
    assert [e.op for e in t.events] == ["detach"] and t.stats["errors"] == 0


def test_frame_var_reads_locals_cells_and_free_variables_like_f_locals() -> None:
    # frame_var(frame, name) is what copytrace reads torch.compile's wrapper's `fn` with at
    # every compiled call: it must give what f_locals gives, for a plain local, a cell (a local
    # an inner function closes over) and a free variable, and NameError for a name the frame
    # does not have (or has not bound yet).
    def outer() -> tuple[object, ...]:
        plain = [1]
        cell = "closed over"

        def inner() -> tuple[object, ...]:
            me = sys._getframe(0)
            assert cell  # a free variable of inner, a cell of outer
            return (
                NATIVE.frame_var(me, "cell"), me.f_locals["cell"],
                NATIVE.frame_var(sys._getframe(1), "cell"),
                NATIVE.frame_var(sys._getframe(1), "plain"),
            )  # fmt: skip

        return (*inner(), plain)

    free, free_locals, as_cell, plain, plain_obj = outer()
    assert free == free_locals == as_cell == "closed over"
    assert plain is plain_obj
    with pytest.raises(NameError):
        NATIVE.frame_var(sys._getframe(0), "no_such_name")

    def unbound() -> None:
        frame = sys._getframe(0)
        with pytest.raises(NameError):
            NATIVE.frame_var(frame, "later")
        later = 1
        assert NATIVE.frame_var(frame, "later") == later

    unbound()
