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
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from copytrace.tracer._recorder import Recorder

__all__ = ["hide_frames"]

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def hide_frames(err: BaseException, rec: Recorder | None) -> None:
    """Drop the entries of copytrace's frames from ``err.__traceback__`` (relinking
    ``tb_next``). Never raises.

    ``rec``: the running trace's recorder (:func:`copytrace.tracer._patches.active_recorder`,
    also for a call on another thread), or None where no trace runs. A traceback copytrace
    cannot relink (an exception class of the program's whose ``__traceback__`` cannot be set)
    is left as it is, and the failure is counted there as an internal error
    (``Recorder.note_error``: ``Trace.stats["errors"]``, ``Trace.first_error``). The new
    head is set before any ``tb_next`` is changed, so a refused ``__traceback__`` leaves the
    traceback untouched."""
    try:
        kept = []
        tb = err.__traceback__
        while tb is not None:
            if not tb.tb_frame.f_code.co_filename.startswith(_PACKAGE):
                kept.append(tb)
            tb = tb.tb_next
        err.__traceback__ = kept[0] if kept else None
        for tb, nxt in zip(kept, kept[1:], strict=False):
            tb.tb_next = nxt
        if kept:
            kept[-1].tb_next = None
    except Exception as failure:  # counted, never raised into the program
        if rec is not None:
            rec.note_error(failure)
