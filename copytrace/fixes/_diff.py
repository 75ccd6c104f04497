"""A :class:`~copytrace.fixes._plan.Plan` as a unified diff that ``git apply`` and
``patch -p1`` both take, one hunk per file section with its reason above it, and the
findings left without a patch.

Each hunk is written as its own ``--- a/f`` / ``+++ b/f`` section, numbered against the file
as the sections before it left it, so that a tool applying the sections in order finds every
hunk exactly where it says; the reason line before a section header is text both tools skip.
"""

from __future__ import annotations

import difflib
from typing import Any

__all__ = ["format_diff", "format_unfixed"]

_NO_EOL = "\\ No newline at end of file\n"


def _range(start: int, stop: int) -> str:
    """A hunk range as unified diff writes it (difflib's rules)."""
    length = stop - start
    if length == 1:
        return f"{start + 1}"
    return f"{start if not length else start + 1},{length}"


def _line(prefix: str, text: str) -> str:
    return prefix + text if text.endswith("\n") else prefix + text + "\n" + _NO_EOL


def _hunks(old: str, new: str) -> list[tuple[int, int, str]]:
    """``(first old line, last old line, section body)`` of each hunk, 1-based lines."""
    a, b = old.splitlines(keepends=True), new.splitlines(keepends=True)
    out = []
    sm = difflib.SequenceMatcher(None, a, b, autojunk=False)
    for group in sm.get_grouped_opcodes(3):
        i1, i2, j1, j2 = group[0][1], group[-1][2], group[0][3], group[-1][4]
        # numbered against the file with the earlier hunks applied: their shift is j1 - i1
        body = [f"@@ -{_range(j1, j1 + i2 - i1)} +{_range(j1, j2)} @@\n"]
        for tag, k1, k2, l1, l2 in group:
            if tag == "equal":
                body += [_line(" ", x) for x in a[k1:k2]]
                continue
            body += [_line("-", x) for x in a[k1:k2]]
            body += [_line("+", x) for x in b[l1:l2]]
        changed = [op for op in group if op[0] != "equal"]
        out.append((changed[0][1] + 1, max(changed[-1][2], changed[-1][1] + 1), "".join(body)))
    return out


def format_diff(plan: Any) -> str:
    """The plan's patch: for each hunk, ``# copytrace fix: <reason>`` lines, then the section.

    Returns:
        The diff text (empty when nothing is fixed).
    """
    out = []
    for rel, (old, new) in sorted(plan.files.items()):
        fixes = [f for f in plan.fixes if f.rel == rel]
        hunks = _hunks(old, new)
        owner: dict[int, list[Any]] = {i: [] for i in range(len(hunks))}
        for f in fixes:  # the hunk that holds the fix's line, else the nearest one after it
            at = [i for i, (lo, hi, _) in enumerate(hunks) if lo - 3 <= f.line <= hi + 3]
            after = [i for i, (lo, _, _) in enumerate(hunks) if lo >= f.line]
            owner[(at or after or [len(hunks) - 1])[0]].append(f)
        for i, (_, _, body) in enumerate(hunks):
            reasons = owner[i] or [f for f in fixes if f.line > hunks[i][0]][:1] or fixes[:1]
            for reason in dict.fromkeys(f.reason() for f in reasons):  # a line's twins once
                out.append(f"# copytrace fix: {reason}\n")
            out.append(f"--- a/{rel}\n+++ b/{rel}\n{body}")
    return "".join(out)


def format_unfixed(plan: Any) -> str:
    """One block per finding left without a patch: where, why, and its advice."""
    lines = []
    for u in plan.unfixed:
        f = u.finding
        where = f.call_sites[0] if f.call_sites else "(unknown call site)"
        lines.append(f"# no patch: {f.code} at {where}: {u.reason}\n#   advice: {f.fix}\n")
    return "".join(lines)
