"""``copytrace doctor``: which aten-level path tracing uses here, and why."""

from __future__ import annotations

import argparse
import sys

__all__ = ["register"]


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "doctor",
        help="say whether copytrace's C++ observer or its Python fallback is active, and why",
        description=(
            "Load (building it once if needed, about 25 s) copytrace's C++ copy observer for "
            "this torch build and print which path tracing uses, why, and the cache directory."
        ),
    )
    parser.set_defaults(handler=_doctor)


def _doctor(args: argparse.Namespace) -> int:
    import torch

    from copytrace import _env
    from copytrace.tracer import _native

    level = _env.setting(_env.COPYTRACE_LEVEL)  # a bad value: the CLI's one line, exit 2
    info = _native.status()
    path = info["path"]
    print(f"torch {torch.__version__} (git {getattr(torch.version, 'git_version', '?')[:12]})")
    print(f"COPYTRACE_OBSERVER={info['choice']}")
    if path == "native":
        print(f"aten level: C++ observer ({info['reason']})")
    else:
        print(f"aten level: Python dispatch mode fallback ({info['reason']})")
    if level == "lean" and path != "native":
        print("level: full (COPYTRACE_LEVEL=lean needs the C++ observer: the Python modes trace)")
    else:
        print(f"level: {level} (COPYTRACE_LEVEL)")
    print(f"cache: {info['cache_dir']}")
    sys.stdout.flush()
    return 0
