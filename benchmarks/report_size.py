"""Report size and build time on generated traces of 10k, 100k and 1M events.

Usage::

    python benchmarks/report_size.py                  # 10k, 100k, 1M events
    python benchmarks/report_size.py --events 10000 100000 --keep /tmp/ct-bench

For each size it writes a synthetic trace (OTLP/JSON lines, as the tracer writes them: a
training-loop mix of no-op ``.to()`` calls, ``detach`` aliases, clones, host-to-device and
device-to-host copies, ``copy_``, deepcopy, in several modules and call sites, with a few
``copytrace.hazard`` span events), then builds the HTML report in a fresh subprocess and
prints: events, trace file size, report size, time to load, aggregate and render, total
build time and the peak memory of the build. Not a test: it only prints numbers.
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
EVENTS_PER_STEP = 250
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


_HAZARD = (
    ',"events":[{"timeUnixNano":"%d","name":"copytrace.hazard","attributes":'
    + json.dumps(
        [
            {"key": "copytrace.hazard.code", "value": {"stringValue": "CT-SYNC-D2H"}},
            {"key": "copytrace.hazard.severity", "value": {"stringValue": "warning"}},
            {"key": "copytrace.hazard.message",
             "value": {"stringValue": "device-to-host copy every step synchronises the GPU"}},
            {"key": "copytrace.hazard.fix",
             "value": {"stringValue": "accumulate on the device; call .item() once per log"}},
        ],
        separators=(",", ":"),
    ).replace("%", "%%")
    + "}]"
)  # fmt: skip


def generate_trace(path: Path, n_events: int, seed: int = 0) -> None:
    """Write a synthetic trace of ``n_events`` event spans (plus steps and a run span).

    Args:
        path: File to write (``*.otlp.jsonl``).
        n_events: Event spans to write.
        seed: Random seed for the mix of events.
    """
    rng = random.Random(seed)
    tpls = _templates()
    weights = [w for w, _, _ in tpls]
    choice = rng.choices(range(len(tpls)), weights=weights, k=n_events)
    n_steps = max(3, -(-n_events // EVENTS_PER_STEP))
    trace_id = f"{rng.getrandbits(128):032x}"
    run_id = 1
    head = (
        '{"resourceSpans":[{"resource":{"attributes":['
        '{"key":"service.name","value":{"stringValue":"copytrace"}},'
        '{"key":"process.pid","value":{"intValue":"4242"}},'
        '{"key":"host.name","value":{"stringValue":"bench"}}]},'
        '"scopeSpans":[{"scope":{"name":"copytrace","version":"0.1.0"},"spans":['
    )
    tail = "]}]}]}\n"
    span_fmt = (
        '{"traceId":"' + trace_id + '","spanId":"%016x","parentSpanId":"%016x","name":"%s",'
        '"kind":1,"startTimeUnixNano":"%d","endTimeUnixNano":"%d","attributes":[%s,'
        '{"key":"copytrace.step","value":{"intValue":"%d"}}],"status":{}%s}'
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
            hazard = _HAZARD % (start + dur) if name == "copytrace.cpu" and i % 50 == 0 else ""
            batch.append(
                span_fmt % (0x1000000 + i, 0x100 + step, name, start, start + dur, attrs, step,
                            hazard)
            )  # fmt: skip
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
        batch.append(run_fmt % (trace_id, run_id, T0, T0 + n_steps * STEP_NS, run_attrs))
        flush()


def _build_one(trace: Path, out: Path) -> dict:
    """Build the report in this process and return timings (s) and peak memory (MiB)."""
    from copytrace.dashboards import build_model, load_trace, render_html

    t0 = time.perf_counter()
    data = load_trace(trace)
    t1 = time.perf_counter()
    model = build_model(data, analyze=True)
    del data
    t2 = time.perf_counter()
    render_html(model, out)
    t3 = time.perf_counter()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    return {
        "events": model.n_events,
        "load_s": t1 - t0,
        "model_s": t2 - t1,
        "render_s": t3 - t2,
        "build_s": t3 - t0,
        "peak_mib": peak,
    }


def _mib(n: int) -> str:
    return f"{n / (1 << 20):,.1f} MiB"


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print one row per size."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--keep", type=Path, default=None, help="keep traces and reports here")
    parser.add_argument("--build-one", nargs=2, metavar=("TRACE", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.build_one:
        print(json.dumps(_build_one(Path(args.build_one[0]), Path(args.build_one[1]))))
        return 0

    work = args.keep or Path(tempfile.mkdtemp(prefix="copytrace-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    rows = []
    try:
        for n in args.events:
            trace = work / f"bench-{n}.otlp.jsonl"
            out = work / f"bench-{n}.report.html"
            t = time.perf_counter()
            generate_trace(trace, n)
            gen_s = time.perf_counter() - t
            env = dict(os.environ)
            root = str(Path(__file__).resolve().parents[1])
            env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
            proc = subprocess.run(
                [sys.executable, __file__, "--build-one", str(trace), str(out)],
                capture_output=True,
                text=True,
                env=env,
                check=False,
            )
            if proc.returncode != 0:
                print(proc.stderr, file=sys.stderr)
                return proc.returncode
            res = json.loads(proc.stdout.strip().splitlines()[-1])
            res.update(trace_bytes=trace.stat().st_size, report_bytes=out.stat().st_size,
                       gen_s=gen_s)  # fmt: skip
            rows.append(res)
            print(
                f"{n:>9,} events: trace {_mib(res['trace_bytes']):>12}, report "
                f"{_mib(res['report_bytes']):>9}; build {res['build_s']:6.1f} s (load "
                f"{res['load_s']:.1f} s, aggregate {res['model_s']:.1f} s, render "
                f"{res['render_s']:.1f} s), peak memory {res['peak_mib']:,.0f} MiB",
                flush=True,
            )
            if args.keep is None:
                trace.unlink()
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
