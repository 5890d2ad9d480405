"""Rank 0 of a tensor-parallel scheduler ends its peers at exit itself: the peers ignore SIGTERM (as every
child of the server does, so that a service manager's SIGTERM to the whole group cannot cut a drain), and
multiprocessing's own exit hook would SIGTERM them and then wait for them forever."""

from __future__ import annotations

import multiprocessing as mp
import signal
import time

from srt.process_control import pid_alive

EXIT_SECONDS = 30.0


def idle_peer() -> None:
    time.sleep(600)


def crashing_rank0(peer_pids: mp.Queue) -> None:
    from srt.scheduler.tp_peers import TpPeers

    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # as child_startup.run_child sets it; the peer inherits it
    peer = mp.get_context("spawn").Process(target=idle_peer, daemon=True)
    peer.start()
    TpPeers([peer])
    peer_pids.put(peer.pid)
    raise RuntimeError("rank 0 fails after start-up")


def test_a_rank_that_raises_exits_and_takes_its_peers_with_it():
    ctx = mp.get_context("spawn")
    peer_pids = ctx.Queue()
    rank0 = ctx.Process(target=crashing_rank0, args=(peer_pids,))
    rank0.start()
    try:
        peer = peer_pids.get(timeout=EXIT_SECONDS)
        rank0.join(EXIT_SECONDS)
        assert not rank0.is_alive(), "rank 0 hangs at exit waiting for a peer that ignores SIGTERM"
        assert rank0.exitcode != 0
        deadline = time.monotonic() + 5
        while pid_alive(peer) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not pid_alive(peer)
    finally:
        if rank0.is_alive():
            rank0.kill()
