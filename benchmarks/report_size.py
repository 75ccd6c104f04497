"""Report, summary and check times, peak memory and report size on generated traces.

Usage::

    python benchmarks/report_size.py                       # 10k, 100k, 1M events
    python benchmarks/report_size.py --events 1000000 --ranks 1
    python benchmarks/report_size.py --events 10000000 --ranks 64 --mix friendly --jobs 2

The last is the many-ranks scenario: 10M events over 64 rank files (``copytrace.rank`` 0-63
in each file's resource), written ``--jobs`` files at a time (writing 10M events through the
file sink takes about 10 CPU-minutes); ``summary`` and ``report`` are its goal.

For each size it writes a synthetic trace as the tracer writes it (its file sink: plain
OTLP/JSON lines and the columnar sidecar, flushed every ~4096 events at a step boundary,
then the ``copytrace.hazards`` span appended as at stop): a training-loop mix of no-op
``.to()`` calls, ``detach`` aliases, clones, host-to-device and device-to-host copies,
``copy_``, deepcopy, in several modules and call sites, 100 events per step; split over
``--ranks`` files. Then it times, each in a fresh subprocess: one naive pass of stdlib
``json.loads`` over every line (the reference), ``copytrace report`` (from the sidecars),
``copytrace summary`` and ``copytrace check``, with their peak memory and the report's size;
and, up to 1M events, the same files without their sidecars (hard links): ``copytrace
report`` parsing the JSON (it writes the Parquet cache), then again from that cache.
Not a test: it only prints numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

T0 = 1_750_000_000_000_000_000
EVENTS_PER_STEP = 100
STEP_NS = 20_000_000  # 20 ms per step
SPANS_PER_LINE = 4000

# (weight, op, kind, bytes per element * numel, shape, src, dst, transfer, module, file, line,
#  func, phase, graph, aten)
# fmt: off
_TEMPLATES = [
    (40, "to", "noop", 26368, [103, 64], "cuda:0", "cuda:0", "none", "", "train.py", 176, "main",
     "other", "none", []),
    (12, "detach", "alias", 4, [], "cuda:0", "cuda:0", "none", "", "train.py", 181, "main",
     "other", "detached", ["aten::detach"]),
    (8, "contiguous", "noop", 262144, [16, 64, 64], "cuda:0", "cuda:0", "none",
     "model.blocks.{b}.attn", "model.py", 58, "forward", "forward", "attached", []),
    (6, "to", "copy", 8192, [16, 64], "cpu", "cuda:0", "h2d", "", "train.py", 170, "main",
     "other", "none", ["aten::_to_copy", "aten::copy_"]),
    (5, "clone", "copy", 262144, [16, 64, 256], "cuda:0", "cuda:0", "none",
     "model.blocks.{b}.mlp", "model.py", 77, "forward", "forward", "attached", ["aten::clone"]),
    (4, "contiguous", "copy", 1048576, [16, 64, 256], "cuda:0", "cuda:0", "none",
     "model.blocks.{b}.attn", "model.py", 61, "forward", "backward", "attached",
     ["aten::clone"]),
    (3, "cpu", "copy", 4, [], "cuda:0", "cpu", "d2h", "", "train.py", 190, "main", "other",
     "none", ["aten::_to_copy", "aten::copy_"]),
    (3, "copy_", "copy", 65536, [64, 256], "cuda:0", "cuda:0", "none", "", "ema.py", 12,
     "update", "optimizer", "none", ["aten::copy_"]),
    (2, "float", "copy", 131072, [16, 64, 64], "cuda:0", "cuda:0", "none", "model.head",
     "model.py", 95, "forward", "forward", "attached", ["aten::_to_copy"]),
    (1, "deepcopy", "copy", 4194304, [1024, 1024], "cuda:0", "cuda:0", "none", "", "train.py",
     199, "main", "other", "none", ["aten::clone"]),
    (1, "to", "copy", 33554432, [2048, 4096], "cuda:0", "cuda:1", "d2d", "", "train.py", 210,
     "main", "other", "none", ["aten::_to_copy", "aten::copy_"]),
]
# fmt: on


def _template_events() -> list[tuple[int, dict]]:
    """(weight, CopyEvent fields without seq, step and times) per variant."""
    out = []
    for (weight, op, kind, nbytes, shape, src, dst, transfer, module, file, line, func, phase,
         graph, aten) in _TEMPLATES:  # fmt: skip
        for b in range(2) if "{b}" in module else [None]:
            fields = {
                "op": op, "aten": tuple(aten), "dtype": "float32", "src_dtype": "float32",
                "src_device": src, "dst_device": dst, "transfer": transfer,
                "bytes_allocated": nbytes if kind == "copy" and op != "copy_" else 0,
                "bytes_logical": nbytes, "alias": kind != "copy", "noop": kind == "noop",
                "non_blocking": transfer == "h2d", "requires_grad": graph == "attached",
                "graph": graph, "phase": phase, "shape": tuple(shape),
                "module": (module.format(b=b) if b is not None else module) or None,
                "file": f"/home/user/project/{file}", "line": line, "function": func,
                "thread_id": 140607661808512, "thread_name": "MainThread",
            }  # fmt: skip
            out.append((weight, fields))
    return out


#: ``--mix`` choices: the training-loop mix above; every event a pair-rule candidate
#: (``y = x.clone().detach().to(torch.float16)`` 33 times per step, as the tracer records
#: it: the clone, the detach of the clone, the cast of the detached clone, all on one line);
#: the training-loop mix with every event at its own call site.
MIXES = ("friendly", "pairs", "sites")
PAIRS_PER_STEP = 33


def _pairs_events(i: int) -> tuple[int, dict]:
    """Event ``i`` of the ``pairs`` mix: (step, CopyEvent fields without seq and times)."""
    step, within = divmod(i, 3 * PAIRS_PER_STEP)
    k, which = divmod(within, 3)
    clone = 2 + 2 * (step * PAIRS_PER_STEP + k)  # storage ids as the tracer numbers them
    common = {"dtype": "float32", "src_dtype": "float32", "src_device": "cuda:0",
              "dst_device": "cuda:0", "transfer": "none", "shape": (64, 64),
              "src_stride": (64, 1), "phase": "other", "file": "/home/user/project/train.py",
              "line": 176, "function": "main", "thread_id": 140607661808512,
              "thread_name": "MainThread", "bytes_logical": 16384}  # fmt: skip
    if which == 0:  # x.clone(): x (storage 1) changes once per step (optimizer.step)
        fields = {"op": "clone", "aten": ("aten::clone",), "graph": "attached",
                  "grad_fn": "CloneBackward0", "requires_grad": True,
                  "src_requires_grad": True, "bytes_allocated": 16384, "src_storage": 1,
                  "src_version": step, "dst_storage": clone, "dst_version": 0}  # fmt: skip
    elif which == 1:  # .detach() of the clone: an alias
        fields = {"op": "detach", "aten": ("aten::detach",), "graph": "detached",
                  "alias": True, "src_requires_grad": True, "src_storage": clone,
                  "src_version": 0, "dst_storage": clone, "dst_version": 0}  # fmt: skip
    else:  # .to(torch.float16) of the detached clone
        fields = {"op": "to", "aten": ("aten::_to_copy",), "graph": "none",
                  "bytes_allocated": 8192, "src_storage": clone, "src_version": 0,
                  "dst_storage": clone + 1, "dst_version": 0, "dtype": "float16"}  # fmt: skip
        fields["bytes_logical"] = 8192
    return step, {**common, **fields}


def _event(mix: str, i: int, ti: int, tpls: list, start: int, step: int) -> Any:
    """CopyEvent ``i`` of ``mix`` (``ti``: its template in the training-loop mix)."""
    from copytrace.schema import CopyEvent

    end = start + 2_000 + (ti * 7919 + i) % 40_000
    if mix == "pairs":
        _, fields = _pairs_events(i)
    elif mix == "sites":  # a call site of its own: 100 files of 10,000 lines
        fields = {**tpls[ti][1], "file": f"/home/user/project/gen_{i % 100}.py",
                  "line": 1 + i // 100}  # fmt: skip
    else:
        fields = tpls[ti][1]
    return CopyEvent(seq=i, step=step, start_ns=start, end_ns=end, **fields)


def generate_trace(
    path: Path,
    n_events: int,
    seed: int = 0,
    pid: int = 4242,
    mix: str = "friendly",
    resource_attrs: dict[str, Any] | None = None,
) -> None:
    """Write a synthetic trace of ``n_events`` events as the tracer writes it: its file sink
    (plain OTLP/JSON and the columnar sidecar), flushed at the first step boundary with
    4096 events buffered, then the ``copytrace.hazards`` span appended as at stop.

    Args:
        path: File to write (``*.otlp.jsonl``).
        n_events: Event spans to write.
        seed: Random seed for the mix of events.
        pid: ``process.pid`` of the run.
        mix: one of :data:`MIXES`.
        resource_attrs: more resource attributes (``copytrace.rank``...).
    """
    from opentelemetry.sdk.resources import Resource

    from copytrace.export.file_sink import FileSink
    from copytrace.export.hazard_span import append_hazard_span
    from copytrace.export.pipeline import Chunk, ExportPipeline, RunEnd, RunIds, expand
    rng = random.Random(seed)
    tpls = _template_events()
    choice = rng.choices(range(len(tpls)), weights=[w for w, _ in tpls], k=n_events)
    per_step = 3 * PAIRS_PER_STEP if mix == "pairs" else EVENTS_PER_STEP
    n_steps = max(3, -(-n_events // per_step))
    resource = Resource({"service.name": "copytrace", "process.pid": pid, "host.name": "bench",
                         "process.command_args": ["train.py", "--synthetic", str(n_events)],
                         **(resource_attrs or {})})
    run = RunIds(0, T0, resource)
    hazard_ids: list[str] = []

    class _Sink(FileSink):  # notes the span ids of the d2h copies, for the hazard
        def write(self, items, chunk, keep):  # type: ignore[no-untyped-def]
            items = list(items)  # PlanItems, and PlanRuns (blocks of plain copies) as they are
            for sid, _, ev, _ in expand(items):
                if ev is not None and ev.op == "cpu" and len(hazard_ids) < 1000:
                    hazard_ids.append(sid)
            super().write(items, chunk, keep)

    sink = _Sink(path, compression=None)
    pipe = ExportPipeline(run, [sink])
    pipe.begin()
    events: list = []
    steps: list[tuple[int, int, int]] = []
    i = 0
    for step in range(n_steps):
        for within in range(per_step if step < n_steps - 1 else n_events - i):
            if i >= n_events:
                break
            start = step * STEP_NS + 50_000 + within * (STEP_NS - 100_000) // per_step
            events.append(_event(mix, i, choice[i], tpls, start, step))
            i += 1
        steps.append((step, step * STEP_NS, (step + 1) * STEP_NS))
        if len(events) >= 4096:
            pipe.write_now(Chunk(events, steps))
            events, steps = [], []
    end = n_steps * STEP_NS
    attrs = {"copytrace.version": "0.1.0", "copytrace.torch_version": "2.13.0",
             "copytrace.events": n_events, "copytrace.events_dropped": 0, "copytrace.errors": 0,
             "copytrace.internal_detaches": 0, "copytrace.steps": n_steps,
             "copytrace.overhead_ns": n_events * 9_000}  # fmt: skip
    pipe.close(Chunk(events, steps, final=RunEnd(end, attrs)))
    finding = dict(
        code="CT-SYNC-D2H", severity="warning",
        message="device-to-host copy every step synchronises the GPU",
        fix="accumulate on the device; call .item() once per log",
        call_sites=["/home/user/project/train.py:190 main"], bytes=4 * len(hazard_ids),
        span_ids=hazard_ids,
    )  # fmt: skip
    append_hazard_span(path, None, run, end, [finding])


def _measure(argv: list[str]) -> dict:
    """Run ``argv`` (a reference pass or a copytrace command) in this process; return its
    wall time (s) and this process's peak memory (MiB)."""
    t0 = time.perf_counter()
    if argv[0] == "naive-json":
        n = 0
        for f in sorted(Path(argv[1]).glob("*.otlp.jsonl")):
            with f.open("rb") as fh:
                for line in fh:
                    json.loads(line)
                    n += 1
    else:
        from copytrace.cli import main as cli_main
        from copytrace.cli import skip_pandas

        skip_pandas(argv)  # as the console script does
        with open(os.devnull, "w") as null:
            import contextlib

            with contextlib.redirect_stdout(null):
                code = cli_main(argv)
        if code not in (0, 1):
            raise SystemExit(f"{argv}: exit {code}")
    wall = time.perf_counter() - t0
    use = resource.getrusage(resource.RUSAGE_SELF)
    return {"s": wall, "cpu_s": use.ru_utime + use.ru_stime, "peak_mib": _peak_mib()}


def _peak_mib() -> float:
    """This process's peak resident memory (MiB): ``VmHWM``, which starts afresh at exec
    (``ru_maxrss`` keeps the parent's peak across fork and exec)."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _child(argv: list[str]) -> dict:
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, __file__, "--measure", *argv],
        capture_output=True, text=True, env=env, check=False,
    )  # fmt: skip
    if proc.returncode != 0:
        raise SystemExit(proc.stderr)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _mib(n: float) -> str:
    return f"{n / (1 << 20):,.1f} MiB"


def _json_only(trace_dir: Path) -> Path:
    """The same trace files without their sidecars (hard links), no cache."""
    out = trace_dir.with_name(trace_dir.name + "-json")
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    for f in trace_dir.glob("*.otlp.jsonl"):
        os.link(f, out / f.name)
    return out


def _rank_file(job: tuple[Path, int, int, int, str]) -> float:
    """Write rank ``r``'s file of ``n`` events (one job of :func:`_write_ranks`); return the
    seconds it took."""
    path, n, r, ranks, mix = job
    t0 = time.perf_counter()
    attrs = {"copytrace.rank": r, "copytrace.world_size": ranks} if ranks > 1 else None
    generate_trace(path, n, seed=r, pid=4242 + r, mix=mix, resource_attrs=attrs)
    return time.perf_counter() - t0


def _write_ranks(trace_dir: Path, n: int, ranks: int, mix: str, jobs: int) -> None:
    """The rank files of ``trace_dir`` that are missing, ``jobs`` at a time."""
    todo = [(trace_dir / f"copytrace-bench-{r}.otlp.jsonl", n // ranks, r, ranks, mix)
            for r in range(ranks)]  # fmt: skip
    todo = [job for job in todo if not job[0].exists()]
    if not todo:
        return
    t0 = time.perf_counter()
    if jobs > 1:
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(jobs) as pool:
            spent = sum(pool.map(_rank_file, todo))
    else:
        spent = sum(_rank_file(job) for job in todo)
    print(f"# wrote {len(todo)} file(s) of {mix}, {n:,} events: "
          f"{time.perf_counter() - t0:.0f} s ({spent:.0f} s of workers)", flush=True)  # fmt: skip


def _row(n: int, ranks: int, work: Path, hazards: bool = True, mix: str = "friendly",
         jobs: int = 1, no_json: bool = False) -> dict:  # fmt: skip
    """Measure one size and mix; return the figures and the printed row."""
    trace_dir = work / f"bench-{mix}-{n}x{ranks}"
    trace_dir.mkdir(parents=True, exist_ok=True)
    _write_ranks(trace_dir, n, ranks, mix, jobs)
    for cache in trace_dir.glob(".copytrace-cache/*.events.parquet"):
        cache.unlink()  # only the sidecars: no cache of a parsed file
    for cache in trace_dir.glob(".copytrace-cache/*.findings*"):
        cache.unlink()  # the first report: no cached findings
    out = trace_dir / "report.html"
    size = sum(f.stat().st_size for f in trace_dir.glob("*.otlp.jsonl"))
    side = sum(f.stat().st_size for f in trace_dir.glob(".copytrace-cache/*.events/*.parquet"))
    # the JSON-only reports take minutes
    small = n <= 1_000_000 and mix == "friendly" and not no_json
    naive = _child(["naive-json", str(trace_dir)]) if small else None
    no = [] if hazards else ["--no-analysis"]
    check = _child(["check", str(trace_dir), "--allow-partial"])
    report = _child(["report", str(trace_dir), "-o", str(out), *no])
    summary = _child(["summary", str(trace_dir), *no])
    ref = f"{naive['s']:6.1f} s" if naive else "     -  "
    json_cols = "     -   |     -  "
    if small:
        plain = _json_only(trace_dir)
        cold = _child(["report", str(plain), "-o", str(plain / "report.html"), *no])
        warm = _child(["report", str(plain), "-o", str(plain / "report.html"), *no])
        json_cols = (f"{cold['s']:6.1f} s ({cold['peak_mib']:,.0f} MiB) | "
                     f"{warm['s']:5.1f} s")  # fmt: skip
        shutil.rmtree(plain, ignore_errors=True)
    line = (
        f"{mix:>8} | {n:>11,} | {ranks} | {_mib(size):>12} | {_mib(side):>10} | {ref} | "
        f"{_fig(report)} | {_fig(summary)} | {_fig(check)} | "
        f"{_mib(out.stat().st_size):>9} | {json_cols}"
    )
    return {"line": line, "check": check, "report": report, "summary": summary}


def _fig(m: dict) -> str:
    """Wall time (CPU time of the process, imports included; peak memory)."""
    return f"{m['s']:5.1f} s ({m['cpu_s']:.1f} s CPU, {m['peak_mib']:,.0f} MiB)"


def _ratios(rows: dict[str, dict]) -> list[str]:
    """One line per adversarial mix: its check and first report, time and peak memory, as a
    multiple of the training-loop mix's."""
    base = rows.get("friendly")
    if base is None:
        return []
    out = []
    for mix, row in rows.items():
        if mix == "friendly":
            continue
        parts = []
        for cmd in ("check", "report"):
            t = row[cmd]["cpu_s"] / max(base[cmd]["cpu_s"], 1e-9)
            m = row[cmd]["peak_mib"] / max(base[cmd]["peak_mib"], 1e-9)
            parts.append(f"{cmd} {t:4.2f}x CPU time, {m:4.2f}x peak")
        out.append(f"  {mix} / friendly: " + "; ".join(parts))
    return out


def _load() -> str:
    """The machine's load: 1-minute load average over the CPUs (a figure from a loaded
    machine is an upper bound)."""
    return f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print one row per size and mix, then the mixes' ratios."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--ranks", type=int, default=1, help="trace files (ranks) per size")
    parser.add_argument("--jobs", type=int, default=1, help="rank files written at a time")
    parser.add_argument("--mix", nargs="+", choices=MIXES, default=list(MIXES),
                        help="event mixes (default: all; ratios are against friendly)")
    parser.add_argument("--keep", type=Path, default=None, help="keep traces and reports here")
    parser.add_argument("--no-analysis", action="store_true",
                        help="report and summary without the hazard analyser (check runs it)")
    parser.add_argument("--no-json", action="store_true",
                        help="skip the naive JSON pass and the reports without the sidecar")
    parser.add_argument("--measure", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.measure:
        print(json.dumps(_measure(args.measure)))
        return 0
    work = args.keep or Path(tempfile.mkdtemp(prefix="copytrace-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"# {_load()}", flush=True)
    print("     mix |      events | ranks | trace (plain) | sidecar | naive json | "
          "report: wall (CPU, peak) | summary | check | report size | "
          "JSON only: report (parse, peak) | JSON only: report (cached)", flush=True)
    try:
        for n in args.events:
            rows = {}
            for mix in args.mix:
                rows[mix] = _row(n, args.ranks, work, hazards=not args.no_analysis, mix=mix,
                                 jobs=args.jobs, no_json=args.no_json)  # fmt: skip
                print(rows[mix]["line"], flush=True)
            for line in _ratios(rows):
                print(line, flush=True)
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    print(f"# {_load()}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
