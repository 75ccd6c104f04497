"""What ``copytrace_hook.pth`` imports at interpreter start under ``COPYTRACE=1``.

Every ``COPYTRACE_*`` variable is checked first; then this process joins (or starts) its
launch (:func:`copytrace.launch.activate`) and tracing starts at ``import torch``
(:mod:`copytrace.launch.torch_hook`). Importing this module runs the hook; nothing here
ever raises into the program.
"""

from __future__ import annotations

import os
import sys

from copytrace.launch import torch_hook
from copytrace.launch._state import warn
from copytrace.launch.process import activate, start_session


def _hook() -> None:
    """What the ``.pth`` hook runs under ``COPYTRACE=1``.

    Every ``COPYTRACE_*`` variable is checked first: with one not accepted, one line names
    it and the accepted values, and the program runs untraced. ``COPYTRACE`` is then set to
    ``0`` for the processes it starts, so that the line is printed once per launch.
    """
    from copytrace import _env

    errors = _env.check()
    if not errors:
        problem = _env.unwritable(_env.output_dir(), create=False)
        if problem:
            errors = [problem]
    if errors:
        warn(f"{errors[0]}; tracing disabled")
        os.environ[_env.COPYTRACE] = "0"
        return
    activate()
    if "torch" in sys.modules:  # imported by another start-up hook before ours
        start_session()
    else:
        torch_hook.install()



# --- the hook entry point ------------------------------------------------------------------------
def _hook_main() -> None:
    from copytrace import _env

    try:
        on = _env.enabled()
    except _env.SettingError as err:  # COPYTRACE itself is neither on nor off
        warn(f"{err}; tracing disabled")
        return
    if on:
        _hook()


try:
    _hook_main()
except Exception as _err:  # pragma: no cover - the hook must never break start-up
    warn(f"tracing disabled: {type(_err).__name__}: {_err}")

