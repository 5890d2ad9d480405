"""The scheduler's side of structured output: compiling off the loop, the LRU cache, per-request matchers
and the step's token bitmask.

A constrained request first waits in the grammar queue while one worker thread compiles its grammar (a
cache hit skips the thread); `pop_ready()` at the start of each step hands over the requests whose grammar
is ready — each with its own matcher — or that failed (finished with `error`). Others in the waiting queue
are never held up. With tensor parallelism every rank must admit a request in the same step, so compiling is
synchronous there (`synchronous=True`), still cached.

The backend (and the tokenizer it needs) is created lazily on the worker thread by the first constrained
request, so a server that never sees one pays nothing at start-up. Requests are duck-typed: the manager reads
`rid`, `sampling_params` and sets `grammar` (the matcher) and `finished_reason` via `fail`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from srt.constrained import create_grammar_backend
from srt.constrained.base_backend import GrammarBackend, GrammarKey, GrammarMatcher
from srt.constrained.bitmask import GrammarMask, allocate_bitmask

logger = logging.getLogger(__name__)

# Compiled grammars kept (least recently used dropped first): a compiled JSON schema holds ~1 MB of
# precomputed masks in xgrammar, far less in llguidance.
GRAMMAR_CACHE_SIZE = 256


class GrammarMismatch(RuntimeError):
    """The grammar library and its own mask disagree, or it gave up on a mask: the output can no longer be
    trusted to follow the constraint."""


class GrammarCache:
    """LRU of compiled grammars (or the Future of one being compiled), keyed by (kind, spec)."""

    def __init__(self, size: int = GRAMMAR_CACHE_SIZE):
        self.size = size
        self._items: OrderedDict[GrammarKey, Future] = OrderedDict()

    def get(self, key: GrammarKey) -> Future | None:
        item = self._items.get(key)
        if item is not None:
            self._items.move_to_end(key)
        return item

    def put(self, key: GrammarKey, item: Future) -> None:
        self._items[key] = item
        self._items.move_to_end(key)
        while len(self._items) > self.size:
            self._items.popitem(last=False)

    def drop(self, key: GrammarKey) -> None:
        self._items.pop(key, None)

    def __len__(self) -> int:
        return len(self._items)


class GrammarManager:
    def __init__(
        self,
        backend_name: str,
        load_tokenizer: Callable[[], Any],
        vocab_size: int,
        eos_token_ids: list[int],
        metrics: Any = None,
        synchronous: bool = False,
        cache_size: int = GRAMMAR_CACHE_SIZE,
    ):
        self.backend_name = backend_name
        self._load_tokenizer = load_tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.metrics = metrics
        self.synchronous = synchronous
        self.cache = GrammarCache(cache_size)
        self.queue: list[tuple[Any, GrammarKey, Future]] = []
        self._backend: GrammarBackend | None = None
        self._backend_lock = threading.Lock()
        self._worker = None if synchronous else ThreadPoolExecutor(1, thread_name_prefix="grammar")

    @property
    def backend(self) -> GrammarBackend:
        with self._backend_lock:
            if self._backend is None:
                self._backend = create_grammar_backend(
                    self.backend_name, self._load_tokenizer(), self.vocab_size, self.eos_token_ids
                )
            return self._backend

    # ---- compiling (worker thread) ----
    def _compile(self, key: GrammarKey) -> Any:
        t0 = time.perf_counter()
        grammar = self.backend.compile(key)
        if self.metrics is not None:
            self.metrics.on_compiled(time.perf_counter() - t0)
        return grammar

    def _start(self, key: GrammarKey) -> Future:
        if self._worker is not None:
            return self._worker.submit(self._compile, key)
        done: Future = Future()
        try:
            done.set_result(self._compile(key))
        except Exception as e:
            done.set_exception(e)
        return done

    # ---- scheduler loop ----
    def submit(self, req: Any, key: GrammarKey) -> None:
        """Queue `req` until its grammar is compiled (or found in the cache)."""
        future = self.cache.get(key)
        if future is None:
            future = self._start(key)
            self.cache.put(key, future)
        elif self.metrics is not None:
            self.metrics.on_cache_hit()
        if self.metrics is not None:
            self.metrics.on_request()
        self.queue.append((req, key, future))
        self._report_queue()

    def pop_ready(self) -> tuple[list[Any], list[tuple[Any, Exception]]]:
        """Requests whose grammar is ready (each given a fresh matcher as `req.grammar`), and the requests
        whose grammar failed with the exception. Both leave the grammar queue."""
        if not self.queue:
            return [], []
        ready, failed, still = [], [], []
        for req, key, future in self.queue:
            if not future.done():
                still.append((req, key, future))
                continue
            try:
                req.grammar = self.backend.new_matcher(future.result())
                req.grammar.key = key
                ready.append(req)
            except Exception as e:
                self.cache.drop(key)  # a failure is not cached: the next request retries
                failed.append((req, e))
        self.queue = still
        self._report_queue()
        return ready, failed

    def remove(self, pred: Callable[[Any], bool]) -> list[Any]:
        """Take the queued requests for which `pred` holds out of the queue (aborts)."""
        taken = [req for req, _, _ in self.queue if pred(req)]
        if taken:
            self.queue = [item for item in self.queue if not pred(item[0])]
            self._report_queue()
        return taken

    def _report_queue(self) -> None:
        if self.metrics is not None:
            self.metrics.set_queue(len(self.queue))

    def fill_mask(self, reqs: list[Any]) -> GrammarMask | None:
        """The step's bitmask over the rows of `reqs` whose matcher has started (a thinking request's starts
        after its end-think token: `think_end_id` is None); None when none has (no cost)."""
        rows = [
            i
            for i, r in enumerate(reqs)
            if r.grammar is not None and getattr(r, "think_end_id", None) is None
        ]
        if not rows:
            return None
        bitmask = allocate_bitmask(len(rows), self.backend.vocab_size)
        self.backend.fill_bitmask([reqs[i].grammar for i in rows], bitmask)
        return GrammarMask(bitmask, rows, self.vocab_size)

    def advance(self, req: Any, token_id: int) -> bool | None:
        """Feed the sampled token to the request's matcher: True if the grammar has ended, None otherwise.
        Raises `GrammarMismatch` when the mask the token was sampled under cannot be trusted (the library
        reported an error computing it) or the matcher rejects a token its own mask allowed; the grammar is
        then dropped from the cache, so the next request with it compiles afresh instead of inheriting a
        broken one."""
        matcher: GrammarMatcher = req.grammar
        error = matcher.error()
        if not error and not matcher.accept_token(token_id):
            error = matcher.error() or f"the grammar rejected token {token_id}, which its mask allowed"
        if not error and matcher.is_terminated():
            error = matcher.error()  # llguidance also stops on an error (e.g. a grammar found unsatisfiable)
            if not error:
                return True
        if error:
            if matcher.key is not None:
                self.cache.drop(matcher.key)
            raise GrammarMismatch(error)
        return None

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=False, cancel_futures=True)
