"""py-spy's independent view of a traced run.

:mod:`.launch` runs ``py-spy record`` beside the traced program (``copytrace run
--py-spy``); :mod:`.profile` parses its profile and measures the shares of samples in
copies and in copytrace itself, as plain data; :mod:`.compare` sets the traced figures
beside them. The report draws them in
:mod:`copytrace.dashboards.sections.pyspy`.
"""

from copytrace.pyspy.compare import summary_line, traced_numbers
from copytrace.pyspy.launch import PYSPY_ENV, PySpy, find_py_spy, profile_path, start
from copytrace.pyspy.profile import (
    API,
    FORMATS,
    KERNEL,
    TRACER,
    Frame,
    FrameShare,
    Profile,
    SampleStats,
    Stack,
    ThreadStats,
    analyze,
    classify,
    find_profiles,
    load_profile,
)

__all__ = [
    "API",
    "FORMATS",
    "KERNEL",
    "PYSPY_ENV",
    "TRACER",
    "Frame",
    "FrameShare",
    "Profile",
    "PySpy",
    "SampleStats",
    "Stack",
    "ThreadStats",
    "analyze",
    "classify",
    "find_profiles",
    "find_py_spy",
    "load_profile",
    "profile_path",
    "start",
    "summary_line",
    "traced_numbers",
]
