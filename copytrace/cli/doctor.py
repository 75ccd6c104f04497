"""``copytrace doctor``: which aten-level path tracing uses here, and why; and a warning line
when this torch is not a release copytrace is tested on (:data:`copytrace._env.TORCH_TESTED`)."""

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
    if not _env.torch_tested(torch.__version__):
        (old, new) = (".".join(map(str, r)) for r in _env.TORCH_TESTED)
        print(
            f"warning: torch {torch.__version__} is outside the releases copytrace is tested on "
            f"({old} to {new}): copies and hazards may be missed without an error"
        )
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
