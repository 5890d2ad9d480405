"""The HTTP process's verdict on a constraint, before the request is queued: a 400 for anything that would
fail, stall or silently break later, at the cost of one compile per distinct constraint.

A constraint passes when it admits some complete output (`satisfiable.py`), the serving backend compiles it
with the model's tokenizer, and its first token mask computes within the library's limits with at least
one token allowed (`GrammarBackend.judge`). The work runs in a child process of its own, one constraint at a
time, for three reasons:
- the HTTP event loop never runs it (a compile can take a second: xgrammar on a nested schema);
- a constraint over `--grammar-compile-timeout` is stopped by killing that child (a thread inside a native
  library cannot be interrupted: xgrammar spends minutes on a schema nested 1,500 deep), then answered 400;
- a library that crashes on hostile input (an abort, a stack overflow) takes down only that child.
The child is started with the server's other processes and built for the tokenizer's vocabulary while the
scheduler loads the model; should the scheduler, once ready, say another vocabulary size or other
end-of-sequence ids, it is rebuilt for those before the server listens. (Started once the server listened,
its ~2 s of CPU slowed a fresh server's first steps 2-3 times on a 2-core CPU.) It is restarted after a kill
or a crash, and never loads torch for llguidance (the default).

Verdicts, passes and failures alike, are kept in an LRU keyed by (kind, text), so a failing constraint sent
again costs nothing; concurrent requests with the same constraint share one judgement.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import multiprocessing.connection
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from srt.constrained import NO_GRAMMAR_BACKEND, create_grammar_backend
from srt.constrained.base_backend import GrammarError, GrammarKey
from srt.constrained.satisfiable import check_satisfiable

logger = logging.getLogger(__name__)

# Distinct constraints whose verdict the HTTP process remembers.
VERDICT_CACHE_SIZE = 1024
# Longest a library's message may be in a 400 (llguidance's carry the parser's state).
MAX_MESSAGE_CHARS = 300
# How long the child may take to start (import the library, load the tokenizer) before requests give up.
STARTUP_TIMEOUT_SECONDS = 120.0
# How long the server waits for the child before it listens (then it serves, and constrained requests wait).
READY_WAIT_SECONDS = 10.0
TIMED_OUT, CRASHED = "timed out", "crashed"
# The child's process name (ps, top): 15 characters at most, the kernel's limit.
JUDGE_PROCESS_NAME = "srt-grammar"


class JudgeUnavailable(RuntimeError):
    """The judge process could not be started: no verdict on any constraint (a 503, not a 400)."""


@dataclass(frozen=True)
class Verdict:
    """What the child answers for one constraint: None when it passes, else the 400's message."""

    error: str | None


def short(message: str) -> str:
    first = message.strip().splitlines()[0] if message.strip() else "no detail"
    return first if len(first) <= MAX_MESSAGE_CHARS else first[: MAX_MESSAGE_CHARS - 3] + "..."


def judge_in_process(backend, key: GrammarKey) -> str | None:
    """The verdict on `key` with a backend bound to the tokenizer: None, or why it is refused."""
    try:
        check_satisfiable(key)
        backend.judge(key)
    except GrammarError as e:
        return short(str(e))
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # RecursionError, MemoryError, a Rust panic (pyo3's is a BaseException)
        return short(f"the {key.kind} could not be compiled: {type(e).__name__}: {e}")
    return None


def _child_main(conn, backend_name: str, tokenizer_path: str):
    """The judge child: load the tokenizer, wait for the model's vocabulary size and end-of-sequence ids, build
    the backend, say ready, then answer one key at a time."""
    from srt.process_control import set_parent_death_signal, set_process_name, watch_parent_process
    from srt.process_logging import configure_process_logging
    from srt.tokenizer_loading import load_tokenizer

    configure_process_logging("WARNING", "grammar")  # it has nothing to say but problems
    set_process_name(JUDGE_PROCESS_NAME)
    set_parent_death_signal()
    watch_parent_process()
    tokenizer = load_tokenizer(tokenizer_path)
    try:
        vocab_size, eos_token_ids = conn.recv()
    except (EOFError, OSError):
        return
    backend = create_grammar_backend(backend_name, tokenizer, vocab_size, eos_token_ids)
    conn.send("ready")
    while True:
        try:
            key = conn.recv()
        except (EOFError, OSError):
            return
        conn.send(Verdict(judge_in_process(backend, GrammarKey(*key))))


class JudgeChild:
    """One judge process and its pipe; blocking calls, made from the judge's own thread. Started, it loads
    its tokenizer; `configure` gives it the model's vocabulary and waits until it is ready."""

    def __init__(self, backend_name: str, tokenizer_path: str):
        ctx = multiprocessing.get_context("spawn")
        self.conn, child_conn = ctx.Pipe()
        self.process = ctx.Process(
            target=_child_main, args=(child_conn, backend_name, tokenizer_path), daemon=True
        )
        self.process.start()
        child_conn.close()
        self.model: tuple[int, list[int]] | None = None  # what `configure` built the backend for

    def configure(self, model: tuple[int, list[int]]) -> None:
        try:
            self.conn.send(model)
            ready = self.conn.poll(STARTUP_TIMEOUT_SECONDS) and self.conn.recv() == "ready"
        except (EOFError, OSError):
            ready = False
        if not ready:
            self.kill()
            raise JudgeUnavailable("the grammar judge process did not start")
        self.model = model

    def ask(self, key: GrammarKey, timeout: float) -> Verdict | str:
        """The verdict; or TIMED_OUT when the child ran past `timeout`, CRASHED when it died (it is then
        gone either way)."""
        try:
            self.conn.send(tuple(key))
            if not self.conn.poll(timeout):
                self.kill()
                return TIMED_OUT
            return self.conn.recv()
        except (EOFError, OSError):
            self.kill()
            return CRASHED

    @property
    def alive(self) -> bool:
        return self.process.is_alive()

    def kill(self) -> None:
        self.process.kill()
        self.process.join(timeout=5)
        self.conn.close()


class GrammarJudge:
    """Judges constraints for the HTTP process (see the module docstring). `check` raises GrammarError."""

    def __init__(
        self,
        backend_name: str,
        tokenizer_path: str,
        vocab_size: int,
        eos_token_ids: list[int],
        timeout: float,
        cache_size: int = VERDICT_CACHE_SIZE,
    ):
        self.backend_name = backend_name
        self.timeout = timeout
        self.cache_size = cache_size
        self._path = tokenizer_path
        self._model = (vocab_size, list(eos_token_ids))
        self._child: JudgeChild | None = None  # replaced, and its pipe used, on the judge's thread only
        self._started: Future | None = None
        self._closed = False
        self._verdicts: OrderedDict[GrammarKey, str | None] = OrderedDict()
        self._pending: dict[GrammarKey, asyncio.Future] = {}
        # One thread: the child judges one constraint at a time, and the pipe has one reader.
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="grammar-judge")
        self.num_judged = 0
        self.num_timeouts = 0
        self.num_crashes = 0

    def bind(self, vocab_size: int, eos_token_ids: list[int]) -> None:
        """The model's vocabulary size and end-of-sequence ids, as the scheduler says them once ready (the
        judge starts on the tokenizer's): a child built for others is replaced at the next `start`."""
        if self.backend_name != NO_GRAMMAR_BACKEND:
            self._thread.submit(self._rebind, (vocab_size, list(eos_token_ids)))

    def start(self) -> None:
        """Make the child ready in the background (the first constrained request would otherwise wait for it)."""
        if self.backend_name != NO_GRAMMAR_BACKEND:
            self._started = self._thread.submit(self._ensure_child)

    def wait_started(self, timeout: float) -> bool:
        """Wait up to `timeout` for `start`'s child to be ready (or to have failed: requests then answer
        503); False if it is still starting. The server waits before it listens: building the backend took
        ~0.4 s of CPU, which slowed the first requests' steps when it ran beside them."""
        if self._started is None:
            return True
        try:
            self._started.result(timeout)
        except TimeoutError:
            return False
        except Exception:  # noqa: BLE001 - the failure is each constrained request's 503, not the start's
            pass
        return True

    def _rebind(self, model: tuple[int, list[int]]) -> None:
        self._model = model
        if self._child is not None and self._child.model not in (None, model):
            self._child.kill()
            self._child = None

    def _ensure_child(self) -> JudgeChild:
        if self._closed:
            raise JudgeUnavailable("the grammar judge is closed (the server is stopping)")
        if self._child is None or not self._child.alive:
            self._child = JudgeChild(self.backend_name, self._path)
        if self._child.model is None:
            self._child.configure(self._model)
        return self._child

    def _judge_blocking(self, key: GrammarKey) -> str | None:
        child = self._ensure_child()
        verdict = child.ask(key, self.timeout)
        self.num_judged += 1
        if isinstance(verdict, Verdict):
            return verdict.error
        if verdict == TIMED_OUT:
            self.num_timeouts += 1
            logger.warning("a %s took longer than %.1f s to compile: refused", key.kind, self.timeout)
            return (
                f"the {key.kind} takes longer than this server's budget of {self.timeout:g} s to compile "
                "(--grammar-compile-timeout)"
            )
        self.num_crashes += 1
        logger.warning("the grammar library crashed on a %s (exit code %s)", key.kind, child.process.exitcode)
        return f"the {key.kind} crashed the grammar library"

    async def check(self, key: GrammarKey) -> None:
        """Raise GrammarError (its `kind` naming the field) unless `key` passes."""
        if self.backend_name == NO_GRAMMAR_BACKEND:
            raise GrammarError(
                "structured output is disabled on this server (--grammar-backend none)", key.kind
            )
        if key in self._verdicts:
            self._verdicts.move_to_end(key)
            error = self._verdicts[key]
        else:
            future = self._pending.get(key)
            if future is None:
                loop = asyncio.get_running_loop()
                future = loop.run_in_executor(self._thread, self._judge_blocking, key)
                self._pending[key] = future
                future.add_done_callback(lambda f, key=key: self._record(key, f))
            try:
                error = await asyncio.shield(future)
            except JudgeUnavailable:
                raise
            except Exception as e:  # the child could not even load the backend or the tokenizer
                raise JudgeUnavailable(f"the grammar judge failed to start: {type(e).__name__}: {e}") from e
        if error is not None:
            raise GrammarError(error, key.kind)

    def _record(self, key: GrammarKey, future: asyncio.Future) -> None:
        self._pending.pop(key, None)
        if future.cancelled() or future.exception() is not None:
            return  # the judge itself failed (it could not start): not a verdict on the constraint
        self._verdicts[key] = future.result()
        while len(self._verdicts) > self.cache_size:
            self._verdicts.popitem(last=False)

    def close(self) -> None:
        """Kill the child now (a judge thread waiting on it wakes to its end of file); its pipe is closed on
        the judge's thread, the pipe's one reader, after whatever that thread is doing: closed here, it raced
        the thread's own close of it (EBADF, or another file's descriptor once the number is reused). What is
        still queued finds the judge closed: unavailable."""
        if self._closed:
            return
        self._closed = True
        child = self._child
        if child is not None:
            child.process.kill()
        self._thread.submit(self._drop_child)
        self._thread.shutdown(wait=False)

    def _drop_child(self) -> None:
        child, self._child = self._child, None
        if child is not None:
            child.kill()
