"""``redundant-copy``'s chain rule and casts that round: a chain of copies on one line is
redundant only when folding it into one call gives the same values, that is when no step but
the last narrows the dtype. ``x.to(torch.bfloat16).float()`` rounds on purpose (fake
quantisation, an eval-time precision check); ``x.double().float()`` gives ``x`` back exactly.

Each program's truth is read by a plain ``TorchDispatchMode``: the dtypes of the ``_to_copy``
ops it ran, and whether the chain's values differ from one direct cast.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import copytrace
from copytrace.analysis import analyze, format_findings


class Casts(TorchDispatchMode):
    """Ground truth: ``(input dtype, result dtype)`` of every ``aten::_to_copy``."""

    def __init__(self) -> None:
        super().__init__()
        self.casts: list[tuple[torch.dtype, torch.dtype]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket is torch.ops.aten._to_copy:
            self.casts.append((args[0].dtype, out.dtype))
        return out


# (chain, input dtype, whether redundant-copy must fire)
CHAINS: list[tuple[str, Callable[[torch.Tensor], torch.Tensor], torch.dtype, bool]] = [
    ("bf16-round", lambda x: x.to(torch.bfloat16).float(), torch.float32, False),
    ("fp16-round", lambda x: x.half().float(), torch.float32, False),
    ("int8-quantise", lambda x: (x * 10).to(torch.int8).float(), torch.float32, False),
    ("f64-lossless", lambda x: x.double().float(), torch.float32, True),
    ("f16-widen-twice", lambda x: x.float().double(), torch.float16, True),
]


@pytest.mark.parametrize(("name", "chain", "dtype", "fires"), CHAINS, ids=[c[0] for c in CHAINS])
def test_a_chain_is_redundant_only_when_no_step_but_the_last_narrows(
    name: str, chain: Callable[[torch.Tensor], torch.Tensor], dtype: torch.dtype, fires: bool
) -> None:
    torch.manual_seed(0)
    x = torch.randn(16, 48, dtype=dtype)
    with Casts() as truth:
        folded = chain(x)
    direct = x.to(truth.casts[-1][1])
    # folding changes the values exactly when the first cast narrows
    assert torch.equal(folded, direct) == fires, name
    assert len(truth.casts) == 2

    def program(t: copytrace.Trace) -> None:
        for _ in range(3):
            program.out = chain(x)  # type: ignore[attr-defined]
            t.step()

    with copytrace.trace(write=False) as t:
        program(t)
    # the trace's casts are the dispatch level's, step after step
    names = [(str(a).removeprefix("torch."), str(b).removeprefix("torch.")) for a, b in truth.casts]
    assert [(e.src_dtype, e.dtype) for e in t.events if not e.alias] == names * 3
    findings = analyze(t.events)
    assert ("redundant-copy" in [f.code for f in findings]) == fires, format_findings(findings)
