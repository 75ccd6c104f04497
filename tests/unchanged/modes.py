"""The program's own torch modes must see exactly the calls the program makes: a counting
TorchFunctionMode and TorchDispatchMode around copies, a deepcopy of a module and a training
step; torch's FlopCounterMode; and ``with torch.device(...)`` (itself a TorchFunctionMode)
for module and tensor creation.
"""

import collections
import copy

import _observe as ob
import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode, resolve_name
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

ob.watch_warnings()
torch.manual_seed(0)


class CountFunctions(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls[resolve_name(func) or getattr(func, "__name__", str(func))] += 1
        return func(*args, **(kwargs or {}))


class CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def workload():
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 2))
    x = torch.randn(5, 6)
    snap = copy.deepcopy(model)
    c = copy.copy(x)
    d = x.detach().clone().to(torch.float64).float().contiguous()
    e = x.data.t().reshape(-1)
    f = torch.tensor(x.sum().item())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loss = model(x).square().mean() + (d - c).abs().sum() * 0 + e.sum() * 0 + f * 0
    opt.zero_grad()
    loss.backward()
    opt.step()
    state = copy.deepcopy(model.state_dict())
    return loss, snap, state


with ob.section("user TorchFunctionMode"):
    with CountFunctions() as fm:
        loss, snap, state = workload()
    print("loss", repr(loss.item()))
    print("function calls", sum(fm.calls.values()), sorted(fm.calls.items()))

with ob.section("user TorchDispatchMode"):
    with CountOps() as dm:
        loss, snap, state = workload()
    print("loss", repr(loss.item()))
    print("aten ops", sum(dm.ops.values()), sorted(dm.ops.items()))

with ob.section("both, nested"):
    with CountFunctions() as fm, CountOps() as dm:
        t = torch.arange(12.0).reshape(3, 4)
        u = copy.deepcopy(t).t().contiguous().clone()
    ob.show("u", u)
    print("function calls", sorted(fm.calls.items()))
    print("aten ops", sorted(dm.ops.items()))

with ob.section("FlopCounterMode"):
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 10))
    counter = FlopCounterMode(display=False)
    with counter:
        model(torch.randn(16, 32)).logsumexp(-1).sum().backward()
    print("total flops", counter.get_total_flops())
    counts = counter.get_flop_counts()
    print(
        "flops by module",
        sorted((m, sorted((str(k), v) for k, v in c.items())) for m, c in counts.items()),
    )

with ob.section('with torch.device("meta")'):
    with torch.device("meta"):
        big = nn.Linear(1024, 1024)
        z = torch.zeros(3, 4)
        y = torch.randn(2) + 1
    ob.show("meta weight", big.weight)
    ob.show("meta zeros", z)
    ob.show("meta randn", y)
    big.to_empty(device="cpu")
    print("materialized", big.weight.device, tuple(big.weight.shape))

with ob.section('with torch.device("cpu")'):
    src = torch.randn(4)
    with torch.device("cpu"):
        lin = nn.Linear(4, 3)
        a = torch.ones(2, 2)
        b = torch.as_tensor(src)
        c = src.clone()
    print("same object", b is src)
    ob.show("linear out", lin(src))
    ob.show("ones", a)
    ob.show("clone", c)

raise SystemExit(3)  # the exit status is the program's, traced or not
