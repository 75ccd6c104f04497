"""Small traces written by the real tracer, for the report, summary and browser tests.

:func:`write_real_trace` traces this program (about 10 ms once torch's first traced op has
run) and returns its trace file::

    step 0  net(w)                  forward of module ``Net.<script>alert(1)</script>``:
                                    w.clone()   copy  4000 B (float32[10, 100]), attached
                                    w.detach()  alias    0 B (next line)
    step 1  copy.deepcopy(Linear(10, 10))  a deepcopy group of 2 copies: 400 B + 40 B
            torch.tensor(w)         copy  4000 B: hazard ``tensor-ctor-copy`` (warning)
    step 2  x.to(torch.float32)     no-op (alias) of float32[40, 100]
            x.t().contiguous()      copy 16000 B

So: 7 events = 5 copies + 1 alias + 1 no-op (1 deepcopy group); 24440 B copied; one hazard,
``tensor-ctor-copy`` with 4000 B at the ``torch.tensor(w)`` line, which the tracer also
writes into the file as a ``copytrace.hazard`` event on a ``copytrace.hazards`` span.
"""

from __future__ import annotations

import copy
import os
import warnings
from pathlib import Path

import torch
import torch.nn as nn

SCRIPT_MODULE = "<script>alert(1)</script>"
EVENTS, COPIES, ALIASES, NOOPS, GROUPS = 7, 5, 1, 1, 1
BYTES_COPIED = 4000 + 400 + 40 + 4000 + 16000  # clone, deepcopy weight + bias, ctor, contiguous
HAZARD_CODE, HAZARD_BYTES = "tensor-ctor-copy", 4000
CONTIGUOUS_BYTES = 16000  # the largest copy: float32[100, 40]


class Net(nn.Module):
    """A root module whose one child is named like markup (it must show as text)."""

    def __init__(self) -> None:
        super().__init__()
        self.add_module(SCRIPT_MODULE, _Enc())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return getattr(self, SCRIPT_MODULE)(x)


class _Enc(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.clone()  # CLONE_LINE
        x.detach()  # DETACH_LINE
        return y


def _program(t) -> None:  # noqa: ANN001 - a copytrace.Trace
    net = Net()
    w = torch.randn(10, 100, requires_grad=True)
    x = torch.randn(40, 100)
    net(w)
    t.step()
    copy.deepcopy(nn.Linear(10, 10))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's own warning against torch.tensor(t)
        torch.tensor(w)  # CTOR_LINE
    t.step()
    x.to(torch.float32)
    x.t().contiguous()  # CONTIGUOUS_LINE


def _line(marker: str) -> int:
    lines = Path(__file__).read_text(encoding="utf-8").splitlines()
    return next(i for i, text in enumerate(lines, 1) if text.rstrip().endswith(marker))


CTOR_SITE = f"_realtrace.py:{_line('# CTOR_LINE')} _program"
CONTIGUOUS_SITE = f"_realtrace.py:{_line('# CONTIGUOUS_LINE')} _program"
CLONE_SITE = f"_realtrace.py:{_line('# CLONE_LINE')} forward"
DETACH_SITE = f"_realtrace.py:{_line('# DETACH_LINE')} forward"


def write_real_trace(directory: Path, *, rank: int | None = None) -> Path:
    """Trace the program of the module doc into ``directory`` and return the trace file.

    Args:
        directory: output directory (created if missing).
        rank: set ``RANK`` while tracing, so that several traces of one process get distinct
            files (``...-rank<N>.otlp.jsonl.gz``) and show as distinct runs.
    """
    import copytrace

    old = os.environ.get("RANK")
    if rank is not None:
        os.environ["RANK"] = str(rank)
    try:
        with copytrace.trace(directory) as t:
            _program(t)
    finally:
        if old is None:
            os.environ.pop("RANK", None)
        else:
            os.environ["RANK"] = old
    assert t.trace_path is not None
    return t.trace_path
