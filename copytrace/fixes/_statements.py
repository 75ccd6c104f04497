"""Fixes that move or add statements: ``data-inplace``, ``deepcopy-in-loop`` and
``pageable-transfer``.

Each rule takes a :class:`~copytrace.fixes._target.Target` and the parsed file and returns an
:class:`~copytrace.fixes._target.Edit`, or raises :class:`~copytrace.fixes._cst.Refuse`.
"""

from __future__ import annotations

import libcst as cst

from copytrace.fixes._cst import (
    Refuse,
    Source,
    attr_call,
    dotted,
    kwarg,
    method,
    names_in,
    receiver,
    replace_all,
)
from copytrace.fixes._target import Edit, Target

__all__ = ["data_inplace", "deepcopy_in_loop", "pageable_transfer"]


def _code(src: Source, node: cst.CSTNode) -> str:
    return " ".join(src.module.code_for_node(node).split())


def _block_of(src: Source, stmt: cst.CSTNode) -> tuple[cst.CSTNode, list[cst.CSTNode]]:
    """The node whose ``body`` lists ``stmt`` (a block or the module), and that list."""
    up = src.parent(stmt)
    body = getattr(up, "body", None)
    if up is None or not isinstance(body, (list, tuple)) or stmt not in body:
        raise Refuse("the statement is not in a block copytrace can edit")
    return up, list(body)


# --- data-inplace ------------------------------------------------------------------------------
def _data_attr(src: Source, stmt: cst.SimpleStatementLine) -> cst.Attribute:
    found = [n for n in src.nodes(cst.Attribute)
             if n.attr.value == "data" and src.statement(n) is stmt]  # type: ignore[attr-defined]
    if len(found) != 1:
        raise Refuse(f"ambiguous line: {len(found)} `.data` accesses in the statement")
    return found[0]  # type: ignore[return-value]


def _write_statement(t: Target, src: Source) -> cst.SimpleStatementLine:
    """The one-statement line on the write's line that writes in place through ``.data``."""
    lines = [s for s in src.nodes(cst.SimpleStatementLine)
             if src.lines(s)[0] <= t.line <= src.lines(s)[1]]  # fmt: skip
    if len(lines) != 1 or len(lines[0].body) != 1:  # type: ignore[attr-defined]
        raise Refuse(f"ambiguous line: line {t.line} holds no single statement")
    return lines[0]  # type: ignore[return-value]


def _backward_after(src: Source, stmt: cst.CSTNode) -> tuple[cst.CSTNode, cst.CSTNode]:
    """``(w, b)``: the ancestor ``w`` of ``stmt`` (or ``stmt``) and a later statement ``b`` of
    the same block that calls ``.backward()``, the nearest such pair going outwards."""
    node = stmt
    while node is not None and not isinstance(node, (cst.Module, cst.FunctionDef)):
        if isinstance(node, (cst.SimpleStatementLine, cst.BaseCompoundStatement)):
            up = src.parent(node)
            body = getattr(up, "body", None)
            if isinstance(body, (list, tuple)) and node in body:
                for later in body[body.index(node) + 1:]:
                    if any(method(c, "backward") for c in _calls(later)):
                        return node, later
        node = src.parent(node)  # type: ignore[assignment]
    raise Refuse("no `.backward()` after the write in an enclosing block: move the write "
                 "after the backward that needs the old value by hand")  # fmt: skip


def _calls(node: cst.CSTNode) -> list[cst.Call]:
    out: list[cst.Call] = []

    class _C(cst.CSTVisitor):
        def visit_Call(self, c: cst.Call) -> None:
            out.append(c)

    node.visit(_C())
    return out


def data_inplace(t: Target, src: Source) -> Edit:
    """``p.data.mul_(x)`` written after a forward saved ``p`` and before its backward ->
    ``with torch.no_grad(): p.mul_(x)``, moved after that backward: the backward then uses the
    values it saved (the true gradient: values change on purpose) and autograd checks later
    writes."""
    if t.ops != ["data_get"]:
        raise Refuse("`.data =` rebinding: assign with `t.copy_(new)` after the backward by hand")
    stmt = _write_statement(t, src)
    data = _data_attr(src, stmt)
    w, b = _backward_after(src, stmt)
    block, body = _block_of(src, w)
    between = body[body.index(w) + 1: body.index(b)]
    used = names_in(w) - src.torch_names
    for other in (*between, b):
        shared = sorted(names_in(other) & used)
        if shared:
            raise Refuse(f"`{shared[0]}` is used between the write and the backward (line "
                         f"{src.lines(other)[0]}): moving the write would change what it sees")  # fmt: skip
    written = stmt.deep_replace(data, data.value)
    torch = src.torch_name()
    wrapped = cst.With(
        items=[cst.WithItem(attr_call(cst.Name(torch), "no_grad"))],
        body=cst.IndentedBlock(body=[written.with_changes(leading_lines=[])]),
        leading_lines=stmt.leading_lines,
    )
    moved = wrapped if w is stmt else w.deep_replace(stmt, wrapped)
    new_body = [s for s in body if s is not w]
    new_body.insert(new_body.index(b) + 1, moved)
    if block is src.module:
        module = src.module.with_changes(body=new_body)
    else:
        module = src.module.deep_replace(block, block.with_changes(body=new_body))
    change = (f"`{_code(src, stmt)}` -> `with {torch}.no_grad(): "
              f"{_code(src, written)}`, after line {src.lines(b)[1]} (`{_code(src, b)}`)")
    return Edit(module, change)  # type: ignore[arg-type]


# --- deepcopy-in-loop --------------------------------------------------------------------------
def _assigned_in(src: Source, scope: cst.CSTNode, name: str) -> list[cst.CSTNode]:
    """Statements of ``scope`` (not of functions nested in it) that bind ``name``."""
    out = []
    for node in src.nodes(cst.CSTNode):
        targets: list[cst.CSTNode] = []
        if isinstance(node, cst.Assign):
            targets = [t.target for t in node.targets]
        elif isinstance(node, (cst.AugAssign, cst.AnnAssign, cst.For, cst.CompFor)):
            targets = [node.target]
        elif isinstance(node, (cst.AsName,)):
            targets = [node.name]
        if any(isinstance(x, cst.Name) and x.value == name or
               isinstance(x, (cst.Tuple, cst.List)) and name in names_in(x) for x in targets):
            if src.scope(node) is scope:
                out.append(node)
    return out


def _inside(src: Source, node: cst.CSTNode, outer: cst.CSTNode) -> bool:
    return node is outer or any(up is outer for up in src.ancestors(node))


def deepcopy_in_loop(t: Target, src: Source) -> Edit:
    """``target = copy.deepcopy(model)`` every step -> one deepcopy before the loop and
    ``target.load_state_dict(model.state_dict())`` in its place (parameter and persistent
    buffer values bit for bit), when ``model`` is created once, before the loop."""
    types = {e.object_type or "" for e in t.events}
    if any("Tensor" in k or k.endswith(("dict", "OrderedDict")) for k in types):
        raise Refuse("the deepcopy is not of a module: refresh the copy with `copy_` by hand")
    names = {f"{n}.deepcopy" for n in src.copy_names}
    call = src.calls_on(t.line, lambda c: dotted(c.func) in names, "copy.deepcopy")
    stmt = src.statement(call)
    small = stmt.body[0] if isinstance(stmt, cst.SimpleStatementLine) else None
    if not (isinstance(small, cst.Assign) and small.value is call and len(small.targets) == 1
            and isinstance(small.targets[0].target, cst.Name) and len(call.args) == 1
            and isinstance(call.args[0].value, cst.Name)):  # fmt: skip
        raise Refuse("not `copy = copy.deepcopy(model)` with plain names")
    copy_name = small.targets[0].target.value  # type: ignore[union-attr]
    model = call.args[0].value.value  # type: ignore[attr-defined]
    loop = next((u for u in src.ancestors(stmt) if isinstance(u, (cst.For, cst.While))), None)
    scope = src.scope(stmt)
    if loop is None or src.scope(loop) is not scope:
        raise Refuse("no loop around the deepcopy in its function")
    made = _assigned_in(src, scope, model)
    if not made:
        raise Refuse(f"`{model}` is not created in this function: copytrace cannot tell it is made once")
    if len(made) > 1 or any(_inside(src, m, loop) for m in made):
        raise Refuse(f"`{model}` is created more than once (or in the loop): its copy must be remade")
    if src.lines(made[0])[0] >= src.lines(loop)[0]:
        raise Refuse(f"`{model}` is created after the loop starts")
    others = [m for m in _assigned_in(src, scope, copy_name) if m is not small]
    if any(_inside(src, m, loop) for m in others):
        raise Refuse(f"`{copy_name}` is bound elsewhere in the loop too")
    refresh = stmt.with_changes(body=[cst.Expr(attr_call(
        cst.Name(copy_name), "load_state_dict", [cst.Arg(attr_call(cst.Name(model), "state_dict"))]))])
    hoisted = stmt.with_changes(leading_lines=[], trailing_whitespace=cst.TrailingWhitespace())
    new_loop = loop.deep_replace(stmt, refresh)
    module = src.module.deep_replace(loop, cst.FlattenSentinel([hoisted, new_loop]))  # type: ignore[arg-type]
    change = (f"`{_code(src, stmt)}` made once before line {src.lines(loop)[0]}; "
              f"`{copy_name}.load_state_dict({model}.state_dict())` in the loop")
    return Edit(module, change)  # type: ignore[arg-type]


# --- pageable-transfer ---------------------------------------------------------------------------
def _loader_call(src: Source, scope: cst.CSTNode, name: str) -> cst.Call:
    """The ``DataLoader(...)`` call that ``name`` is bound to, once, in ``scope``."""
    made = _assigned_in(src, scope, name) or _assigned_in(src, src.module, name)
    if len(made) != 1 or not isinstance(made[0], cst.Assign) \
            or not isinstance(made[0].value, cst.Call) \
            or not dotted(made[0].value.func).endswith("DataLoader"):  # fmt: skip
        raise Refuse(f"`{name}` is not one `DataLoader(...)`: the source is not a DataLoader batch")
    return made[0].value


def _batch_loader(src: Source, call: cst.Call) -> cst.Call:
    """The DataLoader whose batch the transfer's tensor is (``for xb, yb in loader``)."""
    base = receiver(call)
    if not isinstance(base, cst.Name):
        raise Refuse("the transferred tensor is not a plain variable")
    for loop in src.ancestors(call):
        if isinstance(loop, cst.For) and base.value in names_in(loop.target):
            it = loop.iter
            if isinstance(it, cst.Call) and dotted(it.func) == "enumerate" and it.args:
                it = it.args[0].value
            if isinstance(it, cst.Name):
                return _loader_call(src, src.scope(loop), it.value)
            raise Refuse("the loop does not iterate a named DataLoader")
    raise Refuse(f"`{base.value}` is not a loop variable over a DataLoader")


def _set_kw(call: cst.Call, name: str) -> cst.Call:
    args = list(call.args)
    for i, a in enumerate(args):
        if a.keyword is not None and a.keyword.value == name:
            args[i] = a.with_changes(value=cst.Name("True"))
            return call.with_changes(args=args)
    return _append_arg(call, kwarg(name, cst.Name("True")))


def _append_arg(call: cst.Call, arg: cst.Arg) -> cst.Call:
    """``call`` with ``arg`` added last, in the call's own layout (one line, or one argument a
    line with a trailing comma)."""
    args = list(call.args)
    if not args:
        return call.with_changes(args=[arg])
    last = args[-1]
    if last.comma is cst.MaybeSentinel.DEFAULT:
        args[-1] = last.with_changes(comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")))
        return call.with_changes(args=[*args, arg])
    between = args[0].comma if len(args) > 1 else last.comma
    args[-1] = last.with_changes(comma=between)
    return call.with_changes(args=[*args, arg.with_changes(comma=last.comma)])


def pageable_transfer(t: Target, src: Source) -> Edit:
    """``xb.to("cuda")`` of a DataLoader batch -> ``xb.to("cuda", non_blocking=True)`` and
    ``DataLoader(..., pin_memory=True)``: the same values, copied asynchronously from pinned
    memory."""
    op = t.events[0].op
    if op not in ("to", "cuda"):
        raise Refuse(f"`.{op}()` takes no non_blocking flag")
    call = src.calls_on(t.line, lambda c: method(c, op), f".{op}()")
    loader = _batch_loader(src, call)
    if any(a.keyword is not None and a.keyword.value == "pin_memory_device" for a in loader.args):
        raise Refuse("the DataLoader sets pin_memory_device: left as it is")
    module = replace_all(src.module, {call: _set_kw(call, "non_blocking"),
                                      loader: _set_kw(loader, "pin_memory")})  # fmt: skip
    change = f"`{_code(src, call)}` with non_blocking=True; its DataLoader with pin_memory=True"
    return Edit(module, change)  # type: ignore[arg-type]
