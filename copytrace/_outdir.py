"""Whether a trace could be written into an output directory: checked before tracing starts.

Ground: the standard library only (the ``COPYTRACE=1`` hook runs it in every Python process of
a launch, before the program).
"""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["unwritable"]


def unwritable(out_dir: Any, create: bool = True) -> str | None:
    """Why a trace could not be written into ``out_dir``, or None. ``copytrace run``, the
    ``COPYTRACE=1`` hook and ``copytrace.trace()`` check it before tracing starts.

    With ``create`` the directory is made as the trace would make it, then probed with a
    temporary file. Without it (the hook, which runs in every Python process of a launch,
    most of which never trace) nothing is left on disk: the nearest existing directory on the
    path is probed with an unnamed temporary file (``O_TMPFILE`` on Linux), and the missing
    part is made only by a process that writes a trace.

    Returns:
        ``"output directory D is not writable (REASON)"``, or None when it is writable.
    """
    path = Path(out_dir)
    try:
        if create:
            path.mkdir(parents=True, exist_ok=True)
            probe = path
        else:
            probe = path.absolute()
            while not probe.exists() and probe.parent != probe:
                probe = probe.parent
            if not probe.is_dir() and probe != path.absolute():  # a file on the way
                raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR))
            if not probe.is_dir():
                raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST))
        with tempfile.TemporaryFile(dir=probe, prefix=".copytrace-probe-"):
            pass
    except OSError as err:  # mkdir's "File exists" would not say that it is a file
        why = "a file is there" if path.is_file() else err.strerror or type(err).__name__
        return f"output directory {out_dir} is not writable ({why})"
    return None
