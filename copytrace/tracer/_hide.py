"""copytrace's frames taken out of a program's error that passes through its wrappers.

A program's error raised inside a function copytrace wraps while it traces (``copy.deepcopy``,
``load_state_dict``..., ``tracer/_patches.py``, ``tracer/_handover.py``) would carry the
wrappers' frames, and those of the recorder between them and the original, in its traceback.
Each wrapper catches it on its way out, drops every traceback entry of a frame in copytrace's
package (:func:`hide_frames`) and raises it again with a bare ``raise``, which adds no entry:
the traceback then reads as untraced (the entries of the program's and torch's frames, in
order). copytrace's own errors never reach a program (they are counted), so every error seen
here is the program's.
"""

from __future__ import annotations

import os

__all__ = ["hide_frames"]

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def hide_frames(err: BaseException) -> None:
    """Drop the entries of copytrace's frames from ``err.__traceback__`` (relinking
    ``tb_next``). Never raises."""
    try:
        tb = err.__traceback__
        head = last = None
        while tb is not None:
            if not tb.tb_frame.f_code.co_filename.startswith(_PACKAGE):
                if last is None:
                    head = tb
                else:
                    last.tb_next = tb
                last = tb
            tb = tb.tb_next
        if last is not None:
            last.tb_next = None
        err.__traceback__ = head
    except Exception:  # a traceback object copytrace cannot relink: left as it is
        pass
