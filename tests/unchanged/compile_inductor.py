"""torch.compile with the inductor backend on CPU: a small compiled training step (forward and
backward graphs), and a function compiled with ``mode="reduce-overhead"`` (CUDA graphs are
skipped on CPU, the function still runs compiled by inductor).

Inductor's generated code fuses and reorders float arithmetic, so an eager run would give other
last digits: the losses printed with ``repr`` show whether the compiled code really ran.
"""

import _observe as ob
import torch
import torch.nn as nn

ob.watch_warnings()
torch.manual_seed(0)

with ob.section("inductor training step"):
    model = nn.Sequential(nn.Linear(12, 24), nn.Tanh(), nn.Linear(24, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    @torch.compile(backend="inductor")
    def loss_fn(x, y):
        return (model(x).squeeze(-1) - y).square().mean()

    for step in range(3):
        x, y = torch.randn(16, 12), torch.randn(16)
        loss = loss_fn(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        print("step", step, "loss", repr(loss.item()))
    for name, p in model.named_parameters():
        ob.show(name, p)

with ob.section('mode="reduce-overhead"'):

    @torch.compile(mode="reduce-overhead")
    def smooth(x):
        return torch.tanh(x) * torch.sigmoid(x * 1.7)

    for _ in range(3):
        ob.show("smooth", smooth(torch.linspace(-3, 3, 40).reshape(4, 10)))

ob.dynamo_counters()
