"""torch.compile with the aot_eager backend: a training step with a graph break, fullgraph=True,
a recompile, input and buffer mutations, and a compiled ``.data`` mutation that makes a later
backward raise (it does not raise eagerly: only the compiled program bumps the version counter).

A counting backend (aot_eager inside) counts the calls into compiled graphs, so that code that
silently ran eagerly shows up as a different count.
"""

import _observe as ob
import torch
import torch.nn as nn
from torch._dynamo.backends.debugging import aot_eager

ob.watch_warnings()
torch.manual_seed(0)
GRAPH_CALLS = [0]


def counting_aot_eager(gm, example_inputs):
    compiled = aot_eager(gm, example_inputs)

    def run(*args):
        GRAPH_CALLS[0] += 1
        return compiled(*args)

    return run


class Block(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x):
        self.seen.add_(1)  # buffer mutation inside the compiled region
        h = self.lin(x.float())  # a cast copy in the graph
        snap = h.clone()
        if snap.abs().mean() > 100:  # data-dependent branch: a graph break
            h = h * 0.5
        return torch.relu(h) + snap


with ob.section("training step, graph break"):
    model = torch.compile(nn.Sequential(Block(), Block()), backend=counting_aot_eager)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(4):
        xb = torch.randn(8, 16, dtype=torch.float64)
        loss = model(xb).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        print("step", step, "loss", repr(loss.item()))
    for name, p in model.named_parameters():
        ob.show(name, p)
    print("seen", [repr(b.item()) for b in model.buffers()])
    print("graph calls", GRAPH_CALLS[0])


with ob.section("fullgraph=True"):

    @torch.compile(backend="aot_eager", fullgraph=True)
    def gelu_mlp(x, w):
        return torch.nn.functional.gelu(x @ w).sum(-1)

    w = torch.randn(5, 3, requires_grad=True)
    out = gelu_mlp(torch.randn(4, 5), w)
    out.sum().backward()
    ob.show("fullgraph out", out)
    ob.show("fullgraph w.grad", w.grad)


with ob.section("fullgraph=True with a graph break raises"):

    @torch.compile(backend="aot_eager", fullgraph=True)
    def breaks(x):
        if x.sum() > 0:  # data-dependent: not allowed with fullgraph=True
            return x + 1
        return x - 1

    breaks(torch.ones(3))


with ob.section("recompile on a new dtype"):

    @torch.compile(backend="aot_eager", dynamic=False)
    def scale(x):
        return x * 3 + 1

    for dtype in (torch.float32, torch.float64, torch.float32):
        ob.show(f"scale {dtype}", scale(torch.arange(4, dtype=dtype)))


with ob.section("input mutation"):

    @torch.compile(backend="aot_eager")
    def bump_(x, y):
        x.add_(1)  # mutates the caller's tensor
        y[0] = -5.0  # index_put_ on an input
        return x * 2

    a, b = torch.zeros(3), torch.ones(4)
    r = bump_(a, b)
    ob.show("returned", r)
    ob.show("mutated a", a)
    ob.show("mutated b", b)
    print("versions", a._version, b._version)


with ob.section("compiled .data mutation, then backward"):

    @torch.compile(backend="aot_eager")
    def rescale_(w):
        w.data.mul_(2)

    w = torch.ones(3, requires_grad=True)
    y = (w * w).sum()
    rescale_(w)
    ob.show("w after rescale", w)
    y.backward()  # raises: the compiled mutation bumped w's version counter
    ob.show("w.grad", w.grad)

ob.dynamo_counters()
