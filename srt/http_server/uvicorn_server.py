"""The uvicorn server srt runs: it bounds how long a connection may sit without a request, and drains
gracefully on SIGTERM/SIGINT.

Connections. uvicorn closes an idle keep-alive connection after `timeout_keep_alive`, but has no header-read
timeout: a connection that never completes its request headers (a silent socket, a slowloris client
sending a byte now and then) is kept forever and holds a file descriptor. Once a second this server closes
every connection that has had no request in progress for HEADER_READ_TIMEOUT_SECONDS.

Shutdown. uvicorn stops accepting, closes idle connections and waits for the requests in flight. On top of
that the admission gate closes (a request that still arrives gets 503), and once `drain_seconds` have passed
`on_drain_timeout` fails the requests still running (the launcher calls the TokenizerManager's `fail_all`:
a 503 error object, or an error event and `data: [DONE]` for a stream), so every client gets a complete
answer instead of a response cut by cancellation. uvicorn's own cancel stays as the backstop,
FAIL_FLUSH_SECONDS later.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Callable

import uvicorn

from srt.server_args import ServerArgs

logger = logging.getLogger(__name__)

# uvicorn's default: an idle keep-alive connection is closed this long after its last response.
KEEP_ALIVE_SECONDS = 5
# A client has this long from connecting (or from its previous response) to send a request's headers. Real
# clients send them in one packet; this closes silent and slowloris connections.
HEADER_READ_TIMEOUT_SECONDS = 10.0
# After the drain timeout failed the remaining requests, their handlers get this long to write the error.
FAIL_FLUSH_SECONDS = 5.0
# uvicorn's main loop ticks every 0.1 s; connections are swept every this many ticks.
SWEEP_TICKS = 10


class SrtServer(uvicorn.Server):
    def __init__(
        self,
        config: uvicorn.Config,
        drain_seconds: float,
        on_drain_start: Callable[[], None],
        on_drain_timeout: Callable[[], None],
        header_timeout: float = HEADER_READ_TIMEOUT_SECONDS,
    ):
        super().__init__(config)
        self.drain_seconds = drain_seconds
        self.on_drain_start = on_drain_start
        self.on_drain_timeout = on_drain_timeout
        self.header_timeout = header_timeout
        # connection -> (its request cycle when it was first seen without a request in progress, since when)
        self._waiting: dict[object, tuple[object, float]] = {}

    async def on_tick(self, counter: int) -> bool:
        if counter % SWEEP_TICKS == 0:
            self.close_stalled_connections(time.monotonic())
        return await super().on_tick(counter)

    def close_stalled_connections(self, now: float) -> int:
        """Close the connections that have waited `header_timeout` for a request; returns how many."""
        waiting: dict[object, tuple[object, float]] = {}
        closed = 0
        for conn in list(self.server_state.connections):
            cycle = getattr(conn, "cycle", None)  # the current request's cycle; None before the first
            if cycle is not None and not cycle.response_complete:
                continue  # a request is in progress: the app's own limits apply
            seen = self._waiting.get(conn)
            since = seen[1] if seen is not None and seen[0] is cycle else now
            if now - since >= self.header_timeout:
                conn.transport.close()
                closed += 1
            else:
                waiting[conn] = (cycle, since)
        self._waiting = waiting
        if closed:
            logger.info(
                "closed %d connection(s) that sent no request for %.0f s", closed, self.header_timeout
            )
        return closed

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.on_drain_start()
        timer = asyncio.get_running_loop().call_later(self.drain_seconds, self.on_drain_timeout)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()


def make_server(
    app,
    server_args: ServerArgs,
    on_drain_start: Callable[[], None],
    on_drain_timeout: Callable[[], None],
) -> SrtServer:
    """The server for `app`; run it with `server.run(sockets=[listener])` on the socket bound at start-up."""
    config = uvicorn.Config(
        app,
        host=server_args.host,
        port=server_args.port,
        loop="uvloop",
        log_level=server_args.log_level,
        access_log=False,
        timeout_keep_alive=KEEP_ALIVE_SECONDS,
        timeout_graceful_shutdown=server_args.graceful_shutdown_timeout + FAIL_FLUSH_SECONDS,
    )
    return SrtServer(config, server_args.graceful_shutdown_timeout, on_drain_start, on_drain_timeout)
