"""``S(t)``, the legacy constructor of a tensor subclass, as untraced on the Python fallback.

``class S(torch.Tensor)`` without a ``__new__`` of its own is built by ``TensorBase.__new__``
(``S(t)``, ``S([1.0])``, ``S(3)``, ``super().__new__(cls, t)``): torch's ``base_tensor_ctor``
(torch/csrc/utils/tensor_new.cpp) makes the tensor through the dispatcher (``t.alias()``,
``lift_fresh``, ``empty``) and then gives it an ``S`` object (``THPVariable_NewWithVar``). Under
any Python dispatch mode the mode's handler has by then given that tensor a plain ``Tensor``
object, and torch raises "Creating a new Tensor subclass S but the raw Tensor object is
already associated to a python object". ``Tensor._make_subclass`` (``nn.Parameter``) and
``as_subclass`` set the modes aside themselves and are not affected.

While the fallback's dispatch mode is engaged, ``torch.Tensor.__new__`` (inherited from
``TensorBase`` untraced) is :func:`_traced_tensor_new`, installed and removed with
copytrace's other patches (``_patches.EXTRA_PATCHES``): a subclass's construction runs with
that mode stepped aside (:func:`~copytrace.tracer.compiled.stepaside.call_without`), so it
returns what it returns untraced, and the mode does not see the ``aten::alias`` or
``lift_fresh`` inside. ``torch.Tensor(...)`` itself, which a mode does not break, runs as it
is, and is recorded where it copies a list of tensors (:mod:`copytrace.tracer._legacy`; so
the wrapper is installed at level ``api`` too, with no mode to step aside). Removing the attribute leaves CPython's generic ``slot_tp_new`` in the classes' ``tp_new``;
:func:`copytrace.tracer._slots.settle_new` puts ``TensorBase``'s back.
"""

from __future__ import annotations

from typing import Any

import torch

from copytrace.tracer._hide import hide_frames
from copytrace.tracer._legacy import tensor_call
from copytrace.tracer.compiled.stepaside import call_without

__all__ = ["end", "patch"]

_Tensor = torch.Tensor
#: ``TensorBase.__new__``, which ``torch.Tensor`` inherits untraced
_ORIG_NEW = _Tensor.__new__
#: the fallback's dispatch mode while it is engaged, and the running trace's recorder
_ENGAGED: list[Any] = [None, None]


def _traced_tensor_new(cls: type, *args: Any, **kwargs: Any) -> Any:
    """``torch.Tensor.__new__(cls, *args, **kwargs)``: for a subclass ``cls`` with the
    fallback's dispatch mode off this thread's stack while it runs (where it is on it: not on
    another thread, nor inside a compiled call, where copytrace has lifted it); for
    ``torch.Tensor`` itself recorded where it copies a list of tensors (``_legacy.py``).
    Returns and raises what the original does."""
    mode, rec = _ENGAGED
    try:
        if cls is _Tensor:
            return tensor_call(rec, _ORIG_NEW, args, kwargs)
        if mode is None:
            return _ORIG_NEW(cls, *args, **kwargs)
        # the mode is taken off this thread's stack where it is on it (else: a plain call)
        return call_without(mode, _ORIG_NEW, (cls, *args), kwargs)
    except BaseException as err:  # the program's error: its traceback as untraced
        hide_frames(err, rec)
        raise


def patch(mode: Any, rec: Any, missing: Any) -> tuple[Any, str, Any, Any]:
    """The ``EXTRA_PATCHES`` entry ``(owner, name, original, replacement)`` for
    ``torch.Tensor.__new__`` while dispatch ``mode`` is the fallback's (None: level ``api``,
    no dispatch mode; ``rec``: its recorder,
    which counts a traceback that cannot be relinked; ``missing``: the original where
    ``torch.Tensor`` has none of its own, as untraced)."""
    _ENGAGED[:] = [mode, rec]
    orig = _Tensor.__dict__.get("__new__", missing)
    return (_Tensor, "__new__", orig, staticmethod(_traced_tensor_new))


def end() -> None:
    """The fallback disengaged: the wrapper, wherever a program kept it, calls straight
    through and refers to no mode or recorder."""
    _ENGAGED[:] = [None, None]
