"""torch's own modes and transforms around copies: FakeTensorMode (clone and deepcopy of a fake
tensor, a module deep-copied into fakes under FakeCopyMode), ``torch.func`` (grad, vmap,
jacrev), CPU autocast to bfloat16 in a training step, and activation checkpointing with
``use_reentrant=False`` and ``True`` (with its warning when no input requires grad).
"""

import copy

import _observe as ob
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

ob.watch_warnings()
torch.manual_seed(0)


def fake_facts(name, t):
    print(f"{name}: {type(t).__name__} {t.dtype} {tuple(t.shape)} {t.stride()} dev={t.device}")


with ob.section("FakeTensorMode: clone and deepcopy"):
    from torch._subclasses.fake_tensor import FakeCopyMode, FakeTensorMode

    mode = FakeTensorMode()
    with mode:
        f = torch.empty(64, 32)
        g = f.clone()
        h = copy.deepcopy(f)
        k = f.t().contiguous()
        m = f.to(torch.float64)
    for name, t in (("f", f), ("clone", g), ("deepcopy", h), ("t.contiguous", k), ("to", m)):
        fake_facts(name, t)
    print("deepcopy is f", h is f)

with ob.section("FakeCopyMode: deepcopy of a module"):
    real = nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 2))
    with FakeCopyMode(FakeTensorMode()):
        fake = copy.deepcopy(real)
    for name, p in fake.named_parameters():
        fake_facts(name, p)
    ob.show("real weight untouched", real[0].weight)

with ob.section("torch.func: grad, vmap, jacrev"):
    from torch.func import grad, jacrev, vmap

    def energy(x):
        return (x.sin() * x.clone()).sum()

    x = torch.linspace(-1, 1, 6)
    ob.show("grad", grad(energy)(x))
    batch = torch.randn(4, 6)
    ob.show("vmap(grad)", vmap(grad(energy))(batch))
    ob.show("vmap(dot)", vmap(torch.dot)(batch, batch.flip(0).contiguous()))
    ob.show("vmap copies", vmap(lambda r: r.detach().clone().to(torch.float64) * 2)(batch))
    ob.show("jacrev", jacrev(lambda r: r.exp().cumsum(0))(x))

with ob.section("autocast cpu bfloat16"):
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(2):
        x = torch.randn(8, 16)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
            loss = out.float().pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        ob.show(f"autocast out {step}", out)
        print("loss", repr(loss.item()))
    for name, p in model.named_parameters():
        ob.show(name, p)

with ob.section("checkpoint"):
    block = nn.Sequential(nn.Linear(10, 10), nn.Tanh(), nn.Linear(10, 10))
    for reentrant in (False, True):
        x = torch.randn(3, 10, requires_grad=True)
        y = checkpoint(block, x, use_reentrant=reentrant)
        y.square().sum().backward()
        ob.show(f"checkpoint reentrant={reentrant} x.grad", x.grad)
        ob.show(f"checkpoint reentrant={reentrant} w.grad", block[0].weight.grad)
        block.zero_grad()
    # no input requires grad: reentrant checkpointing warns, and no gradient reaches the block
    y = checkpoint(block, torch.randn(3, 10), use_reentrant=True)
    print("no-grad-input output requires grad", y.requires_grad)
