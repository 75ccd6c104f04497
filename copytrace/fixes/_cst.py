"""LibCST helpers the fix rules share: a parsed source with positions and parents, the calls
a trace's line pins, and small node builders that keep the user's formatting.

A rewrite changes only the nodes it replaces: LibCST keeps every other token, comment and
blank line of the file as it was (https://libcst.readthedocs.io/en/latest/why_libcst.html).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import cached_property
from typing import Any

import libcst as cst
from libcst.metadata import MetadataWrapper, PositionProvider

__all__ = ["Refuse", "Source", "attr_call", "dotted", "names_in", "parened"]


class Refuse(Exception):
    """A fix that cannot be made safely; the message says why (one line)."""


class Source:
    """One Python file parsed by LibCST, with the line span and parent of every node.

    Parsed when a rule first reads it (a rule that refuses from the trace's events alone
    costs no parse; LibCST takes about half a second for a 200-line file with its metadata).

    Args:
        text: the file's text.

    Raises:
        Refuse: (on first use) if the text is not valid Python for LibCST's parser.
    """

    def __init__(self, text: str) -> None:
        self.text = text

    @cached_property
    def module(self) -> cst.Module:
        try:
            return cst.parse_module(self.text)
        except cst.ParserSyntaxError as err:
            raise Refuse(f"LibCST cannot parse the file: {str(err).splitlines()[0]}") from None

    @cached_property
    def _meta(self) -> tuple[Any, dict[cst.CSTNode, cst.CSTNode]]:
        positions = MetadataWrapper(self.module, unsafe_skip_copy=True).resolve(PositionProvider)
        # each node's parent from the tree itself: what ParentNodeProvider gives, in about
        # half its time (the two metadata passes are most of a rule's cost)
        parents: dict[cst.CSTNode, cst.CSTNode] = {}
        stack: list[cst.CSTNode] = [self.module]
        while stack:
            node = stack.pop()
            for child in node.children:
                parents[child] = node
                stack.append(child)
        return positions, parents

    @property
    def _pos(self) -> Any:
        return self._meta[0]

    @property
    def _parent(self) -> Any:
        return self._meta[1]

    @cached_property
    def torch_names(self) -> set[str]:
        return self._module_aliases("torch")

    @cached_property
    def copy_names(self) -> set[str]:
        return self._module_aliases("copy")

    def _module_aliases(self, name: str) -> set[str]:
        """Names bound to module ``name`` by ``import name`` / ``import name as x``."""
        out = set()
        for node in self._pos:
            if isinstance(node, cst.Import):
                for alias in node.names:
                    if dotted(alias.name) == name:
                        out.add(alias.evaluated_alias or name)
        return out

    # --- positions and parents ------------------------------------------------------------
    def lines(self, node: cst.CSTNode) -> tuple[int, int]:
        """First and last line of ``node`` (1-based)."""
        r = self._pos[node]
        return r.start.line, r.end.line

    def parent(self, node: cst.CSTNode) -> cst.CSTNode | None:
        return self._parent.get(node)

    def ancestors(self, node: cst.CSTNode) -> Iterator[cst.CSTNode]:
        while (node := self._parent.get(node)) is not None:  # type: ignore[assignment]
            yield node

    def statement(self, node: cst.CSTNode) -> cst.BaseStatement:
        """The statement (a line or a compound statement) that holds ``node``."""
        for up in (node, *self.ancestors(node)):
            if isinstance(up, (cst.SimpleStatementLine, cst.BaseCompoundStatement)):
                return up
        raise Refuse("no statement holds the call")

    def scope(self, node: cst.CSTNode) -> cst.CSTNode:
        """The function (or the module) whose code holds ``node``."""
        for up in self.ancestors(node):
            if isinstance(up, (cst.FunctionDef, cst.Lambda)):
                return up
        return self.module

    # --- finding what a line pins ----------------------------------------------------------
    def nodes(self, kind: type) -> Iterator[cst.CSTNode]:
        return (n for n in self._pos if isinstance(n, kind))

    def calls_on(self, line: int, match: Callable[[cst.Call], bool], what: str) -> cst.Call:
        """The one call on ``line`` that ``match`` accepts: a call starting on the line, else
        one spanning it.

        Raises:
            Refuse: when no call, or more than one, matches (an ambiguous line).
        """
        found = [c for c in self.nodes(cst.Call) if match(c)]  # type: ignore[arg-type]
        starting = [c for c in found if self.lines(c)[0] == line]
        spanning = [c for c in found if self.lines(c)[0] <= line <= self.lines(c)[1]]
        picked = starting or spanning
        if not picked:
            raise Refuse(f"no {what} on line {line} (the file changed since the trace?)")
        if len(picked) > 1:
            raise Refuse(f"ambiguous line: {len(picked)} {what} calls on line {line}")
        return picked[0]  # type: ignore[return-value]

    def is_torch(self, func: cst.BaseExpression, name: str) -> bool:
        """Whether ``func`` is ``torch.<name>`` for a name bound to the torch module."""
        return (
            isinstance(func, cst.Attribute)
            and func.attr.value == name
            and isinstance(func.value, cst.Name)
            and func.value.value in self.torch_names
        )

    def torch_name(self) -> str:
        """The name the file uses for torch (``torch`` when it imports it plainly)."""
        if "torch" in self.torch_names or not self.torch_names:
            return "torch"
        return sorted(self.torch_names)[0]


def method(call: cst.CSTNode, *names: str) -> bool:
    """Whether ``call`` is ``<expr>.<name>(...)`` for one of ``names``."""
    return (
        isinstance(call, cst.Call)
        and isinstance(call.func, cst.Attribute)
        and call.func.attr.value in names
    )


def receiver(call: cst.Call) -> cst.BaseExpression:
    assert isinstance(call.func, cst.Attribute)
    return call.func.value


def dotted(node: cst.CSTNode) -> str:
    """``a.b.c`` for a Name/Attribute chain, else ``""``."""
    if isinstance(node, cst.Name):
        return node.value
    if isinstance(node, cst.Attribute):
        head = dotted(node.value)
        return f"{head}.{node.attr.value}" if head else ""
    return ""


def names_in(node: cst.CSTNode) -> set[str]:
    """Every plain name read or written anywhere inside ``node``."""
    out: set[str] = set()

    class _Names(cst.CSTVisitor):
        def visit_Name(self, n: cst.Name) -> None:
            out.add(n.value)

        def visit_Attribute(self, n: cst.Attribute) -> bool:
            n.value.visit(self)  # the attribute's own name is not a variable
            return False

    node.visit(_Names())
    return out


def parened(expr: cst.BaseExpression) -> cst.BaseExpression:
    """``expr`` in parentheses when a method call on it would bind to part of it."""
    atomic = (cst.Name, cst.Attribute, cst.Call, cst.Subscript, cst.List, cst.Tuple, cst.Dict)
    if isinstance(expr, atomic) or expr.lpar:
        return expr
    return expr.with_changes(lpar=[cst.LeftParen()], rpar=[cst.RightParen()])


def attr_call(value: cst.BaseExpression, name: str, args: list[cst.Arg] | None = None) -> cst.Call:
    """``value.name(args)``."""
    return cst.Call(func=cst.Attribute(value=value, attr=cst.Name(name)), args=args or [])


def kwarg(name: str, value: cst.BaseExpression) -> cst.Arg:
    """``name=value`` without spaces (PEP 8)."""
    return cst.Arg(
        value=value,
        keyword=cst.Name(name),
        equal=cst.AssignEqual(
            whitespace_before=cst.SimpleWhitespace(""), whitespace_after=cst.SimpleWhitespace("")
        ),
    )


def with_args(call: cst.Call, args: list[cst.Arg]) -> cst.Call:
    """``call`` with ``args``, the separators remade (", " between, none after the last)."""
    fixed = []
    for i, a in enumerate(args):
        last = i == len(args) - 1
        comma = cst.MaybeSentinel.DEFAULT if last else cst.Comma(
            whitespace_after=cst.SimpleWhitespace(" ")
        )
        fixed.append(a.with_changes(comma=comma))
    return call.with_changes(args=fixed)


def has_comment(stmt: cst.CSTNode) -> bool:
    """Whether a comment is attached to ``stmt`` (above it or at the end of its line)."""
    if any(line.comment for line in getattr(stmt, "leading_lines", ())):
        return True
    trailing = getattr(stmt, "trailing_whitespace", None)
    return bool(trailing is not None and trailing.comment)


def replace_all(module: cst.Module, new: dict[cst.CSTNode, cst.CSTNode]) -> cst.Module:
    """``module`` with each key node (by identity, as parsed) replaced by its value, in one
    pass (a second ``deep_replace`` would no longer find nodes the first one rebuilt)."""

    class _Replace(cst.CSTTransformer):
        def on_leave(self, original: cst.CSTNode, updated: cst.CSTNode) -> cst.CSTNode:
            return new.get(original, updated)  # type: ignore[return-value]

    return module.visit(_Replace())
