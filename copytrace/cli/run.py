"""Run a Python script or module traced, then write the trace and the HTML report.

Usage::

    copytrace run [options] [--] script.py [args...]
    copytrace run [options] [--] -m package.module [args...]

Everything after the script (or ``-m module``) belongs to the program, including a ``--``;
a ``--`` before it ends copytrace's own options. The program sees its own ``sys.argv``, and
its exit status is copytrace's.

Before the program starts, every ``COPYTRACE_*`` variable is checked and the output
directory must be writable: otherwise one line says what is wrong and the exit status is 2.

Processes the program starts (``multiprocessing`` children, DataLoader workers,
subprocesses) are traced too, each into its own trace file in the same directory, and the
report merges them. A launcher such as ``copytrace run -m torch.distributed.run
--nproc_per_node=2 train.py`` is not traced itself; its ranks are.

With ``--py-spy``, py-spy also samples the program (native frames on) and its profile is
written beside the traces (``*.speedscope.json`` or, with ``--py-spy-format raw``,
``*.pyspy.txt``); the report then adds py-spy's sampled share of time in copies next to the
traced one, and an icicle of the samples. Where py-spy cannot attach (no ptrace
permission), one line says so and the program runs without it.
"""

from __future__ import annotations

import argparse
import builtins
import gc
import importlib.machinery
import io
import os
import runpy
import sys
import traceback
import types
import zipfile
from pathlib import Path
from typing import Any

from copytrace import _env
from copytrace._errors import CopytraceError

_USAGE = (
    "copytrace run [-h] [-o DIR] [--no-report] [--py-spy] [--py-spy-format {speedscope,raw}]\n"
    "                     [--py-spy-rate HZ] [--] (script.py | -m module) [args ...]"
)


def register(sub: Any) -> None:
    parser = sub.add_parser(
        "run",
        help="run a script (or -m module) traced and write the trace and report",
        description=__doc__,
        usage=_USAGE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "-o", "--output", default=None, metavar="DIR",
        help=f"output directory (default: ${_env.COPYTRACE_OUTPUT} or ./{_env.DEFAULT_OUTPUT_DIR})",
    )  # fmt: skip
    parser.add_argument("--no-report", action="store_true", help="write the traces only")
    parser.add_argument(
        "--py-spy", action="store_true",
        help="also sample the program with py-spy (native frames) and add its view to the report",
    )  # fmt: skip
    parser.add_argument(
        "--py-spy-format", choices=("speedscope", "raw"), default="speedscope",
        help="py-spy output: speedscope JSON (default) or raw collapsed stacks",
    )  # fmt: skip
    parser.add_argument(
        "--py-spy-rate", type=_rate, default=100, metavar="HZ",
        help="py-spy samples per second, >= 1 (default: 100)",
    )  # fmt: skip
    # ``-m`` takes the rest of the line, like python's: everything after the module name is
    # the program's, even when it looks like one of copytrace's options.
    parser.add_argument(
        "-m", dest="module", nargs=argparse.REMAINDER, default=None, metavar="module",
        help="run a library module as a script, like python -m",
    )  # fmt: skip
    parser.add_argument(
        "command", nargs=argparse.REMAINDER, metavar="script.py [args ...]",
        help="the script to run and its arguments",
    )  # fmt: skip
    parser.set_defaults(handler=run)


def _split_command(args: argparse.Namespace) -> tuple[str, bool, list[str]]:
    """``(target, is_module, program args)`` from the parsed ``-m`` / command."""
    command = list(args.command or [])
    module = args.module
    if module is None and command and command[0] == "--":
        command = command[1:]
    if module is None and command and command[0] == "-m":
        module = command[1:]
    if module is not None:
        if not module:
            raise CopytraceError("-m needs a module name: copytrace run -m package.module [args]")
        return module[0], True, module[1:]
    if not command:
        raise CopytraceError("nothing to run: copytrace run [options] script.py [args ...]")
    if command[0].startswith("-"):
        raise CopytraceError(
            f"unknown option {command[0]!r} (put the script first, or use -- before it)"
        )
    return command[0], False, command[1:]


_LAUNCHER_MODULES = ("torch.distributed.run", "torch.distributed.launch")


def _is_launcher(target: str, is_module: bool) -> bool:
    if is_module:
        return target in _LAUNCHER_MODULES
    path = target.replace("\\", "/")
    return os.path.basename(path) == "torchrun" or path.endswith(
        ("torch/distributed/run.py", "torch/distributed/launch.py")
    )


def run(args: argparse.Namespace) -> int:
    from copytrace import launch

    INTERRUPTED[0] = False
    target, is_module, prog_args = _split_command(args)
    if not is_module and not Path(target).is_file():
        what = "not a script (a directory)" if Path(target).is_dir() else "no such script"
        raise CopytraceError(f"{what}: {target}")
    if is_module:
        import importlib.util

        sys.path.insert(0, os.getcwd())
        try:
            found = importlib.util.find_spec(target) is not None
        except (ImportError, ValueError):
            found = False
        finally:
            sys.path.pop(0)
        if not found:
            raise CopytraceError(f"no module named {target}")
    settings = _env.settings()  # SettingError (exit 2) names the first variable not accepted
    if not settings[_env.COPYTRACE_REPORT]:
        args.no_report = True  # COPYTRACE_REPORT=0 means what it means under COPYTRACE=1
    out_dir = Path(args.output or _env.output_dir()).absolute()
    _check_writable(out_dir)
    launcher = _is_launcher(target, is_module)

    launch.activate(
        output=out_dir, report=not args.no_report, root=True, quiet=True, reconfigure=True
    )
    try:
        return _run_traced(args, target, is_module, prog_args, out_dir, launcher)
    finally:
        launch.finish()  # no-op when already finished; never raises
        launch.reset()


def _rate(text: str) -> int:
    """``--py-spy-rate``: a whole number of samples per second, >= 1. py-spy itself takes 0
    and writes no profile, and reads a negative rate as an unknown flag; both would show
    only after the whole program ran, so they are refused before it starts.

    Raises:
        argparse.ArgumentTypeError: not a whole number, or below 1.
    """
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _check_writable(out_dir: Path) -> None:
    """Create ``out_dir`` (as the trace would) and write a probe file into it.

    Raises:
        CopytraceError: the directory cannot be created or written to.
    """
    problem = _env.unwritable(out_dir)
    if problem:
        raise CopytraceError(problem)


#: Set when the program ended with an unhandled KeyboardInterrupt: ``console_main`` then
#: ends the process with SIGINT, as python itself does.
INTERRUPTED = [False]


def _run_traced(
    args: argparse.Namespace,
    target: str,
    is_module: bool,
    prog_args: list[str],
    out_dir: Path,
    launcher: bool,
) -> int:
    from copytrace import launch, pyspy

    spy = None
    if args.py_spy:
        if not launcher:
            # Pay torch's one-time warm-up before py-spy samples, so that it samples the
            # program, not copytrace's start-up.
            from copytrace.tracer import _recorder

            _recorder.warm_up()
        spy = pyspy.start(out_dir, fmt=args.py_spy_format, rate=args.py_spy_rate)
    session = None if launcher else launch.start_session(force=True)
    saved_argv = sys.argv[:]
    # The program's argv stays until its trace is written: the run span records it as the
    # command (``train.py --epochs 1``, as under plain python), not copytrace's own.
    sys.argv = [target, *prog_args]
    try:
        status, kept, error = _run_program(target, is_module, prog_args)
        # Stop tracing while the program's globals are alive, as COPYTRACE=1 does at exit:
        # the last step's checks (graphs kept alive, stale snapshots) must see them.
        launch.stop_session(error)
        del kept, error
        gc.collect()  # the program's leftovers (a DataLoader iterator...) let their workers go
        profile = spy.stop() if spy is not None else None
        if spy is not None and profile is None:
            print("copytrace: py-spy wrote no profile", file=sys.stderr)
        result = launch.finish()
    finally:
        sys.argv = saved_argv
    trace_path, stats = result["trace"], result["stats"]
    if trace_path is not None:
        _keep_sources(trace_path)
    if session is not None:
        if trace_path is None:
            print("copytrace: no trace written", file=sys.stderr)
        elif stats is not None:
            print(
                f"copytrace: {stats['events']} events in {stats['steps']} steps -> {trace_path}",
                file=sys.stderr,
            )
    if result["report"] is not None:
        print(f"copytrace: report written to {result['report']}", file=sys.stderr)
    elif not args.no_report and session is None:
        print(f"copytrace: no trace files of this run in {out_dir}", file=sys.stderr)
    if profile is not None:
        _print_pyspy_summary(profile, trace_path, out_dir)
    if session is not None and trace_path is None and status == 0:
        return 1
    return status


def _keep_sources(trace_path: Path) -> None:
    """Keep the source line of each call site beside the trace while the files still hold
    them, so that ``copytrace diff`` matches call sites after the program is edited."""
    from copytrace.analysis.diff import snapshot_sources

    try:
        snapshot_sources(trace_path)
    except Exception as err:  # never fail a finished run for it
        print(f"copytrace: could not keep the call sites' source lines: {err}", file=sys.stderr)


def _print_pyspy_summary(profile: Path, trace_path: Path | None, out_dir: Path) -> None:
    """One line comparing py-spy's sampled shares with the traced ones."""
    from copytrace import pyspy

    try:
        scope: Any = os.getpid()
        traced = None
        try:
            from copytrace.dashboards import build_model
            from copytrace.tracefile import event_table

            # This process's trace; for a launcher (not traced itself), its workers'.
            where = trace_path if trace_path is not None else out_dir
            model = build_model(event_table(where), timeline=False, hazard_events=False,
                                patches=False)
            if trace_path is None:
                scope = [r.pid for r in model.runs if r.pid is not None] or None
            traced = pyspy.traced_numbers(model, scope)
        except Exception:  # no trace to compare with: the sampled shares alone
            pass
        stats = pyspy.analyze(pyspy.load_profile(profile), main_pid=scope)
        print(f"copytrace: {pyspy.summary_line(stats, traced)}", file=sys.stderr)
        print(f"copytrace: py-spy profile {profile}", file=sys.stderr)
    except Exception as err:  # the profile is still there for other tools
        print(f"copytrace: py-spy profile {profile} (not analysed: {err})", file=sys.stderr)


def _run_program(
    target: str, is_module: bool, prog_args: list[str]
) -> tuple[int, Any, BaseException | None]:
    """Run the program in this process like ``python`` would (``sys.argv`` is already the
    program's).

    Returns:
        ``(exit status, what keeps the program's globals alive, the exception it ended
        with or None)``: its globals (a normal end) or the exception, whose traceback holds
        them; the caller keeps them until tracing stops, as they live until ``atexit``
        under ``python``.
    """
    saved_path = sys.path[:]
    zipapp = not is_module and zipfile.is_zipfile(target)
    if is_module:
        sys.path.insert(0, os.getcwd())
    elif zipapp:  # python puts the archive itself first, not its folder
        sys.path.insert(0, os.path.abspath(target))
    else:
        sys.path.insert(0, str(Path(target).resolve().parent))
    try:
        if is_module:
            kept = _run_as_main(target, alter_argv=True)
        elif zipapp:
            kept = _run_as_main("__main__", alter_argv=False)
        else:
            kept = _run_script(target)
    except SystemExit as exc:  # an exit status, not an error (as under COPYTRACE=1)
        return _exit_status(exc.code), exc, None
    except KeyboardInterrupt as exc:  # as python prints it; the status is SIGINT's
        _print_program_traceback()
        INTERRUPTED[0] = True
        return 130, exc, exc
    except BaseException as exc:  # the program's own error: show it as python would, exit 1
        _print_program_traceback()
        return 1, exc, exc
    finally:
        sys.path[:] = saved_path
    return 0, kept, None


def _run_script(target: str) -> dict[str, Any]:
    """Run the script file ``target`` as ``python target`` does, and return its globals.

    As python: ``__main__.__file__`` and the code's file name are absolute (a script may
    chdir), ``sys.argv[0]`` stays as typed (``runpy.run_path`` would make it absolute),
    ``__loader__`` is a ``SourceFileLoader`` and ``__spec__`` None (``run_path``: None
    and None). ``sys.modules["__main__"]`` is the script's module from then on, as under
    python: its ``atexit`` handlers find its globals there (``run_path`` puts copytrace's
    back, and a class of the script no longer pickles at exit). Its ``__file__`` and ``__cached__``
    go when it ends, or fails, as CPython's ``_PyRun_SimpleFileObject`` drops them; a
    ``SystemExit`` leaves them (python exits from inside the run). A zip application goes
    through :func:`_run_as_main`.
    """
    path = os.path.abspath(target)
    with io.open_code(path) as f:
        code = compile(f.read(), path, "exec", dont_inherit=True)  # bytes: its coding line
    module = types.ModuleType("__main__")
    module.__dict__.update(
        __file__=path, __cached__=None, __package__=None, __spec__=None,
        __loader__=importlib.machinery.SourceFileLoader("__main__", path),
        __builtins__=builtins,
    )  # fmt: skip
    sys.modules["__main__"] = module
    exiting = False
    try:
        exec(code, module.__dict__)
    except SystemExit:
        exiting = True
        raise
    finally:
        if not exiting:  # python drops them when the script ends, unless it exits inside
            module.__dict__.pop("__file__", None)
            module.__dict__.pop("__cached__", None)
    return module.__dict__


def _run_as_main(name: str, alter_argv: bool) -> dict[str, Any]:
    """Run module ``name`` as ``python -m name`` (``alter_argv``) or a zip application's
    ``__main__`` as ``python app.pyz`` (not ``alter_argv``; the archive is ``sys.path[0]``)
    do: through ``runpy._run_module_as_main``, the function CPython's ``pymain_run_module``
    and ``pymain_run_main_from_importer`` call, in the globals of a new module put in
    ``sys.modules["__main__"]``. So, as under python, the module stays ``__main__`` after it
    ends (its ``atexit`` handlers pickle the classes it defines; ``runpy.run_module`` and
    ``run_path`` put copytrace's ``__main__`` back), ``sys.argv[0]`` is the module's file for
    ``-m`` and stays as typed for an archive (``run_path`` makes it absolute), and a package
    without ``__main__`` ends with python's one-line ``SystemExit`` message. Returns the
    module's globals."""
    module = types.ModuleType("__main__")
    module.__dict__["__builtins__"] = builtins
    sys.modules["__main__"] = module
    return runpy._run_module_as_main(name, alter_argv=alter_argv)  # type: ignore[attr-defined]


def _print_program_traceback() -> None:
    import copytrace

    etype, value, tb = sys.exc_info()
    package = os.path.dirname(os.path.abspath(copytrace.__file__)) + os.sep
    # Drop copytrace's and runpy's frames above the program's first frame.
    while tb is not None and (
        os.path.abspath(tb.tb_frame.f_code.co_filename).startswith(package)
        or tb.tb_frame.f_code.co_filename.endswith(("runpy.py", "<frozen runpy>"))
    ):
        tb = tb.tb_next
    traceback.print_exception(etype, value, tb)


def _exit_status(code: Any) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1
