"""The ZMQ publisher of KV cache events: the radix cache's `KVEventSink` in a scheduler process.

The scheduler thread only appends to a bounded deque (`publish`: a length check and an append, no lock, no
syscall); when the deque is full the event is dropped and counted, so a stalled publisher can never stall
the scheduler. A daemon thread owns both sockets: it drains the deque into batches, encodes them
(wire.py), sends [topic, seq, payload] on the PUB socket, keeps the last `buffer_steps` batches, and
answers replay requests on the ROUTER socket. A PUB socket never blocks: past its high-water mark ZMQ
drops messages for that subscriber, who sees a gap in the sequence numbers and asks for a replay.

A dropped event (deque full) never got a sequence number, so no replay can restore it: a subscriber's view
is then stale until the next `AllBlocksCleared`. `sglang:kv_events_dropped_total` says when that happened.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import TYPE_CHECKING

import zmq

from srt.kv_events.config import FLAG, KVEventsConfig, binds, parse_kv_events_config
from srt.kv_events.wire import END_SEQ, SEQ_BYTES, encode_batch, frames, parse_seq
from srt.mem_cache.kv_events import KVCacheEvent
from srt.sockets import get_zmq_socket

if TYPE_CHECKING:
    from srt.server_args import ServerArgs

logger = logging.getLogger(__name__)

# How long the publisher thread waits for a replay request when no events are queued: the latency an
# event can wait before it is sent, and the thread's wake-up rate when idle.
POLL_MS = 10
# Most events in one batch, so one message stays small even after a burst (e.g. a large eviction).
MAX_BATCH_EVENTS = 1024
CLOSE_TIMEOUT_S = 2.0


class ZmqEventPublisher:
    """`counters`: optional (published, dropped) prometheus counter children, increased by this thread.
    `start_thread=False` leaves the thread unstarted, so a test can fill the queue deterministically."""

    def __init__(
        self,
        config: KVEventsConfig,
        dp_rank: int = 0,
        counters: tuple | None = None,
        *,
        start_thread: bool = True,
    ) -> None:
        self.block_size = config.block_size
        self.dp_rank = dp_rank
        self.accepted = 0  # events queued; written by the scheduler thread only
        self.dropped = 0  # written by the scheduler thread only
        self.published = 0  # events sent, written by the publisher thread only
        self._max_queue = config.max_queue_size
        self._queue: deque[KVCacheEvent] = deque()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._topic = config.topic.encode()
        self._layout = config.event_layout
        self._counters = counters
        self._counted = (0, 0)
        self._seq = 0
        self._ctx = zmq.Context()
        self.endpoint = config.endpoint_for(dp_rank)
        self.replay_endpoint = config.replay_endpoint_for(dp_rank)
        try:
            self._pub = self._socket(zmq.PUB, self.endpoint, binds(self.endpoint), hwm=config.hwm)
            self._replay = None
            if self.replay_endpoint is not None:
                self._replay = self._socket(zmq.ROUTER, self.replay_endpoint, True)
        except ValueError:
            self._ctx.destroy(linger=0)
            raise
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-events-publisher", daemon=True)
        if start_thread:
            self._thread.start()
        logger.info(
            "Publishing KV cache events on %s (replay: %s, topic %r, block size %d)",
            self.endpoint,
            self.replay_endpoint or "off",
            config.topic,
            self.block_size,
        )

    def _socket(self, kind: int, address: str, bind: bool, hwm: int | None = None) -> zmq.Socket:
        """A bound (or connected) socket; a failure is a start-up error naming the flag."""
        try:
            return get_zmq_socket(self._ctx, kind, address, bind, hwm)
        except zmq.ZMQError as e:
            verb = "bind" if bind else "connect"
            raise ValueError(f"{FLAG}: cannot {verb} {address}: {zmq.strerror(e.errno)}") from None

    # ---- scheduler thread ----
    def publish(self, event: KVCacheEvent) -> None:
        if len(self._queue) >= self._max_queue:
            self.dropped += 1
            return
        self._queue.append(event)
        self.accepted += 1

    # ---- publisher thread ----
    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._send_queued()
                self._update_counters()
                if self._replay is None:
                    self._stop.wait(POLL_MS / 1000)
                elif self._replay.poll(POLL_MS):
                    self._serve_replay()
            except Exception:  # the publisher must outlive a bad message; the scheduler never notices
                logger.exception("KV event publisher error")
                self._stop.wait(POLL_MS / 1000)
        self._send_queued()
        self._update_counters()

    def _send_queued(self) -> None:
        while self._queue:
            events = []
            while self._queue and len(events) < MAX_BATCH_EVENTS:
                events.append(self._queue.popleft())
            payload = encode_batch(time.time(), events, self.dp_rank, self._layout)
            seq, self._seq = self._seq, self._seq + 1
            self._pub.send_multipart(frames(self._topic, seq, payload))
            self._buffer.append((seq, payload))
            self.published += len(events)

    def _serve_replay(self) -> None:
        """[identity, (delimiter,) start seq] -> [identity, (delimiter,) seq, payload]... then END_SEQ."""
        while True:
            try:
                msg = self._replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(msg) < 2 or len(msg[-1]) != SEQ_BYTES:
                logger.warning("Ignoring a malformed KV event replay request (%d frames)", len(msg))
                continue
            envelope, start = msg[:-1], parse_seq(msg[-1])
            for seq, payload in list(self._buffer):
                if seq >= start:
                    self._replay.send_multipart([*envelope, seq.to_bytes(SEQ_BYTES, "big"), payload])
            self._replay.send_multipart([*envelope, END_SEQ, b""])

    def _update_counters(self) -> None:
        if self._counters is None:
            return
        now = (self.published, self.dropped)
        for counter, new, old in zip(self._counters, now, self._counted, strict=True):
            if new > old:
                counter.inc(new - old)
        self._counted = now

    # ---- lifecycle ----
    def close(self) -> None:
        """Send what is queued, stop the thread, close the sockets (tests; a killed process needs none)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(CLOSE_TIMEOUT_S)
        self._ctx.destroy(linger=0)


def start_kv_event_publisher(
    server_args: ServerArgs, dp_rank: int, collector=None
) -> ZmqEventPublisher | None:
    """The publisher of this scheduler, or None without `--kv-events-config` (or with a null publisher).
    `collector`: the scheduler's SchedulerMetricsCollector, for the published/dropped counters."""
    if not server_args.kv_events_config:
        return None
    config = parse_kv_events_config(server_args.kv_events_config, server_args.dp_size)
    if not config.enabled:
        return None
    if server_args.disable_radix_cache:
        logger.warning("%s is ignored with --disable-radix-cache: nothing is cached", FLAG)
        return None
    counters = collector.kv_event_counters() if collector is not None else None
    return ZmqEventPublisher(config, dp_rank, counters)
