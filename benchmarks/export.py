"""Export cost and trace size: bytes per event on disk, export time per 100k events, memory.

Usage::

    python benchmarks/export.py sizes [--events N]      # encodings compared (bytes/event)
    python benchmarks/export.py speed [--events N]      # file and SDK export time / 100k events
    python benchmarks/export.py rss [--events N]        # RSS of a real traced run (subprocess)
    python benchmarks/export.py all

``sizes`` encodes the same synthetic training-loop events (a realistic mix of copies,
aliases, no-ops and deepcopy groups, see :func:`make_events`) several ways and prints the
bytes per event of each; the production encoding is ``spans-compact``. ``--replay FILE``
replays events pickled from a real run instead (a list of ``CopyEvent.as_dict()``).

``speed`` times the production paths per 100k events: the trace file (:class:`FileSink`,
plain and gzip) and SDK spans (:class:`SdkSink`) into a null exporter and into the official
OTLP protobuf encoder (no network), when ``opentelemetry-exporter-otlp-proto-common`` is
installed.

``rss`` runs a real traced loop of ``--events`` copies in a fresh interpreter (one per
setting) and reports the peak RSS above the same loop untraced.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import pickle
import random
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any

from copytrace.export.file_sink import FileSink
from copytrace.export.otlp_json import (
    Encoder,
    any_value,
    dumps,
    event_attributes,
    pack_lines,
    request_frame,
)
from copytrace.export.pipeline import Chunk, ExportPipeline, RunEnd, RunIds
from copytrace.export.sdk_sink import SdkSink, make_resource
from copytrace.schema import CopyEvent

T0 = 1_000_000_000_000
_FILES = [f"/home/user/projects/llm-train/src/model/{n}.py" for n in
          ("train", "attention", "mlp", "data", "optim", "ema", "eval", "utils")]  # fmt: skip
_FUNCS = ["forward", "train_step", "evaluate", "collate", "step", "update", "main", "_apply"]
_MODULES = [None, "GPT", "GPT.blocks.0.attn", "GPT.blocks.0.mlp", "GPT.blocks.1.attn",
            "GPT.blocks.1.mlp", "GPT.blocks.11.attn.proj", "GPT.lm_head", "GPT.tok_emb"]  # fmt: skip
_SHAPES = [(16, 64), (16, 64, 768), (16, 12, 64, 64), (768, 768), (3072, 768), (768,), (),
           (16, 64, 50257), (50257, 768), (2304, 768), (16,)]  # fmt: skip


def make_events(n: int, seed: int = 0, per_step: int = 120) -> tuple[list[CopyEvent], int]:
    """``n`` synthetic events of a GPU training loop; returns (events, number of steps).

    Mix (by kind): 35% ``.to`` no-ops, 10% host-to-device batch copies, 12% ``contiguous``
    copies, 10% ``detach`` aliases, 8% ``clone``, 12% implicit copies in backward, 5%
    ``copy_`` (EMA), and deepcopy groups of 4 parameter copies (~8%).
    """
    rnd = random.Random(seed)
    events: list[CopyEvent] = []
    t = T0
    step = 0
    in_step = 0
    seq = 0
    while len(events) < n:
        r = rnd.random()
        f = rnd.randrange(len(_FILES))
        common = dict(
            file=_FILES[f], line=20 + rnd.randrange(400), function=_FUNCS[f], step=step,
            thread_id=140245031036736, thread_name="MainThread",
        )  # fmt: skip
        shape = rnd.choice(_SHAPES)
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * 4
        dur = 2_000 + rnd.randrange(40_000)
        if r < 0.08:  # deepcopy group + 4 children
            group = CopyEvent(op="deepcopy", group=True, tensors=4, seq=seq, start_ns=t,
                              end_ns=t + 400_000, object_type="torch.nn.modules.linear.Linear",
                              dtype="", src_dtype="", src_device="", dst_device="",
                              bytes_allocated=4 * nbytes, phase="other", **common)  # fmt: skip
            events.append(group)
            gseq = seq
            seq += 1
            for k in range(4):
                events.append(
                    CopyEvent(
                        op="deepcopy",
                        aten=("aten::clone",),
                        seq=seq,
                        parent=gseq,
                        start_ns=t + 1000 + k * 90_000,
                        end_ns=t + 80_000 + k * 90_000,
                        shape=shape,
                        dtype="float32",
                        src_dtype="float32",
                        src_device="cuda:0",
                        dst_device="cuda:0",
                        bytes_allocated=nbytes,
                        bytes_logical=nbytes,
                        requires_grad=True,
                        src_requires_grad=True,
                        is_leaf=True,
                        graph="none",
                        phase="other",
                        **common,
                    )  # fmt: skip
                )
                seq += 1
            t += 500_000
            in_step += 5
        else:
            ev = CopyEvent(seq=seq, start_ns=t, end_ns=t + dur, shape=shape, dtype="float32",
                           src_dtype="float32", src_device="cuda:0", dst_device="cuda:0",
                           bytes_logical=nbytes, phase="forward",
                           module=rnd.choice(_MODULES), **common)  # fmt: skip
            if r < 0.43:
                ev.op, ev.alias, ev.noop, ev.graph = "to", True, True, "none"
            elif r < 0.53:
                ev.op, ev.aten, ev.src_device, ev.transfer = "to", ("aten::_to_copy",), "cpu", "h2d"
                ev.bytes_allocated, ev.non_blocking, ev.pinned = nbytes, True, True
                ev.dtype = ev.src_dtype = "int64"
            elif r < 0.65:
                ev.op, ev.aten, ev.bytes_allocated = "contiguous", ("aten::clone",), nbytes
                ev.requires_grad, ev.src_requires_grad, ev.is_leaf = True, True, False
                ev.grad_fn, ev.graph = "CloneBackward0", "attached"
            elif r < 0.75:
                ev.op, ev.aten, ev.alias, ev.graph = "detach", ("aten::detach",), True, "detached"
                ev.src_requires_grad = True
            elif r < 0.83:
                ev.op, ev.aten, ev.bytes_allocated = "clone", ("aten::clone",), nbytes
            elif r < 0.95:
                ev.op, ev.aten, ev.bytes_allocated = "implicit", ("aten::_to_copy",), nbytes // 2
                ev.dtype, ev.phase, ev.via, ev.module = (
                    "bfloat16",
                    "backward",
                    "ToCopyBackward0",
                    None,
                )
            else:
                ev.op, ev.aten, ev.phase = "copy_", ("aten::copy_",), "optimizer"
            events.append(ev)
            seq += 1
            t += dur + 3_000
            in_step += 1
        if in_step >= per_step:
            step += 1
            in_step = 0
            t += 1_000_000
    del events[n:]
    return events, step + 1


def replay_events(path: str, n: int) -> tuple[list[CopyEvent], int]:
    """Events pickled from a real run (``[ev.as_dict() for ev in t.events]``), repeated."""
    rows = pickle.load(open(path, "rb"))  # noqa: SIM115
    span = max(r["end_ns"] for r in rows) - min(r["start_ns"] for r in rows) + 1
    steps = max(r["step"] for r in rows) + 1
    out: list[CopyEvent] = []
    k = 0
    while len(out) < n:
        for r in rows:
            ev = CopyEvent(**r)
            ev.start_ns += k * span
            ev.end_ns += k * span
            ev.step += k * steps
            if ev.parent is not None and ev.parent >= 0:
                ev.parent += k * len(rows)
            ev.seq += k * len(rows)
            out.append(ev)
        k += 1
    del out[n:]
    return out, k * steps


def _steps_of(events: list[CopyEvent], n_steps: int) -> list[tuple[int, int, int]]:
    bounds: dict[int, list[int]] = {}
    for ev in events:
        b = bounds.setdefault(ev.step, [ev.start_ns, ev.end_ns])
        b[0] = min(b[0], ev.start_ns)
        b[1] = max(b[1], ev.end_ns)
    return [(s, b[0] - 1000, b[1] + 1000) for s, b in sorted(bounds.items())]


# --- alternative encodings, for the size comparison only -----------------------------------------
def _full_attributes(ev: CopyEvent) -> dict[str, Any]:
    """Every attribute, defaults included (the encoding before the compaction)."""
    attrs = event_attributes(ev)
    for key, field in (("copytrace.alias", "alias"), ("copytrace.noop", "noop"),
                       ("copytrace.non_blocking", "non_blocking"),
                       ("copytrace.requires_grad", "requires_grad"),
                       ("copytrace.src_requires_grad", "src_requires_grad"),
                       ("copytrace.bytes_allocated", "bytes_allocated")):  # fmt: skip
        attrs.setdefault(key, getattr(ev, field))
    attrs.setdefault("copytrace.aten", list(ev.aten))
    attrs.setdefault("copytrace.shape", list(ev.shape))
    return attrs


def _encode(variant: str, events: list[CopyEvent], steps: list[tuple[int, int, int]]) -> bytes:
    """The whole trace as OTLP/JSON lines, one way or another."""
    enc = Encoder()
    resource = make_resource()
    head, tail = request_frame(resource.attributes, "copytrace", "0.1.0")
    trace = "5b8efff798038103d269b633813fc60c"
    hexids = os.urandom(8 * (len(events) + len(steps) + 1)).hex()
    ids = iter([hexids[i : i + 16] for i in range(0, len(hexids), 16)])
    run_id = next(ids)
    step_ids = {s[0]: next(ids) for s in steps}
    attrs_of = _full_attributes if variant == "spans-full" else event_attributes
    as_event = {
        "spans-full": lambda ev: False,
        "spans-compact": lambda ev: False,
        "alias-as-span-events": lambda ev: bool(ev.alias) and not ev.group and ev.parent < 0,
        "all-as-span-events": lambda ev: not ev.group and ev.parent < 0,
    }[variant]
    span_events: dict[int, list[str]] = {}
    spans: list[str] = []
    groups: dict[int, str] = {}
    for ev in events:
        attrs = attrs_of(ev)
        if as_event(ev):
            attrs["copytrace.duration_ns"] = ev.end_ns - ev.start_ns
            span_events.setdefault(ev.step, []).append(
                '{"timeUnixNano":"' + str(ev.start_ns) + '","name":' + enc.name("copytrace." + ev.op)
                + ',"attributes":[' + enc.attrs(attrs) + "]}"
            )  # fmt: skip
            continue
        sid = next(ids)
        parent = groups.get(ev.parent) if ev.parent >= 0 else None
        if ev.group:
            groups[ev.seq] = sid
        spans.append(enc.span(trace, sid, parent or step_ids[ev.step], "copytrace." + ev.op,
                              ev.start_ns, ev.end_ns, attrs, ev.error))  # fmt: skip
    for number, start, end in steps:
        s = enc.span(trace, step_ids[number], run_id, "copytrace.step", start, end,
                     {"copytrace.step": number})  # fmt: skip
        evs = span_events.get(number)
        if evs:
            s = s[:-1] + ',"events":[' + ",".join(evs) + "]}"
        spans.append(s)
    lines = pack_lines(head, tail, spans)
    return ("\n".join(lines) + "\n").encode()


def cmd_sizes(events: list[CopyEvent], n_steps: int) -> None:
    steps = _steps_of(events, n_steps)
    n = len(events)
    print(f"{n} events, {len(steps)} steps; bytes per event (whole file / events)")
    print(f"{'encoding':<24}{'plain':>10}{'gzip -1':>10}{'gzip -6':>10}")
    for variant in ("spans-full", "spans-compact", "alias-as-span-events", "all-as-span-events"):
        data = _encode(variant, events, steps)
        g1 = len(gzip.compress(data, 1, mtime=0))
        g6 = len(gzip.compress(data, 6, mtime=0))
        print(f"{variant:<24}{len(data) / n:>10.0f}{g1 / n:>10.1f}{g6 / n:>10.1f}")
    # with the file writer's sync flush every 4096 events, as a long run writes it
    for level in (1, 6):
        with tempfile.TemporaryDirectory() as tmp:
            size = _write_file(events, steps, Path(tmp) / "t.otlp.jsonl.gz", "gzip", level, 4096)
        print(f"FileSink gzip -{level}, flushed every 4096 events: {size / n:.1f} B/event")


def _write_file(events, steps, path, compression, level, chunk_events, sidecar=True, out=None):
    """Write ``events`` as the tracer does (flushes of ``chunk_events`` at step boundaries);
    return the trace file's size. ``out`` (a dict) gets the sink's ``sidecar_seconds``."""
    run = RunIds(T0, 0, make_resource())
    sink = FileSink(path, compression=compression, level=level, sidecar=sidecar)
    pipe = ExportPipeline(run, [sink])
    pipe.begin()
    by_step: dict[int, list[CopyEvent]] = {}
    for ev in events:
        by_step.setdefault(ev.step, []).append(ev)
    buf: list[CopyEvent] = []
    done: list[tuple[int, int, int]] = []
    for step in steps:
        buf.extend(by_step.get(step[0], ()))
        done.append(step)
        if len(buf) >= chunk_events:
            pipe.write_now(Chunk(buf, done))
            buf, done = [], []
    pipe.close(
        Chunk(buf, done, final=RunEnd(events[-1].end_ns + 10, {"copytrace.events": len(events)}))
    )
    if out is not None:
        out["sidecar_seconds"] = sink.sidecar_seconds
    return path.stat().st_size


class _NullExporter:
    def __init__(self, encode: Any = None) -> None:
        self.encode = encode
        self.spans = 0

    def export(self, spans: Any) -> Any:
        from opentelemetry.sdk.trace.export import SpanExportResult

        if self.encode is not None:
            self.encode(spans).SerializeToString()
        self.spans += len(spans)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 0) -> bool:
        return True


def cmd_speed(events: list[CopyEvent], n_steps: int) -> None:
    steps = _steps_of(events, n_steps)
    n = len(events)
    per = 100_000 / n
    print(f"{n} events; export seconds per 100k events (this machine, one thread)")
    with tempfile.TemporaryDirectory() as tmp:
        for comp, level in ((None, 6), ("gzip", 1), ("gzip", 6)):
            path = Path(tmp) / f"{comp}{level}" / "t.otlp.jsonl"
            t0 = time.perf_counter()
            size = _write_file(events, steps, path, comp, level, 4096, sidecar=False)
            dt = time.perf_counter() - t0
            out: dict[str, float] = {}
            t0 = time.perf_counter()
            _write_file(events, steps, path, comp, level, 4096, out=out)
            dt_side = time.perf_counter() - t0
            side = sum(f.stat().st_size for f in path.parent.rglob("part-*.parquet"))
            name = "plain" if comp is None else f"gzip -{level}"
            print(f"  trace file, {name:<8}: {dt * per:6.2f} s  ({size / n:.1f} B/event); "
                  f"with the columnar sidecar {dt_side * per:6.2f} s, of which the sidecar "
                  f"{out['sidecar_seconds'] * per:5.2f} s ({side / n:.1f} B/event)")
    t0 = time.perf_counter()
    for ev in events:
        event_attributes(ev)
    print(f"  of which event_attributes(): {(time.perf_counter() - t0) * per:6.2f} s")
    encoders: list[tuple[str, Any]] = [("SDK spans, null exporter", None)]
    try:
        from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

        encoders.append(("SDK spans + OTLP protobuf", encode_spans))
    except ImportError:
        pass
    sample = events[: min(n, 20_000)]
    sample_steps = _steps_of(sample, n_steps)
    for name, encode in encoders:
        exporter = _NullExporter(encode)
        run = RunIds(T0, 0, make_resource())
        pipe = ExportPipeline(run, [SdkSink([exporter], resource=run.resource)])  # type: ignore[list-item]
        pipe.begin()
        t0 = time.perf_counter()
        pipe.close(Chunk(sample, sample_steps, final=RunEnd(sample[-1].end_ns, {})))
        dt = time.perf_counter() - t0
        print(f"  {name:<26}: {dt * 100_000 / len(sample):6.2f} s")


_RSS_CHILD = r"""
import json, resource, sys, time, torch
import copytrace
n, per_step, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
x = torch.ones(8)
def rss():
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * 4096
def loop(t):
    done = 0
    while done < n:
        for _ in range(per_step):
            x.clone()
        done += per_step
        if t is not None:
            t.step()
loop(None)  # warm: allocator, caches
with copytrace.trace(write=False):  # warm: torch._dynamo and the modes' one-time imports
    for _ in range(2000):
        x.clone()
base_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
base = rss()
t0 = time.perf_counter()
if mode == "off":
    loop(None); stats = {}
else:
    kw = dict(flush_events=0) if mode == "no-flush" else {}
    with copytrace.trace(sys.argv[4], **kw) as t:
        loop(t)
    stats = t.stats
dt = time.perf_counter() - t0
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"base": base, "base_peak": base_peak, "peak": peak, "end": rss(),
                  "seconds": dt, "stats": stats}))
"""


def cmd_rss(n: int, per_step: int) -> None:
    print(f"{n} events (x.clone() of an 8-element tensor), {per_step} per step, fresh process each")
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("off", "flush", "no-flush"):
            out = Path(tmp) / mode
            proc = subprocess.run(
                [sys.executable, "-c", _RSS_CHILD, str(n), str(per_step), mode, str(out)],
                capture_output=True, text=True, env={**os.environ, "COPYTRACE": ""},
            )  # fmt: skip
            if proc.returncode != 0:
                print(proc.stderr)
                continue
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            files = list(out.glob("*.otlp.jsonl*")) if out.exists() else []
            size = sum(f.stat().st_size for f in files)
            grow = (r["peak"] - max(r["base"], r["base_peak"])) / 2**20
            extra = (
                f", file {size / max(1, r['stats'].get('events', 1)):.1f} B/event" if files else ""
            )
            print(f"  {mode:<9}: peak RSS +{grow:7.1f} MiB over the warmed-up process, "
                  f"{r['seconds']:6.1f} s, stats {r['stats']}{extra}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("what", choices=("sizes", "speed", "rss", "all"))
    ap.add_argument("--events", type=int, default=None)
    ap.add_argument("--per-step", type=int, default=100)
    ap.add_argument("--replay", default=None, help="pickled events of a real run")
    args = ap.parse_args(argv)
    if args.what in ("sizes", "speed", "all"):
        n = args.events or 100_000
        events, n_steps = replay_events(args.replay, n) if args.replay else make_events(n)
        if args.what in ("sizes", "all"):
            cmd_sizes(events, n_steps)
        if args.what in ("speed", "all"):
            cmd_speed(events, n_steps)
    if args.what in ("rss", "all"):
        cmd_rss(args.events or 1_000_000, args.per_step)
    return 0


if __name__ == "__main__":
    _ = (any_value, dumps, zlib)
    raise SystemExit(main())
