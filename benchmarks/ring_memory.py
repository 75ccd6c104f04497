"""Memory of the flight recorder (``COPYTRACE_RING``) over a long run: flat, whatever the
number of events.

A training-like loop records ``--events`` clones in steps of ``--per-step`` under
``copytrace.trace(ring=N)`` and prints the process's resident memory (``/proc/self/statm``,
Linux) at each tenth of the run. With the ring the figure stays within a few MB after the
first ``2 N`` records; ``--ring 0`` shows the growth without it (records buffered until a
flush: 4096 by default, so it stays bounded too, but the file grows instead).

    python benchmarks/ring_memory.py                      # 1M events, ring 10000
    python benchmarks/ring_memory.py --events 200000 --ring 1000
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch

import copytrace


def rss_mb() -> float:
    """Resident set size of this process in MiB (Linux ``/proc/self/statm``)."""
    with open("/proc/self/statm") as fh:
        pages = int(fh.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--ring", type=int, default=10_000)
    parser.add_argument("--per-step", type=int, default=100)
    args = parser.parse_args(argv)
    x = torch.ones(4)
    out = tempfile.mkdtemp(prefix="copytrace-ring-")
    steps = args.events // args.per_step
    t0 = time.perf_counter()
    with copytrace.trace(out, ring=args.ring) as t:
        for s in range(steps):
            for _ in range(args.per_step):
                x.clone()
            t.step()
            if (s + 1) % max(1, steps // 10) == 0:
                done = (s + 1) * args.per_step
                print(f"{done:>9,d} events  rss {rss_mb():7.1f} MiB  buffered {len(t.events):,d}")
    print(f"{time.perf_counter() - t0:.1f} s; trace {t.trace_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
