"""Joining one tensor-parallel group across machines (`--nnodes`): the TCP store at node 0's
`--dist-init-addr`, the check that every rank joined, and the network interface gloo talks over.

torch's own `tcp://` rendezvous fails after the timeout with "1/2 clients joined", which names no one. Here
rank 0 hosts the store and every rank writes its own key as soon as it is connected, so rank 0 can say which
node (and which ranks) never came, and a rank that cannot reach node 0 says where it looked.

Gloo binds to the address its host name resolves to, which on a multi-homed machine (or in a network
namespace) is often not the one the other nodes reach: unless GLOO_SOCKET_IFNAME is set, each rank picks the
interface its route to node 0 leaves by.
"""

from __future__ import annotations

import fcntl
import logging
import os
import socket
import struct
import time
from datetime import timedelta

import torch.distributed as dist

from srt.engine_options import tcp_host_port

logger = logging.getLogger(__name__)

GLOO_INTERFACE_ENV = "GLOO_SOCKET_IFNAME"
# ioctl that reads an interface's IPv4 address (linux/sockios.h)
SIOCGIFADDR = 0x8915
# How often rank 0 looks whether every rank has joined.
JOIN_POLL_SECONDS = 0.2
JOINED_KEY = "srt/joined/{}"


class RendezvousError(RuntimeError):
    """A rank could not form the group: a node never joined, or node 0 never answered."""


def interface_towards(host: str) -> str | None:
    """The name of the network interface this machine reaches `host` through (None if unknown)."""
    try:
        family = socket.getaddrinfo(host, None)[0][0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((host, 9))  # UDP: picks the route, sends nothing
            local = probe.getsockname()[0]
    except OSError:
        return None
    for _, name in socket.if_nameindex():
        if interface_address(name) == local:
            return name
    return None


def interface_address(name: str) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def node_of(rank: int, ranks_per_node: int) -> int:
    return rank // ranks_per_node


def describe_missing(missing: list[int], ranks_per_node: int) -> str:
    """ "node 1 (tp rank 1)", "nodes 1, 2 (tp ranks 2, 3, 4, 5)"."""
    nodes = sorted({node_of(r, ranks_per_node) for r in missing})
    plural = "s" if len(nodes) > 1 else ""
    ranks_plural = "s" if len(missing) > 1 else ""
    return f"node{plural} {', '.join(map(str, nodes))} (tp rank{ranks_plural} {', '.join(map(str, missing))})"


def join_tcp_store(
    init_method: str, rank: int, size: int, ranks_per_node: int, timeout_seconds: float
) -> dist.TCPStore:
    """Rank 0 hosts the store and returns once all `size` ranks wrote their key; the others connect (retrying
    until the timeout). Raises RendezvousError naming the missing nodes, or the unreachable node 0."""
    host, port = tcp_host_port(init_method)
    timeout = timedelta(seconds=timeout_seconds)
    if GLOO_INTERFACE_ENV not in os.environ and (name := interface_towards(host)) is not None:
        os.environ[GLOO_INTERFACE_ENV] = name
    try:
        store = dist.TCPStore(host, port, size, rank == 0, timeout=timeout, wait_for_workers=False)
    except (RuntimeError, OSError) as e:  # DistNetworkError / DistStoreError are RuntimeErrors
        what = f"cannot bind {host}:{port}" if rank == 0 else f"node 0 did not answer at {host}:{port}"
        raise RendezvousError(
            f"tensor-parallel rendezvous failed on node {node_of(rank, ranks_per_node)} (tp rank {rank}): "
            f"{what} within {timeout_seconds:g} s ({' '.join(str(e).split())[:200]})"
        ) from e
    store.set(JOINED_KEY.format(rank), "1")
    if rank != 0:
        return store
    deadline = time.monotonic() + timeout_seconds
    missing = list(range(1, size))
    while missing := [r for r in missing if not store.check([JOINED_KEY.format(r)])]:
        if time.monotonic() > deadline:
            raise RendezvousError(
                f"{describe_missing(missing, ranks_per_node)} did not join the tensor-parallel group at "
                f"{host}:{port} within {timeout_seconds:g} s"
            )
        time.sleep(JOIN_POLL_SECONDS)
    logger.info("every node joined the tensor-parallel group at %s:%d", host, port)
    return store
