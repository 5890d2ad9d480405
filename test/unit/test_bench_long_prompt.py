"""bench_long_prompt reads the scheduler's own step lines: the parser follows the format the scheduler logs."""

from bench_long_prompt import step_times
from srt.scheduler.step_executor import STEP_DEBUG_LINE


def test_the_step_lines_the_scheduler_writes_are_read_back():
    log = "\n".join(
        [
            "[2026-11-29 08:00:00 scheduler] DEBUG " + STEP_DEBUG_LINE % (1024, 3, 987.6),
            "an unrelated line",
            STEP_DEBUG_LINE % (0, 16, 21.0),
        ]
    )
    assert step_times(log) == [(1024, 3, 0.9876), (0, 16, 0.021)]
