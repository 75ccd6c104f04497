"""The torch-import hook: start tracing right after the program's own ``import torch``.

Under ``COPYTRACE=1`` nothing imports torch early: a ``sys.meta_path`` finder waits for the
program's ``import torch``, lets torch's own loader run, then starts this process's trace.
Python processes that never use torch (launcher helpers, ``multiprocessing``'s resource
tracker...) so cost nothing and write no empty trace.
"""

from __future__ import annotations

import sys
from typing import Any

from copytrace.launch._state import S

__all__ = ["TorchImportHook", "install", "remove"]


class TorchImportHook:
    """A ``sys.meta_path`` finder that starts the trace right after ``import torch``."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != "torch":
            return None
        remove()
        try:
            import importlib.util

            spec = importlib.util.find_spec("torch")
        except Exception:
            return None
        loader = getattr(spec, "loader", None) if spec is not None else None
        exec_module = getattr(loader, "exec_module", None)
        if exec_module is None:
            return None

        def exec_then_trace(module: Any) -> None:
            exec_module(module)
            try:
                del loader.exec_module  # back to the class's method
            except AttributeError:
                pass
            from copytrace.launch.process import start_session

            start_session()

        try:
            loader.exec_module = exec_then_trace
        except Exception:
            return None
        return spec

    # find_module is not needed: Python >= 3.4 uses find_spec.


def install() -> None:
    if S.import_hook is None:
        S.import_hook = TorchImportHook()
        sys.meta_path.insert(0, S.import_hook)


def remove() -> None:
    hook, S.import_hook = S.import_hook, None
    if hook is not None:
        try:
            sys.meta_path.remove(hook)
        except ValueError:
            pass


