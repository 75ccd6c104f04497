"""Compiled regions: ``torch.compile``d code runs compiled while tracing, and shows as such.

Every call of a ``torch.compile``d function or module goes through dynamo's
``compile_wrapper`` (``torch/_dynamo/eval_frame.py``), which calls the ``enter_exit_hooks`` of
its ``_TorchDynamoContext`` before it sets the frame-evaluation callback (so before any guard
is checked or any frame compiled) and their cleanups in a ``finally``. While tracing,
copytrace puts a data descriptor for ``enter_exit_hooks`` on that class (it wins over the
instance attribute, so it also covers callables compiled before tracing started) whose value
is the context's own hooks plus copytrace's. On the traced thread, copytrace's hook takes
everything of copytrace that dynamo could see out of the way for the duration of the call:

* its TorchFunctionMode (inside backward on the fallback, its ``ValueMode`` in that place)
  and TorchDispatchMode, wherever they are on torch's mode stacks (the modes above them are
  popped and pushed back; a user's own modes stay where they were);
* its global optimizer step hooks (dynamo would inline them) and its patches of
  ``copy.deepcopy``, ``copy.copy``, ``torch.from_numpy``, ``torch.utils.swap_tensors``,
  ``nn.Parameter.__deepcopy__``, the ``state_dict``/``load_state_dict`` wrappers and level
  ``lean``'s wrappers of ``torch`` functions. Swapping these at every call is costly (each
  ``setattr`` on a class invalidates the type caches of all its subclasses), and dynamo only
  looks at them when it traces a frame (a cache miss: it calls the callback that copytrace
  wraps, see ``Compiled._wrapped``) or evaluates guards that read them. So they stay in place
  and stand aside by themselves while ``Recorder.compiled_depth`` is set (dynamo skips their
  own frames), and are taken away from dynamo's first callback to the end of the outermost
  call. Once a compiled frame's guards read one of them (``Compiled._sensitive``, also run at
  engage over frames compiled before tracing started), they are taken away at every call
  (``Compiled.sticky``), as the guards would otherwise fail.

The cleanup puts everything back exactly as it was. So dynamo compiles the same graphs with
the same guards, and compiled code runs compiled. The backward of a compiled graph (autograd
node ``CompiledFunctionBackward``) runs with copytrace's modes off the stacks too (copytrace
wraps ``torch.autograd.function.BackwardCFunction._get_user_fn`` while tracing); on the C++
observer's path, ``Recorder.compiled_depth`` (or :func:`suspended`) tells the observer to stand
aside. copytrace has no ``nn.Module`` hooks (see :mod:`copytrace.tracer._modules`), so
``OptimizedModule.__call__`` finds none of copytrace's to warn about.

What runs inside a compiled region is not traced op by op. Instead each outermost call
becomes a :class:`CompiledCall` (a ``copytrace.compiled`` span) with the graphs it ran: a
compiled graph is called through a ``torch._dynamo.disable`` wrapper, which asks
``eval_frame._callback_from_stance`` for the callback to restore; copytrace wraps that function
to note which dynamo-generated code called it (its compile id, from dynamo's cache entries).
The copies each graph contains come from torch's structured compile log
(:mod:`copytrace.tracer.compiled.graphs`).

Where the C++ observer is built, the per-call parts are its C functions (``_native/compiled.cpp``:
``compiled_enter``/``compiled_leave``, ``callback_from_stance``, the ``_get_user_fn`` instance
method and ``compiled_backward``), so that a compiled call adds no Python frame of copytrace's
in the common case (the traced thread, not nested, no mode on torch's stacks, not ``sticky``);
every other call goes to :meth:`Compiled.enter`. Both record an ended call as the same tuple
in ``Compiled._raw``, made a :class:`CompiledCall` when the calls are read.

The package: ``_hook.py`` (the descriptor on ``_TorchDynamoContext`` and its enter hook),
``_compiled.py`` (:class:`Compiled`: install, remove, one call), ``_calls.py`` (the calls and
graphs recorded, for the export), ``_aside.py`` (stepping aside: modes, hooks and patches out
of dynamo's sight), ``graphs.py`` (torch's compile log parsed) and ``stepaside.py`` (torch's
mode stacks and hook dicts).

:func:`skip_codes` is public: other rooms hand it the code objects of copytrace's functions
that may be called inside a compiled region (the ``os.exec`` audit hook, called on every audit
event, see :mod:`copytrace.launch.process`), so that dynamo skips them.

Any error here is counted on the recorder (``note_error``), never raised.
"""

from __future__ import annotations

from copytrace.tracer.compiled._aside import copy_patched, skip_codes
from copytrace.tracer.compiled._compiled import Compiled
from copytrace.tracer.compiled._hook import suspended
from copytrace.tracer.compiled.graphs import CompiledCall, CompiledGraphSpan

__all__ = [
    "Compiled",
    "CompiledCall",
    "CompiledGraphSpan",
    "suspended",
    "copy_patched",
    "skip_codes",
]
