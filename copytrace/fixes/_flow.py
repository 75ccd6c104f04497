"""Where a kept copy flows, by name, for ``graph-retaining-copy``: detaching the copy is safe
only when nothing it flows into is later differentiated.

The trace shows that no backward ran through the copy's graph within its step; a backward
after the step (gradients accumulated over several batches, then one ``backward()``) would
still need it. This module follows the copy statically, flow-insensitively and by name over
the whole file (an over-approximation: a name once tainted stays tainted), and reports any
``.backward()`` / ``torch.autograd.grad`` / ``torch.autograd.backward`` that a tainted name
reaches.
"""

from __future__ import annotations

import libcst as cst

from copytrace.fixes._cst import Source, dotted, names_in

__all__ = ["needs_graph"]

_GRAD_CALLS = ("autograd.grad", "autograd.backward")


def _roots(target: cst.CSTNode) -> set[str]:
    """The variables an assignment target writes into (``a`` for ``a``, ``a.b``, ``a[i]``)."""
    if isinstance(target, (cst.Tuple, cst.List)):
        return set().union(*(_roots(e.value) for e in target.elements)) if target.elements else set()
    while isinstance(target, (cst.Attribute, cst.Subscript)):
        target = target.value
    if isinstance(target, cst.StarredElement):
        return _roots(target.value)
    return {target.value} if isinstance(target, cst.Name) else set()


def _holders(src: Source, call: cst.Call) -> set[str] | str:
    """The variables that keep the copy made by ``call``, or why they cannot be told."""
    out: set[str] = set()
    stmt = src.statement(call)
    for up in src.ancestors(call):
        if isinstance(up, cst.Call) and isinstance(up.func, cst.Attribute):
            out |= _roots(up.func.value)  # history.append(x.clone()): history keeps it
        if up is stmt:
            break
    if isinstance(stmt, cst.SimpleStatementLine):
        for small in stmt.body:
            if isinstance(small, cst.Assign):
                for t in small.targets:
                    out |= _roots(t.target)
            elif isinstance(small, (cst.AugAssign, cst.AnnAssign)):
                out |= _roots(small.target)
            elif isinstance(small, cst.Return):
                return "the copy is returned: the caller may differentiate it"
    if not out:
        return "copytrace cannot tell which variable keeps the copy"
    return out


def _imported(src: Source) -> set[str]:
    """Names bound by ``import`` statements (modules and imported names)."""
    out: set[str] = set()
    for node in src.nodes(cst.Import):
        for alias in node.names:  # type: ignore[attr-defined]
            out.add(alias.evaluated_alias or dotted(alias.name).split(".")[0])
    for node in src.nodes(cst.ImportFrom):
        if isinstance(node.names, cst.ImportStar):  # type: ignore[attr-defined]
            continue
        for alias in node.names:  # type: ignore[attr-defined]
            out.add(alias.evaluated_alias or dotted(alias.name))
    return out


def _spread(src: Source, tainted: set[str]) -> set[str]:
    """Every name a tainted name flows into, to a fixed point."""
    functions = {f.name.value: f for f in src.nodes(cst.FunctionDef)}  # type: ignore[attr-defined]
    modules = _imported(src)  # torch.stack(history) does not make `torch` keep anything
    while True:
        before = len(tainted)
        for node in src.nodes(cst.CSTNode):
            if isinstance(node, cst.Assign) and names_in(node.value) & tainted:
                for t in node.targets:
                    tainted |= _roots(t.target)
            elif isinstance(node, (cst.AugAssign, cst.AnnAssign)) and node.value is not None \
                    and names_in(node.value) & tainted:  # fmt: skip
                tainted |= _roots(node.target)
            elif isinstance(node, (cst.For, cst.CompFor)) and names_in(node.iter) & tainted:
                tainted |= _roots(node.target)
            elif isinstance(node, cst.Call) and any(names_in(a.value) & tainted for a in node.args):
                if isinstance(node.func, cst.Attribute):
                    tainted |= _roots(node.func.value) - modules  # total.add_(x), log.append(x)
                elif isinstance(node.func, cst.Name) and node.func.value in functions:
                    params = functions[node.func.value].params
                    tainted |= {p.name.value for p in (*params.params, *params.posonly_params,
                                                       *params.kwonly_params)}  # fmt: skip
        if len(tainted) == before:
            return tainted


def needs_graph(src: Source, call: cst.Call) -> str | None:
    """Why the copy ``call`` makes may need its autograd graph, or ``None`` when nothing it
    flows into reaches a backward in this file."""
    held = _holders(src, call)
    if isinstance(held, str):
        return held
    tainted = _spread(src, set(held))
    for node in src.nodes(cst.Call):
        assert isinstance(node, cst.Call)
        func = node.func
        reached = False
        if isinstance(func, cst.Attribute) and func.attr.value == "backward":
            reached = bool(names_in(func.value) & tainted)
        elif dotted(func).endswith(_GRAD_CALLS):
            reached = any(names_in(a.value) & tainted for a in node.args)
        if reached:
            line = src.lines(node)[0]
            return (f"the copy flows into a backward on line {line} "
                    f"(`{' '.join(src.module.code_for_node(node).split())}`): its graph is needed")  # fmt: skip
    return None
