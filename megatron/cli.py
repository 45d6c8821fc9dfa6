"""How the project's command-line programs end on bad input, a stop or a bug: the first two in one line a person
can act on, never a traceback or an `[Errno N]`; a bug with its traceback.

- `stop_at_once_while_starting`, called before a program's imports (torch's is slow): a Ctrl-C or SIGTERM
  (for deepy.py any of JOB_STOP_SIGNALS) there prints one line and ends the process at once. Nothing has
  started that needs unwinding, and unwinding from wherever the signal landed is what goes wrong: an exception
  raised inside a half-finished import leaves the module half-initialised for the next code that touches it (a
  second traceback), or crosses a pybind11 boundary and aborts the process.
- `one_line_errors`, around a program's `main`: bad input (`_is_bad_input`: an InputError, the base of the
  project's own errors, or an OSError about the user's files or disk) ends it with `PROGRAM: error: ...` and
  status 2, a KeyboardInterrupt with `PROGRAM: stopped at your request` and 130, after `main`'s own clean-up
  ran. Anything else is a bug: its traceback, then a line asking to report it, and status 1. Signals are
  Python's again from `main` on.
- `describe`, the line for such an error: an OSError in words with the path it is about (`OUT: /data/notes is
  a file, not a directory`), which the fix needs and strerror alone does not give.
- `positive_int`, an argparse type for counts and sizes, refused in argparse's own line when below 1.

Only the standard library is imported here, so that a program can call this first.
"""

from __future__ import annotations

import argparse
import errno
import functools
import os
import signal
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# What stops a training job: Ctrl-C, a scheduler's SIGTERM and its early warning (SIGUSR1 or SIGUSR2, SLURM's
# --signal), a closed terminal. Each would kill a process that does not catch it.
JOB_STOP_SIGNALS = (*STOP_SIGNALS, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
Result = TypeVar("Result")
# An OSError with one of these comes from the user's disk (full, over quota, read-only), named path or not.
DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)


class InputError(ValueError):
    """Bad input a person can fix (a config, a checkpoint, a data file, an argument), in one line that names it
    and the fix. The project's own errors derive from it, so that any other ValueError reads as the bug it is."""


def _is_bad_input(error: BaseException) -> bool:
    """Whether `error` is the user's to fix: an InputError, or an OSError about their files or disk. An OSError is
    theirs when it names a path (missing, no permission, a file where a folder is needed), reports a full or
    read-only disk, or has no errno: the OS always sets one, so that one was raised with a message for a person (a
    missing checkpoint file, say). Anything else is a bug."""
    if isinstance(error, InputError):
        return True
    if not isinstance(error, OSError):
        return False
    return error.filename is not None or error.errno in DISK_ERRNOS or error.errno is None


def stop_at_once_while_starting(program: str, when: str, signals: tuple[int, ...] = STOP_SIGNALS) -> None:
    """Until `one_line_errors` runs `main`, each of `signals` prints `PROGRAM: stopped at your request, WHEN` and
    exits 128+N without unwinding (module docstring). Call it from the main thread, before the slow imports."""
    line = f"{program}: stopped at your request, {when}\n".encode()

    def stop(number: int, frame: object) -> None:
        try:
            sys.stdout.flush()
        except (OSError, ValueError, RuntimeError):  # RuntimeError: the signal landed inside a write to stdout
            pass
        try:
            os.write(2, line)
        except OSError:  # a hung-up terminal (SIGHUP): the exit status still tells
            pass
        os._exit(128 + number)

    stop.stops_while_starting = True  # type: ignore[attr-defined]
    for number in signals:
        signal.signal(number, stop)


def _python_handles_signals_again() -> None:
    """Undo stop_at_once_while_starting: from here a Ctrl-C is a KeyboardInterrupt that runs clean-ups."""
    defaults = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: signal.SIG_DFL}
    for number, default in defaults.items():
        if getattr(signal.getsignal(number), "stops_while_starting", False):
            signal.signal(number, default)


def _existing_file_above(path: Path) -> Path | None:
    """The first folder on the way to `path` that exists as something other than a directory."""
    for folder in reversed(path.absolute().parents):
        if folder.exists() and not folder.is_dir():
            return folder
    return None


def describe(error: BaseException) -> str:
    """One line for an error a person can fix: an OSError says what is wrong with which path; anything else
    is its own message."""
    if isinstance(error, OSError) and error.filename is None and error.strerror:
        return error.strerror  # a full disk on a write, say: the path is not known here
    if not isinstance(error, OSError) or error.filename is None:
        return str(error) or type(error).__name__
    path = Path(os.fsdecode(error.filename))
    if error.errno in (errno.ENOTDIR, errno.EEXIST):
        blocker = _existing_file_above(path)
        if blocker is not None:
            return f"{path}: {blocker} is a file, not a directory; choose another path"
        if error.errno == errno.EEXIST and path.exists() and not path.is_dir():
            return f"{path} is a file, where a directory is needed; choose another path"
        if error.errno == errno.EEXIST:
            return f"{path} exists already"
    reasons = {errno.ENOENT: "does not exist", errno.EACCES: "permission denied", errno.EPERM: "permission denied",
               errno.EISDIR: "is a directory, where a file is needed", errno.EROFS: "is on a read-only file system",
               errno.ENOSPC: "no space left on its device", errno.EDQUOT: "disk quota exceeded on its device",
               errno.ENOTDIR: "is not a directory"}
    reason = reasons.get(error.errno, error.strerror or type(error).__name__)
    target = f" -> {os.fsdecode(error.filename2)}" if error.filename2 is not None else ""
    return f"{path}{target}: {reason}"


def positive_int(text: str) -> int:
    """An argparse type: a whole number of at least 1 (a count, a size), refused in argparse's one line."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def one_line_errors(program: str) -> Callable[[Callable[..., Result]], Callable[..., Result]]:
    """Decorate a program's `main` so that bad input and a stop end it with one line, a bug with its traceback
    (module docstring)."""
    def decorate(main: Callable[..., Result]) -> Callable[..., Result]:
        @functools.wraps(main)
        def run(*args, **kwargs) -> Result:
            _python_handles_signals_again()
            try:
                return main(*args, **kwargs)
            except KeyboardInterrupt:
                print(f"{program}: stopped at your request", file=sys.stderr, flush=True)
                raise SystemExit(130) from None
            except Exception as error:
                if not _is_bad_input(error):
                    traceback.print_exc()
                    print(f"{program}: this is a bug, not bad input: please report it with the traceback above",
                          file=sys.stderr, flush=True)
                    raise SystemExit(1) from None
                print(f"{program}: error: {describe(error)}", file=sys.stderr, flush=True)
                raise SystemExit(2) from None
        return run
    return decorate
