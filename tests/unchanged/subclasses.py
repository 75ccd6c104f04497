"""Tensor subclasses: ``S(t)``, ``Tensor._make_subclass``, ``as_subclass``, an ``nn.Parameter``
subclass through deepcopy / ``.to`` / an optimizer, a ``__torch_function__`` subclass counting
its calls, a wrapper subclass with ``__torch_dispatch__`` (two tensors in one), and a latent
sampler subclass whose ``.to`` re-wraps itself and sets ``.data`` (``S(self)`` of a tensor made
a moment before, the pattern that fails under any Python dispatch mode).
"""

import collections
import copy

import _observe as ob
import torch
import torch.nn as nn
from torch.utils._pytree import tree_map

ob.watch_warnings()
torch.manual_seed(0)


class Plain(torch.Tensor):
    pass


with ob.section("S(t) of a fresh tensor"):
    t = torch.randn(4, 3)
    s = Plain(t)
    ob.show("S(t)", s)
    print("same storage", s.data_ptr() == t.data_ptr())
    ob.show("S(t) * 2", s * 2)
    ob.show("S(t).clone()", s.clone())
    ob.show("S(t).detach()", s.detach())
    ob.show("S(arange)", Plain(torch.arange(6.0).reshape(2, 3)))

with ob.section("_make_subclass and as_subclass"):
    base = torch.randn(5)
    m = torch.Tensor._make_subclass(Plain, base, True)
    ob.show("_make_subclass", m)
    (m * m).sum().backward()
    ob.show("_make_subclass grad", m.grad)
    a = torch.randn(2, 2).as_subclass(Plain)
    ob.show("as_subclass", a)
    ob.show("as_subclass back", a.as_subclass(torch.Tensor))
    print("types", type(a + 1).__name__, type(a.sum()).__name__, type(a[0]).__name__)


class TaggedParameter(nn.Parameter):
    """A Parameter subclass carrying a tag, as quantization and sharding libraries do."""

    def __new__(cls, data=None, requires_grad=True, tag="w"):
        p = super().__new__(cls, data, requires_grad)
        p.tag = tag
        return p

    def __deepcopy__(self, memo):
        out = TaggedParameter(self.data.clone(), self.requires_grad, tag=self.tag + "'")
        memo[id(self)] = out
        return out


with ob.section("nn.Parameter subclass"):
    lin = nn.Linear(3, 2)
    lin.weight = TaggedParameter(lin.weight.detach().clone(), tag="weight")
    twin = copy.deepcopy(lin)
    print("types", type(lin.weight).__name__, type(twin.weight).__name__, twin.weight.tag)
    opt = torch.optim.Adam(lin.parameters(), lr=0.1)
    for _ in range(2):
        loss = lin(torch.randn(4, 3)).pow(2).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        print("loss", repr(loss.item()))
    ob.show("weight after Adam", lin.weight)
    lin.double()
    print("after .double()", type(lin.weight).__name__, lin.weight.dtype)
    sd = {k: v.clone() for k, v in lin.state_dict().items()}
    print("state_dict", sorted((k, type(v).__name__, str(v.dtype)) for k, v in sd.items()))


class Logged(torch.Tensor):
    """Counts the torch functions called on it (its own ``__torch_function__``)."""

    calls: collections.Counter = collections.Counter()

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        cls.calls[getattr(func, "__name__", str(func))] += 1
        return super().__torch_function__(func, types, args, kwargs or {})


with ob.section("__torch_function__ subclass"):
    x = torch.randn(3, 3).as_subclass(Logged).requires_grad_()
    y = (x.clone() @ x.t()).relu().to(torch.float64).sum()
    y.backward()
    ob.show("Logged grad", x.grad)
    print("Logged calls", sorted(Logged.calls.items()))
    copy.deepcopy(x.detach())  # raises: no new_empty() returning a Logged


class Pair(torch.Tensor):
    """A wrapper subclass holding two tensors; every aten op applies to both."""

    @staticmethod
    def __new__(cls, a, b):
        return torch.Tensor._make_wrapper_subclass(
            cls, a.shape, strides=a.stride(), dtype=a.dtype, device=a.device,
            requires_grad=a.requires_grad,
        )  # fmt: skip

    def __init__(self, a, b):
        self.a, self.b = a, b

    def __repr__(self):
        return f"Pair({ob.digest(self.a)}, {ob.digest(self.b)})"

    ops: collections.Counter = collections.Counter()

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        cls.ops[str(func)] += 1
        kwargs = kwargs or {}
        first = func(*tree_map(lambda v: v.a if isinstance(v, Pair) else v, args), **kwargs)
        second = func(*tree_map(lambda v: v.b if isinstance(v, Pair) else v, args), **kwargs)
        if isinstance(first, torch.Tensor):
            return Pair(first, second)
        return first


with ob.section("wrapper subclass with __torch_dispatch__"):
    p = Pair(torch.arange(4.0), torch.ones(4))
    q = (p * 2 + 1).clone()
    r = q.detach()
    print("pair", repr(q), repr(r), repr(p.to(torch.float64)), repr(copy.deepcopy(p)))
    w = Pair(torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True))
    w.requires_grad_(True)
    (w * w).sum().backward()
    print("pair grad", repr(w.grad))
    print("Pair ops", sorted(Pair.ops.items()))


class LatentSampler(torch.Tensor):
    """A sampler of latent vectors; ``.to`` keeps the subclass by re-wrapping itself."""

    def setup(self, kind, **kw):
        self.kind, self.kw = kind, kw

    def sample_(self):
        if self.kind == "normal":
            self.normal_(self.kw["mean"], self.kw["std"])
        else:
            self.random_(0, self.kw["classes"])
        return copy.deepcopy(self).detach()  # raises for a non-wrapper subclass

    def to(self, *args, **kwargs):
        out = LatentSampler(self)  # S(t) of a tensor made a moment before
        out.setup(self.kind, **self.kw)
        out.data = super().to(*args, **kwargs)
        return out


with ob.section("latent sampler: S(self) in .to, .data set, deepcopy"):
    z = LatentSampler(torch.randn(6, 5))
    z.setup("normal", mean=0.0, std=1.0)
    z = z.to("cpu", torch.float32)  # same dtype and device: .to returns self inside
    c = LatentSampler(torch.zeros(6))
    c.setup("categorical", classes=7)
    c = c.to("cpu", torch.int64)  # a dtype change: a real copy
    print(type(z).__name__, z.dtype, type(c).__name__, c.dtype)
    for _ in range(2):
        with ob.section("sample_"):
            ob.show("sample", z.sample_())
