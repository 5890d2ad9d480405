"""One log setup and one line format for every process of the server.

A line is `[2025-01-01 12:00:00 LABEL] message`, SGLang's scheduler format, where LABEL names the process
(`main`, `detokenizer`, `TP0`, `DP1 TP0`), so interleaved output of several processes stays readable and the
scheduler's Prefill/Decode lines keep the shape tools parse. Warnings and errors also say their level and
logger (`[... main] WARNING srt.launch_server: ...`): they are the lines someone has to act on.
"""

from __future__ import annotations

import logging

LOG_DATE_FORMAT = "%Y-%m-%d %H:%M:%S"


def rank_label(tp_rank: int = 0, dp_rank: int | None = None) -> str:
    """A scheduler rank's label: `TP0`, or `DP1 TP0` when data parallel."""
    return f"TP{tp_rank}" if dp_rank is None else f"DP{dp_rank} TP{tp_rank}"


class ProcessLogFormatter(logging.Formatter):
    def __init__(self, label: str):
        super().__init__(f"[%(asctime)s {label}] %(message)s", datefmt=LOG_DATE_FORMAT)
        self._alarm = logging.Formatter(
            f"[%(asctime)s {label}] %(levelname)s %(name)s: %(message)s", datefmt=LOG_DATE_FORMAT
        )

    def format(self, record: logging.LogRecord) -> str:
        if record.levelno >= logging.WARNING:
            return self._alarm.format(record)
        return super().format(record)


def configure_process_logging(level: str, label: str) -> None:
    """Root logging for this process: one stderr handler with the shared format."""
    handler = logging.StreamHandler()
    handler.setFormatter(ProcessLogFormatter(label))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
