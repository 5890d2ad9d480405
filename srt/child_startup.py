"""How a child process of the server starts: the spawn target that imports the child's module only in the
child, the ready pipe it reports through, and the one-line classification of a start-up failure (a
configuration the user can fix with a flag, exit code 2, or a crash, exit code 1) that the launcher logs."""

from __future__ import annotations

import importlib
import multiprocessing.connection
import re
import sys
import traceback
from dataclasses import dataclass

from srt.process_control import (
    leave_stopping_to_the_launcher,
    set_parent_death_signal,
    set_process_name,
    watch_parent_process,
)

EXIT_CHILD_FAILED = 1
EXIT_CONFIG_ERROR = 2  # as argparse exits for a bad flag
# Messages of start-up exceptions that say the configuration asks for more memory than there is.
OUT_OF_MEMORY_MARKERS = ("out of memory", "can't allocate memory", "not enough memory")
# The size in torch's allocation errors ("... tried to allocate 8000000000000 bytes", "... 20.00 GiB").
ALLOCATION_SIZE = re.compile(r"tried to allocate [\d.]+ ?\w+", re.IGNORECASE)


class ConfigError(Exception):
    """A start-up problem the user fixes by changing a flag or an environment value (the launcher reports it
    in one line and exits with code 2, as argparse does for a bad flag)."""


@dataclass
class StartupFailure:
    """What a child that failed to start sends over its ready pipe: one line for the log, whether the user
    can fix it with a flag (exit code 2) or it is a crash (1), and the traceback (logged at debug level)."""

    message: str
    config_error: bool
    detail: str = ""


def one_line(text: str) -> str:
    return " ".join(text.split())


def startup_failure(exc: BaseException) -> StartupFailure:
    """Classify a child's start-up exception. Configuration errors: ConfigError and ValueError (a flag value
    the model cannot take), running out of memory (the KV pool or the model does not fit), and any error
    whose message names the flag to change; anything else is a crash."""
    text = one_line(str(exc))
    detail = "".join(traceback.format_exception(exc))
    if isinstance(exc, MemoryError) or any(m in text.lower() for m in OUT_OF_MEMORY_MARKERS):
        asked = ALLOCATION_SIZE.search(text)
        message = (
            f"not enough memory for this configuration ({asked.group(0) if asked else text[:200]}): lower "
            "--max-total-tokens, --mem-fraction-static or --max-running-requests"
        )
        return StartupFailure(message, True, detail)
    if isinstance(exc, ConfigError | ValueError) or " --" in f" {text}":
        return StartupFailure(text, True, detail)
    return StartupFailure(f"{type(exc).__name__}: {text}", False, detail)


class ReadyPipe:
    """The child's end of the ready pipe, given to the child's entry point in place of the raw connection.
    Readiness (any object) goes through at once; a failure the child reports as a string (the scheduler
    sends its traceback) is held back, so that `run_child` sends one classified StartupFailure instead."""

    def __init__(self, conn: multiprocessing.connection.Connection):
        self.conn = conn
        self.ready = False
        self.reported: str | None = None

    def send(self, msg) -> None:
        if isinstance(msg, str):
            self.reported = msg
            return
        self.ready = True
        self.conn.send(msg)

    def fail(self, failure: StartupFailure) -> None:
        try:
            self.conn.send(failure)
        except OSError:
            pass  # the launcher is gone

    def close(self) -> None:
        self.conn.close()


def run_child(name: str, module: str, func: str, *args, **kwargs) -> None:
    """Spawn target that imports the child's module only in the child, so the main process never imports
    the scheduler's modules (and with them torch). The last positional argument is the ready pipe's write
    end; an exception before the child reported ready becomes one StartupFailure line (no traceback on
    stderr), an exception after it is a crash and keeps its traceback."""
    set_process_name(name)
    set_parent_death_signal()  # a launcher killed with SIGKILL must not leave this child behind
    watch_parent_process()
    leave_stopping_to_the_launcher()  # CHILD_STOP_SIGNAL says why
    pipe = ReadyPipe(args[-1])
    try:
        getattr(importlib.import_module(module), func)(*args[:-1], pipe, **kwargs)
    except Exception as e:
        if pipe.ready:
            raise
        pipe.fail(startup_failure(e))
        sys.exit(EXIT_CHILD_FAILED)
    if not pipe.ready and pipe.reported is not None:
        pipe.fail(StartupFailure(one_line(pipe.reported), False, pipe.reported))


class StartupError(RuntimeError):
    """The server cannot start; `config_error` when the user can fix it with a flag or environment value."""

    def __init__(self, message: str, config_error: bool = False, detail: str = ""):
        super().__init__(message)
        self.config_error = config_error
        self.detail = detail
