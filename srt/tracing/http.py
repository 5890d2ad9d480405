"""The HTTP side of tracing: when each request reached the server, for the root and tokenize spans."""

from __future__ import annotations

import time

# ASGI scope key holding the main process's time.monotonic() at which the request arrived.
RECEIVED_TS_KEY = "srt.received_ts"


class ReceivedTimeMiddleware:
    """Stamps each HTTP request's arrival into its ASGI scope, before the body is read, parsed and tokenized,
    so a trace shows that work too. Installed only with --enable-trace."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            scope[RECEIVED_TS_KEY] = time.monotonic()
        await self.app(scope, receive, send)
