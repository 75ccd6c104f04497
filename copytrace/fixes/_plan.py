"""The planner: findings -> the file, line and rule of each fix -> the rewritten files.

Each finding with a rule in :data:`FIXES` is pinned to one line (its first call site; for
``data-inplace`` the in-place write). Files outside the project root, in the standard library
or in installed packages are never touched. Every rule first runs on the file as it is (one
parse: the refusals, and each fix's own diff). Then a file's fixes are made one at a time,
bottom line first, each made again on the text the previous one left (parsed again), so every
rule sees valid code; a line that an earlier fix of the same file changed is refused rather
than guessed.
"""

from __future__ import annotations

import difflib
import re
import site
import sysconfig
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from copytrace.fixes import _calls, _statements
from copytrace.fixes._cst import Refuse, Source
from copytrace.fixes._target import Edit, Target

__all__ = ["FIXES", "Fix", "FixRule", "Plan", "Unfixed", "make_plan"]


@dataclass(frozen=True)
class FixRule:
    """How one hazard code is fixed.

    Attributes:
        rewrite: ``rewrite(target, source) -> Edit``; raises :class:`Refuse`.
        exact: whether the fix keeps every value bit for bit.
        effect: what the fix does to values (one line, shown in the diff).
    """

    rewrite: Callable[[Target, Source], Edit]
    exact: bool
    effect: str


#: The fix of each hazard code that has one (``docs/fix.md``).
FIXES: dict[str, FixRule] = {
    "tensor-ctor-copy": FixRule(_calls.tensor_ctor_copy, True,
                                "keeps values bit for bit: the same one copy, made outside autograd"),
    "clone-detach-order": FixRule(_calls.clone_detach_order, True,
                                  "keeps values bit for bit: the copy is made outside autograd"),
    "data-inplace": FixRule(_statements.data_inplace, False,
                            "changes values on purpose: the backward gets the values it saved "
                            "(the true gradient) and autograd checks the write"),
    "graph-retaining-copy": FixRule(_calls.graph_retaining_copy, True,
                                    "keeps values bit for bit: the kept copy no longer holds "
                                    "its autograd graph"),
    "noop-conversion": FixRule(_calls.noop_conversion, True,
                               "keeps values bit for bit: every recorded call returned its input"),
    "redundant-copy": FixRule(_calls.redundant_chain, True,
                              "keeps values bit for bit: one copy instead of two, never narrower"),
    "deepcopy-in-loop": FixRule(_statements.deepcopy_in_loop, True,
                                "keeps parameter and persistent-buffer values bit for bit; the "
                                "copy's training mode, requires_grad flags, .grad and "
                                "non-persistent buffers are no longer refreshed"),
    "pageable-transfer": FixRule(_statements.pageable_transfer, True,
                                 "keeps values bit for bit: the host batch is pinned and copied "
                                 "asynchronously"),
}  # fmt: skip


@dataclass
class Fix:
    """One finding's patch: where, what changed, and what it does to values.

    ``diff`` is this fix's own unified diff on the original file (``a/rel`` / ``b/rel``
    headers, 3 lines of context; what the report shows); findings that share the line share
    it. :func:`~copytrace.fixes.format_diff` writes the whole plan's patch.
    """

    finding: Any
    rel: str
    line: int
    change: str
    exact: bool
    effect: str
    diff: str = ""

    def reason(self) -> str:
        """The one line shown above the fix's hunk."""
        return f"{self.finding.code} at {self.rel}:{self.line}: {self.change} ({self.effect})"


@dataclass
class Unfixed:
    """A finding without a safe patch: why, and the finding's own advice (``finding.fix``)."""

    finding: Any
    reason: str


@dataclass
class Plan:
    """What ``copytrace fix`` would change.

    Attributes:
        root: the project root (files outside it are never touched).
        fixes: the patches, by file then line.
        unfixed: the findings left as they are, with the reason.
        files: ``rel path -> (old text, new text)`` of every file a fix changes.
    """

    root: Path
    fixes: list[Fix] = field(default_factory=list)
    unfixed: list[Unfixed] = field(default_factory=list)
    files: dict[str, tuple[str, str]] = field(default_factory=dict)


_SITE = re.compile(r"^(?P<file>.+):(?P<line>\d+)(?: .*)?$")


def _installed() -> list[Path]:
    """The standard library's and installed packages' folders."""
    paths = {sysconfig.get_paths().get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    try:
        paths.update(site.getsitepackages())
        paths.add(site.getusersitepackages())
    except AttributeError:  # a virtualenv's old site module
        pass
    return [Path(p).resolve() for p in paths if p]


def outside(path: Path, root: Path) -> str | None:
    """Why ``path`` must not be touched, or ``None`` when it is a file of the project."""
    p = path.resolve()
    if not p.is_relative_to(root):
        return f"{path} is outside the current directory ({root})"
    if {"site-packages", "dist-packages"} & set(p.parts) or any(
        p.is_relative_to(d) and not root.is_relative_to(d) for d in _installed()
    ):
        return f"{path} belongs to an installed package or the standard library"
    if not p.is_file():
        return f"{path} is not a file here"
    return None


def _pin(f: Any) -> tuple[Path, int] | None:
    m = _SITE.match(f.call_sites[0]) if f.call_sites else None
    return (Path(m["file"]), int(m["line"])) if m else None


def _targets(findings: Iterable[Any], runs: list[list[Any]], root: Path, plan: Plan) -> list[Target]:
    by_site: dict[int, dict[str, list[Any]]] = {}
    out = []
    for f in findings:
        if f.code not in FIXES:
            plan.unfixed.append(Unfixed(f, "no mechanical fix for this code"))
            continue
        pin = _pin(f)
        if pin is None:
            plan.unfixed.append(Unfixed(f, "the trace has no call site for it"))
            continue
        path, line = pin
        why = outside(path, root)
        if why:
            plan.unfixed.append(Unfixed(f, why))
            continue
        run = runs[f.run]
        if f.run not in by_site:
            sites: dict[str, list[Any]] = {}
            for e in run:
                sites.setdefault(e.site, []).append(e)
            by_site[f.run] = sites
        events = [run[s] for s in f.event_seqs if 0 <= s < len(run)]
        site_events = by_site[f.run].get(events[0].site, []) if events else []
        rel = path.resolve().relative_to(root).as_posix()
        out.append(Target(f, path.resolve(), rel, line, events, site_events))
    return out


def _remap(old: str, new: str, lines: list[int]) -> list[int | None]:
    """Each of ``lines`` (of ``old``) in ``new``; ``None`` for a line the edit changed."""
    sm = difflib.SequenceMatcher(None, old.splitlines(), new.splitlines(), autojunk=False)
    out: list[int | None] = []
    for line in lines:
        mapped = None
        for tag, i1, i2, j1, _ in sm.get_opcodes():
            if tag == "equal" and i1 < line <= i2:
                mapped = j1 + line - i1
        out.append(mapped)
    return out


def _alone(todo: list[Target], original: Source) -> dict[int, Edit | Refuse]:
    """Each target's rule on the original file: its refusal, or the fix made alone (the diff
    the report shows). One parse serves them all; most files need no other."""
    out: dict[int, Edit | Refuse] = {}
    for t in todo:
        try:
            out[id(t)] = FIXES[t.code].rewrite(t, original)
        except Refuse as why:
            out[id(t)] = why
    return out


def _unified(rel: str, old: str, new: str) -> str:
    return "".join(difflib.unified_diff(old.splitlines(keepends=True),
                                        new.splitlines(keepends=True), f"a/{rel}", f"b/{rel}"))  # fmt: skip


def _fix_file(targets: list[Target], plan: Plan) -> None:
    """Make the fixes of one file: each rule on the original text first (its refusal, or its
    own diff), then the fixes bottom line first, each made again on the previous one's text."""
    path = targets[0].path
    twin: dict[int, list[Target]] = {}
    with open(path, encoding="utf-8", newline="") as fh:  # keep \r\n line ends as they are
        original = text = fh.read()
    todo = []
    seen: dict[tuple[str, int], Target] = {}
    for t in sorted(targets, key=lambda t: -t.line):
        if (t.code, t.line) in seen:  # the same line again (another step, parameter...)
            twin.setdefault(id(seen[(t.code, t.line)]), []).append(t)
        else:
            seen[(t.code, t.line)] = t
            todo.append(t)
    current = {id(t): t.line for t in todo}
    alone = _alone(todo, Source(original))
    for t in todo:
        line, edit = current[id(t)], alone[id(t)]
        if line is None:
            edit = Refuse("its line was changed by another fix")
        elif text != original and isinstance(edit, Edit):  # made again on what the fixes
            try:  # below it left (parsed once per text)
                edit = FIXES[t.code].rewrite(Target(t.finding, t.path, t.rel, line, t.events,
                                                    t.site_events), Source(text))  # fmt: skip
            except Refuse as why:
                edit = why
        if isinstance(edit, Refuse):
            plan.unfixed += [Unfixed(u.finding, str(edit)) for u in (t, *twin.get(id(t), ()))]
            continue
        new = edit.module.code
        rest = [u for u in todo if current.get(id(u)) is not None and u is not t]
        for u, mapped in zip(rest, _remap(text, new, [current[id(u)] for u in rest]), strict=True):
            current[id(u)] = mapped  # type: ignore[assignment]
        current[id(t)] = None  # type: ignore[assignment]
        text = new
        rule, diff = FIXES[t.code], _unified(t.rel, original, alone[id(t)].module.code)  # type: ignore[union-attr]
        for same in (t, *twin.get(id(t), ())):
            plan.fixes.append(Fix(same.finding, t.rel, t.line, edit.change, rule.exact, rule.effect,
                                  diff))  # fmt: skip
    if text != original:
        plan.files[targets[0].rel] = (original, text)


def make_plan(findings: list[Any], runs: list[list[Any]], root: Path | str) -> Plan:
    """Plan the fixes of ``findings``.

    Args:
        findings: :class:`copytrace.analysis.Finding` objects.
        runs: the event views of each run (:func:`copytrace.analysis._view.runs_of`), indexed
            by ``finding.run`` then ``finding.event_seqs``.
        root: the project root; files outside it are never touched.

    Returns:
        The :class:`Plan`; nothing is written.
    """
    root = Path(root).resolve()
    plan = Plan(root)
    by_file: dict[Path, list[Target]] = {}
    for t in _targets(findings, runs, root, plan):
        by_file.setdefault(t.path, []).append(t)
    for path in sorted(by_file):
        _fix_file(by_file[path], plan)
    plan.fixes.sort(key=lambda f: (f.rel, f.line))
    return plan
