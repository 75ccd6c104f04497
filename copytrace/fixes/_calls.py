"""Fixes that rewrite one call in place: ``tensor-ctor-copy``, ``clone-detach-order``,
``graph-retaining-copy``, ``noop-conversion`` and ``redundant-copy`` chains.

Each rule takes a :class:`~copytrace.fixes._target.Target` and the parsed file and returns an
:class:`~copytrace.fixes._target.Edit`, or raises :class:`~copytrace.fixes._cst.Refuse` with
the reason no safe patch exists.
"""

from __future__ import annotations

import libcst as cst

from copytrace.fixes._cst import (
    Refuse,
    Source,
    attr_call,
    has_comment,
    kwarg,
    method,
    parened,
    receiver,
)
from copytrace.fixes._target import Edit, Target

__all__ = ["clone_detach_order", "graph_retaining_copy", "noop_conversion", "redundant_chain",
           "tensor_ctor_copy"]  # fmt: skip


def _code(src: Source, node: cst.CSTNode) -> str:
    return " ".join(src.module.code_for_node(node).split())


def _edit(src: Source, old: cst.CSTNode, new: cst.CSTNode) -> Edit:
    change = f"`{_code(src, old)}` -> `{_code(src, new)}`"
    return Edit(src.module.deep_replace(old, new), change)


# --- tensor-ctor-copy ------------------------------------------------------------------------
_CTOR_KEYWORDS = ("dtype", "device", "requires_grad")
#: literal sequences: ``torch.tensor([a, b])`` reads the tensors' values, it has no ``.detach()``
_SEQUENCE_NODES = (cst.List, cst.Tuple, cst.ListComp, cst.GeneratorExp)
_SEQUENCE_REASON = (
    "a sequence of tensors is read value by value: no `.detach()` of it; `torch.stack` keeps "
    "the graph and so changes the gradients"
)


def _refuse_sequence(t: Target, data: cst.BaseExpression) -> None:
    """Raise :class:`Refuse` where the constructor read a (nested) list or tuple of tensors.

    ``torch.tensor(t)`` keeps ``t``'s shape; a sequence of n tensors gives a result one or more
    dimensions above its first tensor's (``torch.tensor([a, b, c])`` of 0-d tensors: shape
    ``(3,)``, its recorded source ``a``, strides ``()``), so a recorded result whose number of
    dimensions differs from its source's names a sequence even behind a variable
    (``torch.tensor(parts)``, ``u.new_tensor(parts)``). ``parts.detach()`` would raise;
    ``torch.stack(parts)`` keeps the graph, which changes the gradients: left to the user."""
    if isinstance(data, _SEQUENCE_NODES) or any(
        len(e.shape or ()) != len(e.src_stride or ()) for e in t.events
    ):
        raise Refuse(_SEQUENCE_REASON)


def tensor_ctor_copy(t: Target, src: Source) -> Edit:
    """``torch.tensor(x, dtype=d)`` -> ``x.detach().to(dtype=d, copy=True)`` (one copy, as
    before; ``x.detach().clone()`` without dtype or device); ``t.new_tensor(x)`` ->
    ``x.detach().to(t, copy=True)`` (``new_tensor`` takes ``t``'s dtype and device); none for
    ``torch.as_tensor`` nor the legacy constructors (``torch.Tensor``, ``torch.FloatTensor``...),
    recorded only of a sequence of tensors."""
    if "as_tensor" in t.ops or "legacy_ctor" in t.ops:
        raise Refuse(_SEQUENCE_REASON)
    if t.ops == ["new_tensor"]:
        return _new_tensor(t, src)
    call = src.calls_on(t.line, lambda c: src.is_torch(c.func, "tensor"), "torch.tensor")
    pos = [a for a in call.args if a.keyword is None]
    if len(pos) != 1 or pos[0].star:
        raise Refuse("torch.tensor call without exactly one positional argument")
    _refuse_sequence(t, pos[0].value)
    kws = {a.keyword.value: a.value for a in call.args if a.keyword is not None}
    other = sorted(set(kws) - set(_CTOR_KEYWORDS))
    if other:
        raise Refuse(f"torch.tensor(..., {other[0]}=...) has no `.to` equivalent kept here")
    data = parened(pos[0].value)
    detached = attr_call(data, "detach")
    to_args = [kwarg(k, kws[k]) for k in ("dtype", "device") if k in kws]
    if to_args:
        new: cst.BaseExpression = attr_call(detached, "to", [*to_args, kwarg("copy", cst.Name("True"))])
    else:
        new = attr_call(detached, "clone")
    if "requires_grad" in kws:
        new = attr_call(new, "requires_grad_", [cst.Arg(kws["requires_grad"])])
    return _edit(src, call, _with_commas(new))


def _new_tensor(t: Target, src: Source) -> Edit:
    call = src.calls_on(t.line, lambda c: method(c, "new_tensor"), ".new_tensor")
    owner = receiver(call)
    if not isinstance(owner, (cst.Name, cst.Attribute)):
        raise Refuse("`.new_tensor` on an expression (it would be evaluated in another order)")
    if len(call.args) != 1 or call.args[0].keyword is not None or call.args[0].star:
        raise Refuse("`.new_tensor` with options (dtype, device...) is left as it is")
    _refuse_sequence(t, call.args[0].value)
    data = parened(call.args[0].value)
    new = attr_call(attr_call(data, "detach"), "to", [cst.Arg(owner), kwarg("copy", cst.Name("True"))])
    return _edit(src, call, _with_commas(new))


def _with_commas(node: cst.BaseExpression) -> cst.BaseExpression:
    """Give the built calls their ", " separators (recursively along the chain)."""

    class _Commas(cst.CSTTransformer):
        def leave_Call(self, _: cst.Call, updated: cst.Call) -> cst.Call:
            args = list(updated.args)
            for i in range(len(args) - 1):
                if args[i].comma is cst.MaybeSentinel.DEFAULT:
                    args[i] = args[i].with_changes(comma=cst.Comma(
                        whitespace_after=cst.SimpleWhitespace(" ")))
            return updated.with_changes(args=args)

    return node.visit(_Commas())  # type: ignore[return-value]


# --- clone-detach-order ----------------------------------------------------------------------
def _clone_detach(c: cst.Call) -> bool:
    return (
        method(c, "detach") and not c.args
        and method(receiver(c), "clone")
    )  # fmt: skip


def clone_detach_order(t: Target, src: Source) -> Edit:
    """``x.clone(args).detach()`` -> ``x.detach().clone(args)``: the same values, the copy made
    outside autograd."""
    outer = src.calls_on(t.line, _clone_detach, "clone().detach()")
    inner = receiver(outer)
    assert isinstance(inner, cst.Call) and isinstance(inner.func, cst.Attribute)
    assert isinstance(outer.func, cst.Attribute)
    detached = outer.with_changes(func=outer.func.with_changes(value=inner.func.value))
    new = inner.with_changes(func=inner.func.with_changes(value=detached))
    return _edit(src, outer, new)


# --- graph-retaining-copy --------------------------------------------------------------------
def graph_retaining_copy(t: Target, src: Source) -> Edit:
    """``loss.clone()`` kept past its step -> ``loss.detach().clone()``, when nothing the kept
    copy flows into reaches a backward (the graph is then never needed)."""
    from copytrace.fixes._flow import needs_graph

    op = t.events[0].op
    call = src.calls_on(t.line, lambda c: method(c, op), f".{op}()")
    base = receiver(call)
    if method(base, "detach"):
        raise Refuse("the copy is already of a detached tensor")
    why = needs_graph(src, call)
    if why:
        raise Refuse(why)
    assert isinstance(call.func, cst.Attribute)
    new = call.with_changes(func=call.func.with_changes(value=attr_call(parened(base), "detach")))
    return _edit(src, call, new)


# --- noop-conversion -------------------------------------------------------------------------
def _literal(node: cst.BaseExpression, src: Source) -> bool:
    """A constant argument: a string, a number, ``True``/``False``/``None`` or ``torch.<x>``."""
    if isinstance(node, (cst.SimpleString, cst.Integer, cst.Float)):
        return True
    if isinstance(node, cst.Name):
        return node.value in ("True", "False", "None")
    return isinstance(node, cst.Attribute) and src.is_torch(node, node.attr.value)


def noop_conversion(t: Target, src: Source) -> Edit:
    """Drop ``.to("cpu")``, ``.float()``... where every recorded call at the site returned its
    input: the result was the input itself, so values do not change.

    ``.contiguous()`` (and ``.to(memory_format=...)``) is never dropped: whether it copies
    depends on the memory layout a kernel chose (``scaled_dot_product_attention``'s output is
    laid out so that its transpose is contiguous on one backend and not on another), and the
    ``.view()`` that usually follows raises on a non-contiguous tensor."""
    op = t.events[0].op
    if op == "contiguous":
        raise Refuse("`.contiguous()` is kept: whether it copies depends on the layout a kernel "
                     "chose, which another device or shape can change")  # fmt: skip
    same_op = [e for e in t.site_events if e.op == op]
    if not same_op or not all(e.noop and not e.error for e in same_op):
        copied = sum(1 for e in same_op if not e.noop)
        raise Refuse(f"`.{op}()` copied or converted on {copied} of {len(same_op)} recorded calls")
    call = src.calls_on(t.line, lambda c: method(c, op), f".{op}()")
    for a in call.args:
        if a.keyword is not None and a.keyword.value == "copy":
            raise Refuse("`.to(..., copy=...)` is left as it is")
        if a.keyword is not None and a.keyword.value == "memory_format":
            raise Refuse("a memory-format conversion is kept: whether it copies depends on "
                         "the layout a kernel chose")  # fmt: skip
        if not _literal(a.value, src):
            raise Refuse(f"`{_code(src, a.value)}` is not a constant: device- or dtype-generic "
                         "code may convert on another run")  # fmt: skip
    base = receiver(call)
    stmt = src.statement(call)
    if _self_assign(stmt, call, base) and not has_comment(stmt):
        new_module = src.module.deep_remove(stmt)
        if not isinstance(new_module, cst.Module):
            raise Refuse("removing the statement leaves nothing")
        return Edit(_fill_empty(new_module), f"`{_code(src, stmt)}` removed")
    return _edit(src, call, base)


def _self_assign(stmt: cst.CSTNode, call: cst.Call, base: cst.BaseExpression) -> bool:
    """Whether ``stmt`` is ``x = x.<conv>(...)`` (which becomes ``x = x`` without the call)."""
    if not isinstance(stmt, cst.SimpleStatementLine) or len(stmt.body) != 1:
        return False
    a = stmt.body[0]
    return (
        isinstance(a, cst.Assign) and a.value is call and len(a.targets) == 1
        and isinstance(a.targets[0].target, cst.Name) and isinstance(base, cst.Name)
        and a.targets[0].target.value == base.value
    )  # fmt: skip


def _fill_empty(module: cst.Module) -> cst.Module:
    """Put ``pass`` into blocks a removal left empty."""

    class _Pass(cst.CSTTransformer):
        def leave_IndentedBlock(self, _: cst.IndentedBlock, b: cst.IndentedBlock) -> cst.IndentedBlock:
            if b.body:
                return b
            return b.with_changes(body=[cst.SimpleStatementLine([cst.Pass()])])

    return module.visit(_Pass())


# --- redundant-copy (a copy of a fresh copy on one line) -------------------------------------
_DTYPE_METHODS = {
    "float": "float32", "double": "float64", "half": "float16", "bfloat16": "bfloat16",
    "int": "int32", "long": "int64", "short": "int16", "char": "int8", "byte": "uint8",
    "bool": "bool",
}  # fmt: skip
#: Conversions that keep every value exactly (``src -> wider``): converting through one of them
#: and then on rounds once, as converting directly does.
_EXACT = {
    "bool": {"uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32", "float64"},
    "uint8": {"int16", "int32", "int64", "float16", "float32", "float64"},
    "int8": {"int16", "int32", "int64", "float16", "float32", "float64"},
    "int16": {"int32", "int64", "float32", "float64"},
    "int32": {"int64", "float64"},
    "float16": {"float32", "float64"},
    "bfloat16": {"float32", "float64"},
    "float32": {"float64"},
}  # fmt: skip
_SAME = ("clone", "contiguous")


def redundant_chain(t: Target, src: Source) -> Edit:
    """``x.double().clone()`` -> ``x.double()``; ``x.clone().float()`` -> ``x.float()``;
    ``x.float().double()`` -> ``x.double()`` where the first conversion widens exactly."""
    pair = _chain_pair(t)
    if pair is None:
        raise Refuse("the same data copied twice at different places: reuse needs a variable")
    a, b = pair
    call = src.calls_on(t.line, lambda c: method(c, b.op) and method(receiver(c), a.op),
                        f".{a.op}().{b.op}()")  # fmt: skip
    first = receiver(call)
    assert isinstance(first, cst.Call)
    if b.op in _SAME:
        _always_copies(t, a.op)
        return _edit(src, call, first)
    if a.op in _SAME:
        _always_copies(t, b.op)
        assert isinstance(call.func, cst.Attribute)
        return _edit(src, call, call.with_changes(func=call.func.with_changes(value=receiver(first))))
    if a.op in _DTYPE_METHODS and b.op in _DTYPE_METHODS:
        mid = _DTYPE_METHODS[a.op]
        if mid not in _EXACT.get(a.src_dtype or "", ()):
            raise Refuse(f"the chain narrows ({a.src_dtype} -> {mid} -> {b.dtype}): it rounds on "
                         "purpose, folding it would change values")  # fmt: skip
        _always_copies(t, b.op)
        assert isinstance(call.func, cst.Attribute)
        return _edit(src, call, call.with_changes(func=call.func.with_changes(value=receiver(first))))
    raise Refuse(f"no mechanical fold for `.{a.op}().{b.op}()`")


def _chain_pair(t: Target) -> tuple | None:
    """The first (copy, copy of its fresh result) pair among the finding's events."""
    by_dst = {e.dst_storage: e for e in t.events if e.dst_storage is not None}
    for b in t.events:
        a = by_dst.get(b.src_storage)
        if a is not None and a is not b and a.seq < b.seq:
            return a, b
    return None


def _always_copies(t: Target, op: str) -> None:
    """Refuse unless every recorded ``op`` call at the site made a copy (never returned its
    input): the call left alone must still hand back a tensor of its own."""
    same = [e for e in t.site_events if e.op == op]
    if not same or any(e.noop or e.alias or not e.bytes_allocated for e in same):
        raise Refuse(f"`.{op}()` returned its input on some calls: the other copy is needed then")
