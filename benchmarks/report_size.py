"""Report, summary and check times, peak memory and report size on generated traces.

Usage::

    python benchmarks/report_size.py                       # 10k, 100k, 1M events
    python benchmarks/report_size.py --events 1000000 --ranks 1
    python benchmarks/report_size.py --events 10000000 --ranks 8 --keep /tmp/ct-bench

For each size it writes a synthetic trace (OTLP/JSON lines, as the tracer writes them: a
training-loop mix of no-op ``.to()`` calls, ``detach`` aliases, clones, host-to-device and
device-to-host copies, ``copy_``, deepcopy, in several modules and call sites, 100 events
per step, and a ``copytrace.hazards`` span), split over ``--ranks`` files, then times in
fresh subprocesses: one naive pass of stdlib ``json.loads`` over every line (the reference),
``copytrace report`` without the event-table cache (it parses the files and writes the
cache), ``copytrace report`` again (from the cache), ``copytrace summary`` and
``copytrace check``; with the peak memory of each and the report's size. Not a test: it only
prints numbers.
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


def _v(value: object) -> dict:
    if isinstance(value, bool):
        return {"boolValue": value}
    if isinstance(value, int):
        return {"intValue": str(value)}
    if isinstance(value, list):
        return {"arrayValue": {"values": [_v(x) for x in value]}}
    return {"stringValue": str(value)}


def _attr_json(attrs: dict) -> str:
    return ",".join(
        json.dumps({"key": k, "value": _v(v)}, separators=(",", ":")) for k, v in attrs.items()
    )


def _templates() -> list[tuple[int, str, str]]:
    """Pre-rendered (weight, span name, attribute JSON without the step) per variant."""
    out = []
    for (weight, op, kind, nbytes, shape, src, dst, transfer, module, file, line, func, phase,
         graph, aten) in _TEMPLATES:  # fmt: skip
        for b in range(2) if "{b}" in module else [None]:
            mod = module.format(b=b) if b is not None else module
            attrs = {
                "copytrace.op": op,
                "copytrace.dtype": "float32",
                "copytrace.src_dtype": "float32",
                "copytrace.src_device": src,
                "copytrace.dst_device": dst,
                "copytrace.transfer": transfer,
                "copytrace.graph": graph,
                "copytrace.phase": phase,
                "code.file.path": f"/home/user/project/{file}",
                "code.function.name": func,
                "thread.name": "MainThread",
                "copytrace.bytes_allocated": nbytes if kind == "copy" and op != "copy_" else 0,
                "copytrace.bytes_logical": nbytes,
                "copytrace.alias": kind != "copy",
                "copytrace.noop": kind == "noop",
                "copytrace.non_blocking": transfer == "h2d",
                "copytrace.requires_grad": graph == "attached",
                "code.line.number": line,
                "thread.id": 140607661808512,
                "copytrace.aten": aten,
                "copytrace.shape": shape,
            }
            if mod:
                attrs["copytrace.module"] = mod
            out.append((weight, f"copytrace.{op}", _attr_json(attrs)))
    return out


_HAZARD_ATTRS = [
    {"key": "copytrace.hazard.code", "value": {"stringValue": "CT-SYNC-D2H"}},
    {"key": "copytrace.hazard.severity", "value": {"stringValue": "warning"}},
    {"key": "copytrace.hazard.message",
     "value": {"stringValue": "device-to-host copy every step synchronises the GPU"}},
    {"key": "copytrace.hazard.fix",
     "value": {"stringValue": "accumulate on the device; call .item() once per log"}},
    {"key": "copytrace.hazard.call_sites",
     "value": {"arrayValue": {"values": [{"stringValue": "/home/user/project/train.py:190 main"}]}}},
]  # fmt: skip


def generate_trace(path: Path, n_events: int, seed: int = 0, pid: int = 4242) -> None:
    """Write a synthetic trace of ``n_events`` event spans (plus steps and a run span).

    Args:
        path: File to write (``*.otlp.jsonl``).
        n_events: Event spans to write.
        seed: Random seed for the mix of events (and the trace id).
        pid: ``process.pid`` of the run.
    """
    rng = random.Random(seed)
    tpls = _templates()
    weights = [w for w, _, _ in tpls]
    choice = rng.choices(range(len(tpls)), weights=weights, k=n_events)
    hazard_ids: list[str] = []
    n_steps = max(3, -(-n_events // EVENTS_PER_STEP))
    trace_id = f"{rng.getrandbits(128):032x}"
    run_id = 1
    head = (
        '{"resourceSpans":[{"resource":{"attributes":['
        '{"key":"service.name","value":{"stringValue":"copytrace"}},'
        '{"key":"process.pid","value":{"intValue":"%d"}},'
        '{"key":"host.name","value":{"stringValue":"bench"}}]},'
        '"scopeSpans":[{"scope":{"name":"copytrace","version":"0.1.0"},"spans":['
    )
    tail = "]}]}]}\n"
    span_fmt = (
        '{"traceId":"' + trace_id + '","spanId":"%016x","parentSpanId":"%016x","name":"%s",'
        '"kind":1,"startTimeUnixNano":"%d","endTimeUnixNano":"%d","attributes":[%s,'
        '{"key":"copytrace.step","value":{"intValue":"%d"}}],"status":{}}'
    )
    step_fmt = (
        '{"traceId":"%s","spanId":"%016x","parentSpanId":"%016x","name":"copytrace.step",'
        '"kind":1,"startTimeUnixNano":"%d","endTimeUnixNano":"%d","attributes":'
        '[{"key":"copytrace.step","value":{"intValue":"%d"}}],"status":{}}'
    )
    run_fmt = (
        '{"traceId":"%s","spanId":"%016x","name":"copytrace.run","kind":1,'
        '"startTimeUnixNano":"%d","endTimeUnixNano":"%d","attributes":[%s],"status":{}}'
    )
    head = head % pid
    with path.open("w", encoding="utf-8") as fh:
        batch: list[str] = []

        def flush() -> None:
            if batch:
                fh.write(head + ",".join(batch) + tail)
                batch.clear()

        for i in range(n_events):
            step = min(i // EVENTS_PER_STEP, n_steps - 1)
            within = i - step * EVENTS_PER_STEP
            start = T0 + step * STEP_NS + 50_000 + within * (STEP_NS - 100_000) // EVENTS_PER_STEP
            ti = choice[i]
            _, name, attrs = tpls[ti]
            dur = 2_000 + (ti * 7919 + i) % 40_000
            if name == "copytrace.cpu" and len(hazard_ids) < 1000:
                hazard_ids.append(f"{0x1000000 + i:016x}")
            batch.append(
                span_fmt % (0x1000000 + i, 0x100 + step, name, start, start + dur, attrs, step)
            )
            if len(batch) >= SPANS_PER_LINE:
                flush()
        for s in range(n_steps):
            batch.append(
                step_fmt
                % (trace_id, 0x100 + s, run_id, T0 + s * STEP_NS, T0 + (s + 1) * STEP_NS, s)
            )
        flush()
        run_attrs = _attr_json(
            {
                "copytrace.version": "0.1.0",
                "copytrace.torch_version": "2.13.0",
                "process.command_args": ["train.py", "--synthetic", str(n_events)],
                "copytrace.events": n_events,
                "copytrace.events_dropped": 0,
                "copytrace.errors": 0,
                "copytrace.internal_detaches": 0,
                "copytrace.steps": n_steps,
                "copytrace.overhead_ns": n_events * 9_000,
            }
        )
        end = T0 + n_steps * STEP_NS
        batch.append(run_fmt % (trace_id, run_id, T0, end, run_attrs))
        ids = {"key": "copytrace.hazard.span_ids",
               "value": {"arrayValue": {"values": [{"stringValue": h} for h in hazard_ids]}}}
        hazards = {"traceId": trace_id, "spanId": f"{2:016x}", "parentSpanId": f"{run_id:016x}",
                   "name": "copytrace.hazards", "kind": 1, "startTimeUnixNano": str(end),
                   "endTimeUnixNano": str(end), "events": [
                       {"timeUnixNano": str(end), "name": "copytrace.hazard",
                        "attributes": [*_HAZARD_ATTRS, ids]}]}  # fmt: skip
        batch.append(json.dumps(hazards, separators=(",", ":")))
        flush()


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

        with open(os.devnull, "w") as null:
            import contextlib

            with contextlib.redirect_stdout(null):
                code = cli_main(argv)
        if code not in (0, 1):
            raise SystemExit(f"{argv}: exit {code}")
    wall = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    return {"s": wall, "peak_mib": peak}


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


def _row(n: int, ranks: int, work: Path) -> str:
    trace_dir = work / f"bench-{n}x{ranks}"
    trace_dir.mkdir(parents=True, exist_ok=True)
    for r in range(ranks):
        f = trace_dir / f"copytrace-bench-{r}.otlp.jsonl"
        if not f.exists():
            generate_trace(f, n // ranks, seed=r, pid=4242 + r)
    for cache in trace_dir.glob(".copytrace-cache/*.events.parquet"):
        cache.unlink()
    out = trace_dir / "report.html"
    size = sum(f.stat().st_size for f in trace_dir.glob("*.otlp.jsonl"))
    naive = _child(["naive-json", str(trace_dir)]) if ranks == 1 or n <= 1_000_000 else None
    cold = _child(["report", str(trace_dir), "-o", str(out)])
    warm = _child(["report", str(trace_dir), "-o", str(out)])
    summary = _child(["summary", str(trace_dir)])
    check = _child(["check", str(trace_dir), "--allow-partial"])
    ref = f"{naive['s']:6.1f} s" if naive else "     -  "
    return (
        f"{n:>11,} | {ranks} | {_mib(size):>12} | {ref} | {cold['s']:6.1f} s | "
        f"{warm['s']:5.1f} s | {summary['s']:5.1f} s | {check['s']:5.1f} s | "
        f"{max(cold['peak_mib'], warm['peak_mib']):6,.0f} MiB | "
        f"{_mib(out.stat().st_size):>9}"
    )


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print one row per size."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--ranks", type=int, default=1, help="trace files (ranks) per size")
    parser.add_argument("--keep", type=Path, default=None, help="keep traces and reports here")
    parser.add_argument("--measure", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.measure:
        print(json.dumps(_measure(args.measure)))
        return 0
    work = args.keep or Path(tempfile.mkdtemp(prefix="copytrace-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    print("     events | ranks | trace (plain) | naive json | report (parse) | "
          "report (cached) | summary | check | peak memory | report size", flush=True)
    try:
        for n in args.events:
            print(_row(n, args.ranks, work), flush=True)
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
