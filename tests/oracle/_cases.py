"""Cases from PyTorch's own test databases, shipped in the torch wheel.

- ops: ``torch.testing._internal.common_methods_invocations.op_db`` (``OpInfo``): each
  ``SampleInput`` of ``op.sample_inputs("cpu", dtype, requires_grad=...)`` is run as
  ``op(sample.input, *sample.args, **sample.kwargs)``, then backward through
  ``sample.output_process_fn_grad(out)`` where the op supports autograd for the dtype.
- modules: ``common_modules.module_db`` (``ModuleInfo``): each ``ModuleInput`` of
  ``module_inputs_func(info, device="cpu", dtype=float32, requires_grad=True, training=True)``
  builds the module, runs forward and backward, ``state_dict`` / ``load_state_dict`` (with and
  without ``assign=True``), ``deepcopy``, ``.data`` aliasing and assignment, ``to(float64)``, and
  the same conversions on the swap path
  (``torch.__future__.set_swap_module_params_on_conversion(True)``, restored after).
- optimizers: ``common_optimizers.optim_db`` (``OptimizerInfo``): each ``OptimizerInput`` of
  ``optim_inputs_func(device="cpu", dtype=float32)`` drives three steps on a small model
  (an embedding with sparse gradients for SparseAdam) and round-trips ``state_dict``.

Each builder returns a function that builds the cases fresh: the harness calls it once per run,
seeded, so every run starts from equal inputs.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from ._harness import FAILED, Case, Probe, seed_all

__all__ = ["op_db", "module_db", "optim_db", "op_name", "op_cases", "module_cases", "optim_cases"]

#: ops whose outputs are uninitialised memory: their values are not compared (meta is)
UNINITIALISED = {"empty", "empty_like", "empty_strided", "empty_permuted", "new_empty", "new_empty_strided"}


def op_db() -> list[Any]:
    from torch.testing._internal.common_methods_invocations import op_db as db

    return list(db)


def module_db() -> list[Any]:
    from torch.testing._internal.common_modules import module_db as db

    return list(db)


def optim_db() -> list[Any]:
    from torch.testing._internal.common_optimizers import optim_db as db

    return list(db)


def op_name(op: Any) -> str:
    return op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def _backward(probe: Probe, name: str, out: Any) -> None:
    outs = [
        t
        for t in _tensors(out)
        if t.requires_grad and (t.dtype.is_floating_point or t.dtype.is_complex)
    ]
    if outs:
        probe.step(name, torch.autograd.backward, outs, [torch.ones_like(t) for t in outs])


# -- ops --------------------------------------------------------------------------------------


def op_cases(op: Any, dtype: torch.dtype = torch.float32, samples: int | None = 1) -> Callable[[], list[Case]]:
    """The builder of ``op``'s first ``samples`` samples (all with None) for ``dtype``."""
    grad = bool(op.supports_autograd) and dtype in op.supported_backward_dtypes("cpu")
    values = op.name not in UNINITIALISED

    def build() -> list[Case]:
        cases = []
        # with gradients, and without: some forward kernels branch on whether the input
        # may need a gradient (torch's _may_require_fw_or_bw_grad: linalg.svdvals...)
        for g in (True, False) if grad else (False,):
            items = itertools.islice(op.sample_inputs("cpu", dtype, requires_grad=g), samples)
            tag = "" if g == grad else " nograd"
            cases += [(f"{op_name(op)}[{i}]{tag}", partial(_run_op, op, s, g, values)) for i, s in enumerate(items)]
        return cases

    return build


def _run_op(op: Any, sample: Any, grad: bool, values: bool, probe: Probe) -> None:
    inputs = _tensors((sample.input, sample.args, sample.kwargs))
    out = probe.step("forward", op, sample.input, *sample.args, **sample.kwargs)
    if out is FAILED:
        probe.inputs("forward", inputs)
        return
    if grad:
        processed = probe.step("process", sample.output_process_fn_grad, out)
        if processed is not FAILED:
            _backward(probe, "backward", processed)
        del processed
        probe.note("backward/grad", [t.grad if t.is_leaf else None for t in inputs])
    probe.inputs("forward", inputs)  # the output still alive, as in the program
    probe.note("forward/output", out, inputs, values)


# -- modules ----------------------------------------------------------------------------------


class _Swap:
    """``torch.__future__``'s swap-on-conversion flag set, and restored after."""

    def __enter__(self) -> None:
        self.saved = torch.__future__.get_swap_module_params_on_conversion()
        torch.__future__.set_swap_module_params_on_conversion(True)

    def __exit__(self, *exc: Any) -> None:
        torch.__future__.set_swap_module_params_on_conversion(self.saved)


def module_cases(info: Any, inputs: int | None = 1) -> Callable[[], list[Case]]:
    """The builder of ``info``'s first ``inputs`` module inputs (all with None), float32."""

    def build() -> list[Case]:
        items = info.module_inputs_func(info, device="cpu", dtype=torch.float32, requires_grad=True, training=True)
        return [
            (f"{info.name}[{i}]", partial(_run_module, info, mi))
            for i, mi in enumerate(items[:inputs] if inputs else items)
        ]

    return build


def _state(module: torch.nn.Module) -> dict[str, Any]:
    return dict(module.state_dict(keep_vars=True))


def _run_module(info: Any, mi: Any, probe: Probe) -> None:
    ctor = mi.constructor_input

    def make() -> torch.nn.Module:
        seed_all()
        return info.module_cls(*ctor.args, **ctor.kwargs)

    m = probe.step("construct", make)
    if m is FAILED:
        return
    if mi.forward_input is not None:
        _module_forward(probe, m, mi.forward_input)
    _module_state(probe, m, make)
    _module_conversions(probe, m, make)


def _module_forward(probe: Probe, m: torch.nn.Module, fwd: Any) -> None:
    inputs = _tensors((fwd.args, fwd.kwargs))
    out = probe.step("forward", m, *fwd.args, **fwd.kwargs)
    if out is not FAILED:
        _backward(probe, "backward", out)
        probe.note("backward/grad/params", {n: p.grad for n, p in m.named_parameters()})
        probe.note("backward/grad/inputs", [t.grad if t.is_leaf else None for t in inputs])
    probe.inputs("forward", inputs + list(m.parameters()))
    probe.note("forward/output", out, inputs)


def _module_state(probe: Probe, m: torch.nn.Module, make: Callable[[], torch.nn.Module]) -> None:
    params = list(m.parameters()) + list(m.buffers())
    sd = probe.step("state_dict", m.state_dict)
    probe.inputs("state_dict", params)  # while the state dict lives
    if sd is FAILED:
        return
    probe.note("state_dict/state", sd, params)
    fresh = make()
    probe.note("load_state_dict/output", probe.step("load_state_dict", fresh.load_state_dict, sd))
    probe.note("load_state_dict/state", _state(fresh), list(sd.values()))
    fresh = make()
    result = probe.step("load_state_dict_assign", fresh.load_state_dict, sd, assign=True)
    probe.note("load_state_dict_assign/output", result)
    probe.note("load_state_dict_assign/state", _state(fresh), list(sd.values()))
    probe.inputs("load_state_dict_assign", list(sd.values()))
    copied = probe.step("deepcopy", copy.deepcopy, m)
    if copied is not FAILED:
        probe.note("deepcopy/state", _state(copied), params)
        probe.note("deepcopy/grad/params", {n: p.grad for n, p in copied.named_parameters()})
    del copied, fresh, sd


def _module_conversions(probe: Probe, m: torch.nn.Module, make: Callable[[], torch.nn.Module]) -> None:
    params = list(m.parameters())
    if params:
        alias = params[0].data
        probe.inputs("data_alias", params)  # while a .data alias lives
        del alias
        probe.step("data_set", setattr, params[0], "data", params[0].data.clone())
        probe.inputs("data_set", params)
    before = [id(p) for p in m.parameters()]
    probe.step("to_float64", m.to, torch.float64)
    probe.note("to_float64/state", _state(m))
    probe.note("to_float64/output/identity", [id(p) == i for p, i in zip(m.parameters(), before, strict=False)])
    del params
    with _Swap():
        swapped = make()
        probe.step("swap_to", swapped.to, torch.float64)
        probe.note("swap_to/state", _state(swapped))
        swapped = make()
        sd = swapped.state_dict()
        probe.step("swap_to_after_state_dict", swapped.to, torch.float64)
        probe.note("swap_to_after_state_dict/state", _state(swapped))
        del sd
        swapped = make()
        first = next(iter(swapped.parameters()), None)
        alias = None if first is None else first.data
        probe.step("swap_to_with_data_alias", swapped.to, torch.float64)
        del alias, first
        swapped, source = make(), make()
        sd = source.state_dict()
        probe.step("swap_load_state_dict", swapped.load_state_dict, sd)
        probe.note("swap_load_state_dict/state", _state(swapped))
        del sd, swapped, source


# -- optimizers -------------------------------------------------------------------------------


def optim_cases(info: Any, inputs: int | None = 1) -> Callable[[], list[Case]]:
    """The builder of ``info``'s first ``inputs`` optimizer inputs (all with None)."""

    def build() -> list[Case]:
        items = info.optim_inputs_func(device="cpu", dtype=torch.float32)
        name = info.optim_cls.__name__
        return [
            (f"{name}[{i}:{oi.desc}]", partial(_run_optim, info, oi))
            for i, oi in enumerate(items[:inputs] if inputs else items)
        ]

    return build


def _small_model(sparse: bool) -> tuple[torch.nn.Module, torch.Tensor]:
    seed_all()
    if sparse:
        return torch.nn.Embedding(10, 3, sparse=True), torch.tensor([1, 4, 4, 7])
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
    return model, torch.randn(5, 4)


def _train_step(model: torch.nn.Module, opt: Any, x: torch.Tensor, closure: bool) -> Any:
    def loss_fn() -> torch.Tensor:
        opt.zero_grad()
        loss = model(x).square().sum()
        loss.backward()
        return loss

    if closure:
        return opt.step(loss_fn)
    loss = loss_fn()
    opt.step()
    return loss


def _run_optim(info: Any, oi: Any, probe: Probe) -> None:
    sparse = bool(info.only_supports_sparse_grads)
    model, x = _small_model(sparse)
    kwargs = dict(oi.kwargs)
    opt = probe.step("construct", info.optim_cls, model.parameters(), **kwargs)
    if opt is FAILED:
        return
    closure = bool(info.step_requires_closure)
    for i in range(3):
        probe.note(f"step{i}/output", probe.step(f"step{i}", _train_step, model, opt, x, closure))
        probe.note(f"step{i}/state", list(model.parameters()))
    sd = probe.step("state_dict", opt.state_dict)
    probe.inputs("optimizer", list(model.parameters()))
    if sd is FAILED:
        return
    probe.note("state_dict/state", sd)
    other, _ = _small_model(sparse)
    opt2 = info.optim_cls(other.parameters(), **kwargs)
    probe.step("load_state_dict", opt2.load_state_dict, copy.deepcopy(sd))
    probe.note("load_state_dict/state", opt2.state_dict())
    probe.step("load_state_dict_step", _train_step, other, opt2, x, closure)
    probe.note("load_state_dict_step/state", list(other.parameters()))
    probe.step("reload", opt.load_state_dict, sd)
    probe.step("reload_step", _train_step, model, opt, x, closure)
    probe.note("reload_step/state", list(model.parameters()))
