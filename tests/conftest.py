"""Shared fixtures: every test must leave no copytrace mode, hook or patch installed."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.overrides import _get_current_function_mode_stack
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

_DEEPCOPY = copy.deepcopy
_COPY = copy.copy
_SWAP = torch.utils.swap_tensors
_FROM_NUMPY = torch.from_numpy
_PARAM_DEEPCOPY = torch.nn.Parameter.__deepcopy__
_STEP_CODE = torch.optim.Optimizer._optimizer_step_code.__code__


@pytest.fixture(autouse=True)
def _no_tracer_left_behind():
    yield
    assert _get_current_function_mode_stack() == [], "a TorchFunctionMode was left active"
    assert _get_current_dispatch_mode_stack() == [], "a TorchDispatchMode was left active"
    assert copy.deepcopy is _DEEPCOPY, "copy.deepcopy was left patched"
    assert copy.copy is _COPY, "copy.copy was left patched"
    assert torch.utils.swap_tensors is _SWAP, "torch.utils.swap_tensors was left patched"
    assert torch.from_numpy is _FROM_NUMPY, "torch.from_numpy was left patched"
    assert torch.nn.Parameter.__deepcopy__ is _PARAM_DEEPCOPY, "Parameter.__deepcopy__ left patched"
    assert torch.optim.Optimizer._optimizer_step_code.__code__ is _STEP_CODE, "step code left"
    from copytrace.tracer import _recorder, session

    assert _recorder.active_recorder() is None
    assert session.active_session() is None
