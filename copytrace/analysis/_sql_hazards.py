"""The hazard rules as SQL over a dataset's events, in DuckDB's dialect (Spark runs the same
text transpiled by SQLGlot: :mod:`copytrace.analysis._sql`).

The view ``hz`` (:data:`HZ_SQL`) holds every event of the table ``events`` (deepcopy groups
included) as the in-process rules read it (:class:`~copytrace.analysis._columns.RunColumns`):
``seq`` its position in its run (start, end, span id), absent flags false, ``step`` 0 when
absent (``step_id``: as recorded, for the keys where an absent step is a value of its own),
``site`` ``file:line function`` or null, ``ok`` (not a group, no error), ``in_group`` (a
deepcopy group's child). :data:`HAZARDS_SQL` returns one row per finding,
``(code, run, site, events, bytes)``: ``site`` the finding's own call sites joined by ``"; "``
(``(unknown call site)`` without one; library call sites are not named), ``events`` the number
of events it names, ``bytes`` its bytes at stake; rows sorted on every column.

Each rule follows its in-process form (:mod:`copytrace.analysis._rules`,
:mod:`copytrace.analysis._joins`, :mod:`copytrace.analysis._pairs`), thresholds and
tie-breaking included: a pair's first event is the *last* event of the run whose result
storage is the second one's source (a dictionary keyed by storage, filled over the whole run),
and the pair holds only when that event comes first, in the same step, and the second read the
version it made. ``tests/test_hazard_diff.py`` checks the rows against the in-process findings.
"""

from __future__ import annotations

from copytrace.analysis._evidence import (
    _WIDER,
    CONVERSION_OPS,
    HOT_DENSITY,
    HOT_MIN_STEPS,
    OWN_RULE,
)
from copytrace.analysis._findings import HAZARDS
from copytrace.analysis._rules import ALIAS_WRITE_OPS, INDEX_OPS

__all__ = ["HAZARDS_SQL", "HZ_SQL", "SQL_CODES"]

_NO_SITE = "(unknown call site)"


def _in(values: object) -> str:
    return "(" + ", ".join(f"'{v}'" for v in sorted(values)) + ")"  # type: ignore[attr-defined]


def _list_key(col: str) -> str:
    """A list column as text, an absent list as an empty one (equal lists, equal texts)."""
    return f"CASE WHEN COALESCE(array_length(e.{col}), 0) > 0 THEN CAST(e.{col} AS VARCHAR) ELSE '' END"


#: The view ``hz`` over the dataset's table ``events`` (see the module docstring).
HZ_SQL = f"""
SELECT e.run,
  row_number() OVER (PARTITION BY e.run ORDER BY e.start_ns, e.end_ns, e.span_id) AS seq,
  COALESCE(e.step, 0) AS step, e.step AS step_id, e.op,
  CASE WHEN e.file IS NULL OR e.file = '' THEN NULL ELSE e.file
    || COALESCE(':' || CAST(e.line AS VARCHAR), '')
    || COALESCE(' ' || NULLIF(e.function, ''), '') END AS site,
  COALESCE(e."group", FALSE) AS grp, COALESCE(e.alias, FALSE) AS alias,
  COALESCE(e.noop, FALSE) AS noop, COALESCE(e.error, '') = '' AS noerr,
  NOT COALESCE(e."group", FALSE) AND COALESCE(e.error, '') = '' AS ok,
  COALESCE(e.via, '') <> '' AS via_set, COALESCE(e.recompute, FALSE) AS recompute,
  COALESCE(e.bytes_allocated, 0) AS ba, COALESCE(e.bytes_logical, 0) AS bl,
  e.src_storage, e.dst_storage, e.src_offset, e.src_version, e.dst_version,
  {_list_key("src_stride")} AS stride_k, {_list_key("shape")} AS shape_k,
  e.dtype, e.src_dtype, e.dst_device, COALESCE(e.transfer, 'none') AS transfer,
  COALESCE(e.non_blocking, FALSE) AS non_blocking, e.pinned, e.graph,
  COALESCE(e.inplace_writes, 0) <> 0 AS written, COALESCE(e.autocast_nocache, FALSE) AS nocache,
  COALESCE(e.retained_bytes, 0) AS retained, NULLIF(e.grad_fn, '') AS grad_fn, e.src_name, NULLIF(e.write_site, '') AS write_site,
  NULLIF(e.load_site, '') AS load_site, NULLIF(e.origin, '') AS origin, e.module, e.phase,
  COALESCE(e.snapshot, FALSE) AS snapshot, COALESCE(e.stale, FALSE) AS stale,
  COALESCE(array_length(e.saved_by), 0) > 0 AS saved, g.span_id IS NOT NULL AS in_group
FROM events AS e
LEFT JOIN (SELECT run, span_id FROM events WHERE COALESCE("group", FALSE)) AS g
  ON g.run = e.run AND g.span_id = e.parent_id
"""


def _two(first: str, second: str) -> str:
    """The call sites ``first``, ``second`` (null: none) as a label: each once, in order."""
    return (f"CASE WHEN {first} IS NULL THEN {second} WHEN {second} IS NULL OR {second} = "
            f"{first} THEN {first} ELSE {first} || '; ' || {second} END")  # fmt: skip


def _key(*cols: str) -> str:
    """Columns as one text key (a null differs from every text)."""
    return " || chr(31) || ".join(f"COALESCE({c}, chr(0))" for c in cols)


_OK = "ok"
#: the rules that are filters and group-bys: code -> (where, keys, label at a row, bytes)
_GROUPED = {
    "data-inplace": (f"op IN {_in(('data_get', 'data_set'))} AND saved",
                     "CAST(seq AS VARCHAR)", _two("COALESCE(write_site, site)", "site"), "bl"),
    "lost-inplace-write": (f"op IN {_in(INDEX_OPS)} AND write_site IS NOT NULL AND {_OK}",
                           _key("write_site", "site"), _two("write_site", "site"), "bl"),
    "graph-retaining-copy": ("NOT grp AND retained > 0", _key("site"), "site", "retained"),
    "alias-write": (f"op IN {_in(ALIAS_WRITE_OPS)} AND alias AND write_site IS NOT NULL AND {_OK}",
                    _key("write_site", "site"), _two("write_site", "site"), "bl"),
    "deepcopy-nonleaf": ("op = 'deepcopy' AND NOT grp AND NOT noerr AND grad_fn IS NOT NULL",
                         _key("site", "src_name"), "site", "bl"),
    "stale-kept-copy": ("stale AND NOT snapshot AND phase = 'backward'",
                        _key("origin", "module"), _two("origin", "site"), "bl"),
    "pageable-transfer": (f"transfer = 'h2d' AND COALESCE(op, '') <> 'implicit' AND {_OK} AND "
                          "NOT non_blocking AND pinned = FALSE", _key("site"), "site", "bl"),
    "deepcopy-in-loop": ("op = 'deepcopy' AND noerr AND (grp OR NOT in_group)", _key("site"),
                         "site", "ba"),
    "tensor-ctor-copy": (f"op IN {_in(OWN_RULE)} AND {_OK} AND NOT via_set", _key("site"), "site",
                         "ba"),
    "noop-conversion": (f"noop AND op IN {_in(CONVERSION_OPS)} AND {_OK} AND NOT via_set",
                        _key("site", "op"), "site", "0"),
}  # fmt: skip
#: the rules whose groups count only when their steps are hot (_evidence.is_hot)
_HOT = ("pageable-transfer", "deepcopy-in-loop", "noop-conversion")

# --- the pair rules (copytrace.analysis._joins) -----------------------------------------------
_COPIES = (
    f"{_OK} AND NOT alias AND NOT noop AND ba > 0 AND src_storage IS NOT NULL AND src_version "
    "IS NOT NULL AND COALESCE(op, '') NOT IN ('copy_', 'deepcopy') AND NOT via_set AND NOT "
    "recompute"
)
#: rule -> (its first events, its second events, what a pair must hold besides: a first, in
#: the same step, the second's source the first's result storage)
_PAIRS = {
    # redundant-copy (b): a copy of a fresh copy on one line, not a round trip, not a first cast
    # that narrows the dtype
    "redundant-copy": (_COPIES, _COPIES,
        "b.src_version = a.dst_version AND a.site IS NOT NULL AND a.site = b.site AND NOT "
        "(a.transfer = 'h2d' AND b.transfer = 'd2h' OR a.transfer = 'd2h' AND b.transfer = "
        "'h2d') AND (COALESCE(a.src_dtype, '') = '' OR COALESCE(a.dtype, '') = '' OR "
        "a.src_dtype = a.dtype OR a.src_dtype || '>' || a.dtype IN "
        + _in(f"{s}>{d}" for s, wider in _WIDER.items() for d in wider) + ")"),
    "round-trip": (
        f"transfer IN ('h2d', 'd2h') AND {_OK} AND NOT alias AND src_storage IS NOT NULL",
        f"transfer IN ('h2d', 'd2h') AND {_OK} AND NOT alias AND src_storage IS NOT NULL",
        "b.src_version IS NOT NULL AND b.src_version = a.dst_version AND a.transfer <> "
        "b.transfer"),
    "clone-detach-order": (f"op = 'clone' AND graph = 'attached' AND {_OK} AND NOT alias",
                           "op IN ('detach', 'detach_') AND noerr AND NOT via_set",
                           "b.src_version IS NOT DISTINCT FROM a.dst_version AND "
                           "a.site IS NOT NULL AND a.site = b.site"),
}  # fmt: skip
_A_COLS = "run, seq, step, site, dst_storage, dst_version, transfer, src_dtype, dtype, ba"
_B_COLS = "run, seq, step, site, src_storage, src_version, transfer, bl"
_SAME_SOURCE = ("run, step_id, src_storage, src_offset, stride_k, shape_k, src_version, dtype, "
                "dst_device")  # fmt: skip
_CASTS = "run, step_id, src_storage, src_version, dtype"


def _union(selects: list[str]) -> str:
    return "\n  UNION ALL ".join(selects)


def _ctes() -> str:
    a_ends = _union([f"SELECT '{r}' AS rule, {_A_COLS} FROM hz WHERE {a} AND dst_storage IS NOT "
                     "NULL" for r, (a, _b, _h) in _PAIRS.items()])  # fmt: skip
    b_ends = _union([f"SELECT '{r}' AS rule, {_B_COLS} FROM hz WHERE {b}"
                     for r, (_a, b, _h) in _PAIRS.items()])  # fmt: skip
    holds = " OR ".join(f"a.rule = '{r}' AND ({h})" for r, (_a, _b, h) in _PAIRS.items())
    trip = "a.rule = 'round-trip'"
    return f"""
-- a pair's first event: the last of the run with that result storage
a_ends AS (SELECT * FROM (SELECT x.*, row_number() OVER (PARTITION BY rule, run, dst_storage
  ORDER BY seq DESC) AS k FROM ({a_ends}) AS x) AS y WHERE k = 1),
pairs AS (SELECT a.rule, a.run, a.step, a.seq AS a_seq, b.seq AS b_seq,
  CASE WHEN {trip} THEN {_key("a.site", "b.site")} ELSE 'pair' || chr(31) || a.site END AS key,
  CASE WHEN {trip} THEN {_two("a.site", "b.site")} ELSE a.site END AS label,
  CASE WHEN {trip} THEN 0 ELSE a.ba END AS a_nb, CASE WHEN {trip} THEN b.bl ELSE 0 END AS b_nb
  FROM a_ends AS a JOIN ({b_ends}) AS b
    ON b.rule = a.rule AND b.run = a.run AND b.src_storage = a.dst_storage
  WHERE a.seq < b.seq AND a.step = b.step AND ({holds})),
-- redundant-copy (a): the same unchanged source copied again in a step, one finding per set
-- of call sites; its label: the sites of its first group, by first event
same AS (SELECT * FROM (SELECT run, seq, step, site, ba,
  count(*) OVER (PARTITION BY {_SAME_SOURCE}) AS n, min(seq) OVER (PARTITION BY {_SAME_SOURCE}) AS g
  FROM hz WHERE {_COPIES} AND NOT written AND COALESCE(op, '') NOT IN {_in(OWN_RULE)}) AS r
  WHERE n > 1),
same_groups AS (SELECT run, g,
  string_agg(COALESCE(site, ''), chr(31) ORDER BY COALESCE(site, '')) AS sset,
  string_agg(site, '; ' ORDER BY first) AS label
  FROM (SELECT run, g, site, min(seq) AS first FROM same GROUP BY run, g, site) AS d
  GROUP BY run, g),
-- redundant-copy (c): autocast's casts of the same unchanged weight in a step, its cache off
casts AS (SELECT * FROM (SELECT run, seq, step, site, ba,
  count(*) OVER (PARTITION BY {_CASTS}) AS n,
  row_number() OVER (PARTITION BY {_CASTS} ORDER BY seq) AS k
  FROM hz WHERE ok AND nocache AND src_storage IS NOT NULL AND src_version IS NOT NULL) AS r
  WHERE n > 1),
-- aliasing-snapshot: grouped by the load that made the aliases (else the line); its label:
-- each event's load and line, in event order, each once
snaps AS (SELECT run, seq, step, COALESCE(load_site, site) AS key, load_site, site, bl
  FROM hz WHERE snapshot AND stale),
snap_labels AS (SELECT run, key, string_agg(s, '; ' ORDER BY o) AS label FROM (
  SELECT run, key, s, min(o) AS o FROM (
    SELECT run, key, CASE WHEN e.side = 0 THEN load_site ELSE site END AS s,
      2 * seq + e.side AS o FROM snaps CROSS JOIN (VALUES (0), (1)) AS e(side)) AS u
  WHERE s IS NOT NULL GROUP BY run, key, s) AS d GROUP BY run, key)"""


def _rows() -> str:
    """Every event of every finding: ``(code, run, key, seq, step, label, nb)``."""
    grouped = [f"SELECT '{code}' AS code, run, {key} AS key, seq, step, {label} AS label, "
               f"{nb} AS nb FROM hz WHERE {where}"
               for code, (where, key, label, nb) in _GROUPED.items()]  # fmt: skip
    return _union([
        *grouped,
        # both ends of each pair, from one read of the pairs
        "SELECT p.rule, p.run, p.key, CASE WHEN e.side = 0 THEN p.a_seq ELSE p.b_seq END, p.step, "
        "p.label, CASE WHEN e.side = 0 THEN p.a_nb ELSE p.b_nb END FROM pairs AS p "
        "CROSS JOIN (VALUES (0), (1)) AS e(side)",
        "SELECT 'redundant-copy', s.run, 'same' || chr(31) || x.sset, s.seq, s.step, x.label, "
        "CASE WHEN s.seq = s.g THEN 0 ELSE s.ba END FROM same AS s "
        "JOIN same_groups AS x ON x.run = s.run AND x.g = s.g",
        f"SELECT 'redundant-copy', run, 'cast' || chr(31) || {_key('site')}, seq, step, site, "
        "CASE WHEN k = 1 THEN 0 ELSE ba END FROM casts",
        f"SELECT 'aliasing-snapshot', s.run, {_key('s.key')}, s.seq, s.step, l.label, s.bl "
        "FROM snaps AS s LEFT JOIN snap_labels AS l ON l.run = s.run AND l.key = s.key",
    ])  # fmt: skip


#: The hazard codes :data:`HAZARDS_SQL` computes.
SQL_CODES = tuple(c for c in HAZARDS if c in {*_GROUPED, *_PAIRS, "aliasing-snapshot"})

_N = "count(DISTINCT step)"
#: The findings of every rule, one row each: ``(code, run, site, events, bytes)``, sorted; a
#: finding's label is read at its first event.
HAZARDS_SQL = f"""WITH {_ctes()},
rows AS ({_rows()})
SELECT code, run, COALESCE(min(struct_pack(s := seq, l := label)).l, '{_NO_SITE}') AS site,
  count(DISTINCT seq) AS events, sum(nb) AS bytes
FROM rows GROUP BY code, run, key
HAVING code NOT IN {_in(_HOT)}
  OR {_N} >= {HOT_MIN_STEPS} AND {_N} >= {HOT_DENSITY} * (max(step) - min(step) + 1)
ORDER BY 1, 2, 3, 4, 5"""
