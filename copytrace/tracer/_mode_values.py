"""What the Python fallback's dispatch mode would change in what ops compute, and how it doesn't.

torch takes other code paths while any Python dispatch mode is on: ``at::isTensorSubclassLike``
(ATen/TensorSubclassLikeUtils.h) is true for every tensor then
(``c10::impl::dispatch_mode_enabled()``). Where such a path rounds differently, the fallback
(``COPYTRACE_OBSERVER=python``, its :class:`~copytrace.tracer._modes.DispatchMode` on torch's
stack for the whole trace) would change a program's numbers. Four kinds, each kept as
untraced:

* forward kernels that compute more (:data:`MODE_SENSITIVE`: torch's
  ``_may_require_fw_or_bw_grad`` in ATen's BatchLinearAlgebra.cpp and LinearAlgebra.cpp makes
  ``svdvals``/``eigvalsh`` ask LAPACK for the vectors too): the call runs with the dispatch
  mode stepped aside;
* ``matmul`` of two 3-D tensors whose batch sizes differ, one of them 1 and not requiring grad
  (:func:`matmul_differs`): ``_matmul_impl`` (LinearAlgebra.cpp) squeezes that batch and folds
  into one ``mm`` where untraced it expands and runs ``bmm``; the call runs with the mode
  stepped aside, and only then;
* ``cross_entropy`` with class weights, label smoothing, ``reduction="mean"`` and class-index
  targets (:func:`cross_entropy_differs`): ``cross_entropy_loss_label_smoothing`` (ATen's
  LossNLL.cpp) divides the smoothing term by the class weights of the targets, summed from
  ``weight.gather`` over the masked-fill'd target when ``isTensorSubclassLike(weight)`` and
  over ``target.masked_select(~ignore_mask)`` untraced: another order of the sum, other bits
  in the loss and in every gradient through it (``nn.CrossEntropyLoss``, ``F.cross_entropy``,
  and ``F.linear_cross_entropy``'s reference path, which calls it); the call runs with the
  mode stepped aside, and only then;
* backward formulas (torch/csrc/autograd/FunctionsManual.cpp): ``prod_backward`` takes
  ``prod_safe_zeros_backward`` (cumulative products) instead of ``grad * result / input``.
  The branch is taken while the node runs, so the forward call cannot step aside for it: each
  such node made under the mode (:data:`GRAD_NODES`, found by :func:`hook_nodes` from the
  call's results) gets a pre-hook, :func:`copytrace.tracer._modes.lift_for_node`, that takes
  the dispatch mode off the stack while that node runs. The autograd engine puts the whole
  thread-local state back after each node (``ThreadLocalStateGuard`` around
  ``evaluate_function`` in engine.cpp ``thread_main``), also when the node raises.

What runs with the mode stepped aside is not seen by it: the implicit copies inside those
calls and nodes go unrecorded on the fallback (the C++ observer records them). Inside
backward the function mode's place is taken by :class:`copytrace.tracer._modes.ValueMode`,
which does the same for the calls it sees (:data:`BACKWARD`: where it is put on the stack).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

__all__ = [
    "BACKWARD",
    "GRAD_NODE",
    "GRAD_NODES",
    "MATMUL",
    "MODE_SENSITIVE",
    "VALUE_CALLS",
    "cross_entropy_differs",
    "grad_node_ops",
    "hook_nodes",
    "matmul_differs",
    "steps_aside",
]

_Tensor = torch.Tensor
_sequence_nr = torch._C._autograd._get_sequence_nr

#: torch functions whose forward kernel computes more while any dispatch mode is on
MODE_SENSITIVE = frozenset(
    (
        torch.linalg.svdvals, torch.linalg.eigvalsh, torch.linalg.eigvals, torch.linalg.cond,
        torch.linalg.matrix_rank, torch.linalg.matrix_norm, torch.linalg.norm,
        torch.nuclear_norm, torch.norm, _Tensor.norm, torch.svd, _Tensor.svd,
    )
)  # fmt: skip
_RMATMUL = _Tensor.__rmatmul__
#: every Python form of ``aten::matmul``; ``__rmatmul__(self, other)`` is ``matmul(other, self)``
MATMUL = frozenset(
    (torch.matmul, _Tensor.matmul, _Tensor.__matmul__, _RMATMUL, torch.linalg.matmul)
)
_F = torch.nn.functional
_CE_LOSS = torch._C._nn.cross_entropy_loss
#: the Python forms of ``aten::cross_entropy_loss`` the function mode sees (``F.linear_cross_entropy``
#: calls ``F.cross_entropy`` inside its handler, where the function mode is off the stack)
CROSS_ENTROPY = frozenset((_F.cross_entropy, _F.linear_cross_entropy, _CE_LOSS))
#: the calls the fallback's function mode looks at before running them
VALUE_CALLS = MODE_SENSITIVE | MATMUL | CROSS_ENTROPY
#: the entry points of a backward pass (each hands itself to ``handle_torch_function``;
#: ``Tensor.backward`` calls ``torch.autograd.backward``): the autograd engine keeps the mode
#: stacks they run under for the nodes it runs (``GraphTask::thread_locals_``)
BACKWARD = frozenset((_Tensor.backward, torch.autograd.backward, torch.autograd.grad))

#: the aten kind (in the dispatch mode's table) of an op whose node's backward branches
GRAD_NODE = -1
#: autograd node types whose backward formula branches on isTensorSubclassLike with other
#: values (``prod_backward``); the oracle over every op sample finds no other
GRAD_NODES = frozenset(("ProdBackward0", "ProdBackward1"))
_GRAD_OPS = ("prod",)  # the aten ops that make them


def grad_node_ops() -> dict[Any, int]:
    """OpOverload -> :data:`GRAD_NODE` for every overload of the ops that make
    :data:`GRAD_NODES` (merged into the dispatch mode's own table)."""
    table: dict[Any, int] = {}
    for name in _GRAD_OPS:
        packet = getattr(torch.ops.aten, name, None)
        if packet is None:
            continue
        for overload in packet.overloads():
            table[getattr(packet, overload)] = GRAD_NODE
    return table


def matmul_differs(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether ``_matmul_impl`` takes another path for these operands while a dispatch mode
    is on: both 3-D, batch sizes differ, and the one of batch 1 does not require grad (torch
    squeezes it when ``requires_grad() || isTensorSubclassLike``; untraced it broadcasts)."""
    if func is _RMATMUL:
        if len(args) < 2:
            return False
        b, a = args[0], args[1]
    else:
        a = args[0] if args else kwargs.get("input")
        b = args[1] if len(args) > 1 else kwargs.get("other")
    if not (isinstance(a, _Tensor) and isinstance(b, _Tensor)) or a.dim() != 3 or b.dim() != 3:
        return False
    na, nb = a.shape[0], b.shape[0]
    if na == nb:
        return False
    return (na == 1 and not a.requires_grad) or (nb == 1 and not b.requires_grad)


def _arg(args: tuple[Any, ...], kwargs: dict[str, Any], at: int, name: str, default: Any) -> Any:
    """The argument at position ``at``, else the keyword ``name``, else ``default``."""
    if 0 <= at < len(args):
        return args[at]
    return kwargs.get(name, default)


def cross_entropy_differs(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether ``cross_entropy_loss_label_smoothing`` (LossNLL.cpp) sums the target's class
    weights in another order while a dispatch mode is on: class weights given, label smoothing
    not 0, reduction mean, and the target holds class indices (an integer tensor; a float
    target of the input's shape is probabilities, ``cross_entropy_loss_prob_target``)."""
    if func is _F.linear_cross_entropy:  # (input, linear_weight, target, *, ...)
        target = _arg(args, kwargs, 2, "target", None)
        weight = kwargs.get("weight")
        mean = kwargs.get("reduction", "mean") == "mean"
        smoothing = kwargs.get("label_smoothing", 0.0)
    elif func is _CE_LOSS:  # (input, target, weight, reduction: int, ignore_index, label_smoothing)
        target = _arg(args, kwargs, 1, "target", None)
        weight = _arg(args, kwargs, 2, "weight", None)
        mean = _arg(args, kwargs, 3, "reduction", 1) == 1  # at::Reduction::Mean
        smoothing = _arg(args, kwargs, 5, "label_smoothing", 0.0)
    else:  # F.cross_entropy(input, target, weight, size_average, ignore_index, reduce, reduction, label_smoothing)
        target = _arg(args, kwargs, 1, "target", None)
        weight = _arg(args, kwargs, 2, "weight", None)
        size_average = _arg(args, kwargs, 3, "size_average", None)
        reduce = _arg(args, kwargs, 5, "reduce", None)
        if size_average is not None or reduce is not None:
            mean = _F._Reduction.legacy_get_string(size_average, reduce, emit_warning=False) == "mean"
        else:
            mean = _arg(args, kwargs, 6, "reduction", "mean") == "mean"
        smoothing = _arg(args, kwargs, 7, "label_smoothing", 0.0)
    return (
        mean
        and weight is not None
        and smoothing != 0.0
        and isinstance(target, _Tensor)
        and not target.is_floating_point()
    )


def steps_aside(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a call of :data:`VALUE_CALLS` must run with the dispatch mode stepped aside."""
    if func in MATMUL:
        return matmul_differs(func, args, kwargs)
    if func in CROSS_ENTROPY:
        return cross_entropy_differs(func, args, kwargs)
    return True


_KEY = object()  # our pre-hook's key in a node's hook dict: never a program's handle id


def hook_nodes(out: Any, since: int, hook: Any) -> int:
    """Give each node of :data:`GRAD_NODES` made since sequence number ``since`` and reachable
    from the tensors in ``out`` the pre-hook ``hook``; return how many got it.

    A node's inputs are older than the node (smaller sequence numbers on one thread), so the
    walk descends only into nodes numbered ``since`` or more: it sees the nodes made by the
    call that returned ``out`` and stops at the program's older graph. The handle's id is
    given back to ``RemovableHandle``'s counter and the hook kept under a key of its own, so
    a program's next hook handle gets the id it gets untraced."""
    if isinstance(out, _Tensor):
        roots = [out]
    else:
        roots = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, _Tensor)]
    stack = [t.grad_fn for t in roots]
    seen: set[Any] = set()
    hooked = 0
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if node._sequence_nr() < since:
            continue
        if type(node).__name__ in GRAD_NODES:
            _register(node, hook)
            hooked += 1
        stack.extend(nxt for nxt, _ in node.next_functions)
    return hooked


def _register(node: Any, hook: Any) -> None:
    handle = node.register_prehook(hook)
    ref = getattr(handle, "hooks_dict_ref", None)
    hooks = ref() if ref is not None else None
    if hooks is None or handle.id not in hooks:
        return
    hooks[_KEY] = hooks.pop(handle.id)  # hooked twice: one entry
    if RemovableHandle.next_id == handle.id + 1:  # no other handle made meanwhile
        RemovableHandle.next_id = handle.id


def sequence_nr() -> int:
    """The sequence number of the newest autograd node made on this thread."""
    return _sequence_nr() - 1
