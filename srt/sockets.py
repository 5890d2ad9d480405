"""Every socket srt opens: the ZMQ sockets between (and out of) the processes, and the HTTP listener."""

from __future__ import annotations

import errno
import socket

import zmq

from srt.child_startup import ConfigError


def get_zmq_socket(
    context: zmq.Context, socket_type: int, endpoint: str, bind: bool, hwm: int | None = 0
) -> zmq.Socket:
    """Every ZMQ socket of srt, bound or connected, never lingering at close. The ring's PUSH/PULL sockets
    keep the default unlimited high-water marks (`hwm=0`): a full queue must never block or drop a message
    (the ring carries one message per scheduler step, so memory stays bounded by the work in flight). A
    publisher to outside subscribers passes its own bound (None keeps ZMQ's)."""
    sock = context.socket(socket_type)
    if hwm is not None:
        sock.setsockopt(zmq.SNDHWM, hwm)
        sock.setsockopt(zmq.RCVHWM, hwm)
    sock.setsockopt(zmq.LINGER, 0)
    if bind:
        sock.bind(endpoint)
    else:
        sock.connect(endpoint)
    return sock


def bind_listener(host: str, port: int) -> socket.socket:
    """Bind (without listening yet) the HTTP server's socket, so a taken port or a bad host fails at once,
    before any child process starts; connections are refused until the server listens on it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a TIME_WAIT port is reusable
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise ConfigError(
                f"port {port} on {host} is already in use: stop the process that holds it or choose another "
                "--port"
            ) from None
        reason = e.strerror or str(e)
        raise ConfigError(f"cannot listen on {host}:{port} ({reason}): check --host and --port") from None
    return sock


def find_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
