"""Match the call sites of two runs across edits of the source.

A call site is ``(file, line, function)``. Adding three lines at the top of a file moves
every site below it; that must not read as every site removed and added again. Sites are
matched, in passes, each on what the earlier passes left:

1. same file, same function, same normalised source text (:func:`._source.normalize`):
   the k-th such site in BASE (by line) with the k-th in NEW, so a duplicated line matches
   its original and the copy shows as added;
2. same file and text, any function (a renamed function: one that NEW's file no longer
   defines, when that file can be read), again in line order;
3. same file, function and line (the fallback when a text is unknown or ambiguous:
   a file edited after BASE was traced, with no snapshot of its lines, or a line edited
   where it stood);
4. same file and function, in line order, when BASE's texts are unknown for the remaining
   sites of that function and both runs have as many of them (lines moved, text not kept);
5. same file and function, texts alike (a line edited in place: a changed dtype).

Files are the same when their paths are equal, or else when their path suffixes match
one file only (two checkouts of one repository).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable

from copytrace.analysis.diff._source import normalize

__all__ = ["match_sites", "file_map"]

Site = tuple[str, int, str]


def _parts(path: str) -> list[str]:
    return path.replace("\\", "/").split("/")


def file_map(base: Iterable[str], new: Iterable[str]) -> dict[str, str]:
    """BASE file -> NEW file: equal paths, else the one NEW file with the longest common
    path suffix (at least the file name), when that is unique."""
    new = sorted(set(new))
    out: dict[str, str] = {}
    for b in sorted(set(base)):
        if b in new:
            out[b] = b
            continue
        best, score, tie = None, 0, False
        bp = _parts(b)
        for n in new:
            np_ = _parts(n)
            k = 0
            while k < min(len(bp), len(np_)) and bp[-1 - k] == np_[-1 - k]:
                k += 1
            if k > score:
                best, score, tie = n, k, False
            elif k == score and k:
                tie = True
        if best is not None and not tie:
            out[b] = best
    return out


def _pair_by(
    base: list[Site],
    new: list[Site],
    key_b: Callable[[Site], object | None],
    key_n: Callable[[Site], object | None],
    pairs: dict[Site, Site],
) -> None:
    """Pair the unmatched sites whose keys are equal (not None), in line order."""
    groups_b: dict[object, list[Site]] = defaultdict(list)
    groups_n: dict[object, list[Site]] = defaultdict(list)
    taken = set(pairs.values())
    for s in base:
        k = key_b(s) if s not in pairs else None
        if k is not None:
            groups_b[k].append(s)
    for s in new:
        k = key_n(s) if s not in taken else None
        if k is not None:
            groups_n[k].append(s)
    for k, bs in groups_b.items():
        ns = sorted(groups_n.get(k, ()), key=lambda s: s[1])
        for b, n in zip(sorted(bs, key=lambda s: s[1]), ns, strict=False):
            pairs[b] = n


def match_sites(
    base: Iterable[Site],
    new: Iterable[Site],
    base_text: dict[Site, str],
    new_text: dict[Site, str],
    new_defs: dict[str, set[str]] | None = None,
) -> dict[Site, Site]:
    """BASE site -> NEW site for the sites that are the same code (see the module doc).

    Args:
        base, new: The call sites of each run.
        base_text, new_text: Their source lines where known.
        new_defs: Per NEW file, the functions it defines, where known: a BASE function
            still defined in NEW was not renamed, so pass 2 leaves its sites alone.

    Returns:
        The pairs; a BASE site not in it was removed, a NEW site not among its values added.
    """
    base, new = sorted(set(base)), sorted(set(new))
    fmap = file_map((s[0] for s in base), (s[0] for s in new))
    bt = {s: normalize(t) for s, t in base_text.items() if t.strip()}
    nt = {s: normalize(t) for s, t in new_text.items() if t.strip()}
    pairs: dict[Site, Site] = {}
    f = fmap.get  # a BASE file in NEW's terms
    defs = new_defs or {}
    kept = lambda s: s[2] in defs.get(f(s[0]) or "", ())  # noqa: E731 - not renamed
    passes: list[tuple[Callable[[Site], object | None], Callable[[Site], object | None]]] = [
        (lambda s: (f(s[0]), s[2], bt[s]) if f(s[0]) and s in bt else None,
         lambda s: (s[0], s[2], nt[s]) if s in nt else None),
        (lambda s: (f(s[0]), bt[s]) if f(s[0]) and s in bt and not kept(s) else None,
         lambda s: (s[0], nt[s]) if s in nt else None),
        (lambda s: (f(s[0]), s[2], s[1]) if f(s[0]) else None,
         lambda s: (s[0], s[2], s[1])),
    ]  # fmt: skip
    for key_b, key_n in passes:
        _pair_by(base, new, key_b, key_n, pairs)
    _pair_unknown_by_order(base, new, bt, lambda s: f(s[0]), pairs)
    _pair_edited(base, new, bt, nt, lambda s: f(s[0]), pairs)
    return pairs


#: Pass 5's least similarity of two normalised lines (difflib's ratio).
SIMILAR = 0.8


def _pair_edited(
    base: list[Site],
    new: list[Site],
    bt: dict[Site, str],
    nt: dict[Site, str],
    f: Callable[[Site], str | None],
    pairs: dict[Site, Site],
) -> None:
    """Pass 5: a line edited in place (``.to(torch.float64)`` -> ``.to(torch.float16)``):
    within one file and function, the remaining sites whose texts are at least
    :data:`SIMILAR` alike, most alike first."""
    import difflib

    taken = set(pairs.values())
    left_n = [s for s in new if s not in taken and s in nt]
    scored = []
    for b in base:
        if b in pairs or b not in bt or not f(b):
            continue
        for n in left_n:
            if (f(b), b[2]) == (n[0], n[2]):
                r = difflib.SequenceMatcher(None, bt[b], nt[n]).ratio()
                if r >= SIMILAR:
                    scored.append((-r, abs(b[1] - n[1]), b, n))
    used: set[Site] = set()
    for _r, _d, b, n in sorted(scored):
        if b not in pairs and n not in used:
            pairs[b] = n
            used.add(n)


def _pair_unknown_by_order(
    base: list[Site],
    new: list[Site],
    bt: dict[Site, str],
    f: Callable[[Site], str | None],
    pairs: dict[Site, Site],
) -> None:
    """Pass 4: within one file and function, the remaining BASE sites without a known text
    paired with the remaining NEW sites, in line order, when both have the same number."""
    taken = set(pairs.values())
    left_b: dict[tuple[str, str], list[Site]] = defaultdict(list)
    left_n: dict[tuple[str, str], list[Site]] = defaultdict(list)
    for s in base:
        if s not in pairs and s not in bt and f(s):
            left_b[(f(s), s[2])].append(s)  # type: ignore[index]
    for s in new:
        if s not in taken:
            left_n[(s[0], s[2])].append(s)
    for k, bs in left_b.items():
        ns = left_n.get(k, [])
        if len(ns) == len(bs):
            ordered = sorted(ns, key=lambda s: s[1])
            for b, n in zip(sorted(bs, key=lambda s: s[1]), ordered, strict=True):
                pairs[b] = n
