"""Tensor-parallel ranks 1..N-1 of one scheduler, and rank 0's handle on them (the ranks on its own machine;
with `--nnodes` the other machines' ranks are started there, `headless_ranks.py`).

Every rank runs its own `Scheduler` over its own shard of the model. The schedulers stay identical because
they see identical inputs: each iteration rank 0 broadcasts the list of messages it drained from its
socket (possibly empty) and then every rank applies them and takes one step. Scheduling, the prefix cache,
the allocators and sampling (same seeds, same draws, same replicated logits) are deterministic functions of
those inputs, so every rank builds the same batches and the collectives inside the forward pass pair up.
While idle, rank 0 broadcasts a heartbeat instead, so a waiting peer never hits the collective timeout and a
dead peer is noticed.

Liveness: rank 0 watches its local peers and exits (non-zero) the moment one dies, so the launcher's watchdog
fires; a peer dies with rank 0 (parent-death signal; rank 0 also ends its peers when it exits) or fails its
next collective. A rank on another machine is not a child to watch: its death closes its sockets and fails
the next collective at once, and a rank that stops answering fails it after `--dist-timeout` (rank 0 sends
something every second, idle or not); either way each side says so in one line and exits non-zero.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import multiprocessing.util
import os
import threading
import time

from srt.engine_options import tcp_host_port
from srt.model_executor.parallel_state import TensorParallelGroup, collective_failure
from srt.port_args import PortArgs
from srt.process_control import (
    CHILD_STOP_SIGNAL,
    leave_stopping_to_the_launcher,
    set_parent_death_signal,
    set_process_name,
    watch_parent_process,
)
from srt.process_logging import configure_process_logging, rank_label
from srt.scheduler.runner_builder import build_runner
from srt.scheduler.scheduler import Scheduler
from srt.server_args import ServerArgs

logger = logging.getLogger(__name__)

# Broadcast by rank 0 while idle in place of a message list: "no step this time".
HEARTBEAT = None
# How often rank 0 checks that its peers are alive.
PEER_WATCH_SECONDS = 0.5
EXIT_PEER_DIED = 1


def tp_init_method(server_args: ServerArgs, port_args: PortArgs | None, dp_rank: int) -> str:
    """Where one replica's TP group meets: across machines, node 0's --dist-init-addr (replica d at its port
    + d), else a rendezvous file in the server's private IPC directory."""
    if server_args.nnodes > 1:
        host, port = tcp_host_port(server_args.dist_init_addr)
        return f"tcp://{f'[{host}]' if ':' in host else host}:{port + dp_rank}"
    return f"file://{os.path.join(port_args.ipc_dir, f'tp-init-dp{dp_rank}')}"


def check_tp_size(model_dir: str, tp_size: int) -> None:
    """Raise the model runner's divisibility error in rank 0 alone, before peers exist that would fail
    with it too (and whose death would race rank 0's error report)."""
    from srt.model_executor.model_loader import checkpoint_config
    from srt.model_executor.runner_setup import check_tp_divides

    check_tp_divides(checkpoint_config(model_dir), tp_size)


def peer_process_name(tp_rank: int) -> str:
    """Short enough for the kernel's 15-character process name."""
    return f"srt-sched-tp{tp_rank}"


class TpPeers:
    """A machine's first rank's view of the other ranks on its machine: started as daemons (they die with it),
    watched by a thread."""

    def __init__(self, processes: list[mp.process.BaseProcess], remote_nodes: int = 0):
        self.processes = processes
        self.remote_nodes = remote_nodes  # machines whose ranks share the group (--nnodes - 1)
        # When this process ends (a multiprocessing child, so not through atexit), multiprocessing SIGTERMs
        # its daemon children and waits for them. The peers ignore SIGTERM (see
        # process_control.leave_stopping_to_the_launcher): after an uncaught exception this rank would wait forever and
        # the launcher would never notice. Finalizers of priority >= 0 run before that wait.
        multiprocessing.util.Finalize(None, self.stop, exitpriority=10)

    def stop(self) -> None:
        """End every peer (they die of CHILD_STOP_SIGNAL, not SIGTERM)."""
        for proc in self.processes:
            if proc.is_alive():
                os.kill(proc.pid, CHILD_STOP_SIGNAL)

    @classmethod
    def start(cls, server_args: ServerArgs, model_dir: str, dp_rank: int, init_method: str) -> TpPeers:
        """Start this machine's ranks after its first one (on node 0: ranks 1..tp-size / nnodes - 1)."""
        ctx = mp.get_context("spawn")
        processes = []
        for tp_rank in server_args.node_tp_ranks[1:]:
            proc = ctx.Process(
                target=run_tp_peer,
                args=(server_args, model_dir, dp_rank, tp_rank, init_method),
                name=peer_process_name(tp_rank),
                daemon=True,
            )
            proc.start()
            processes.append(proc)
        peers = cls(processes, server_args.nnodes - 1)
        threading.Thread(target=peers._watch, name="tp-peer-watch", daemon=True).start()
        return peers

    def _watch(self) -> None:
        """Exit this process as soon as a peer is gone: its collectives would fail or hang, and the launcher
        watches only this process."""
        while True:
            self._exit_if_a_peer_died()
            time.sleep(PEER_WATCH_SECONDS)

    def _exit_if_a_peer_died(self) -> None:
        for proc in self.processes:
            if not proc.is_alive():
                logger.error(
                    "TP peer %s (pid %d) died with exit code %s; exiting", proc.name, proc.pid, proc.exitcode
                )
                for other in self.processes:
                    if other.is_alive():
                        other.kill()
                os._exit(EXIT_PEER_DIED)

    def exit_if_group_lost(self, exc: BaseException) -> None:
        """A collective failed (a rank's sockets closed, or it stopped answering): if a local peer died, say
        so; else the group lost a rank elsewhere. One line and a non-zero exit, instead of a traceback."""
        reason = collective_failure(exc)
        if reason is None:
            return
        for proc in self.processes:
            proc.join(PEER_WATCH_SECONDS)  # a collective fails as soon as a peer's socket closes
        self._exit_if_a_peer_died()
        where = {0: "", 1: " on node 1"}.get(self.remote_nodes, f" on one of nodes 1..{self.remote_nodes}")
        logger.error("lost a tensor-parallel rank%s (%s); exiting", where, reason)
        self.stop()
        os._exit(EXIT_PEER_DIED)

    def share_step(self, tp: TensorParallelGroup, msgs: list) -> None:
        """Send this iteration's inputs; every rank then applies them and steps."""
        tp.broadcast_object(msgs)

    def heartbeat(self, tp: TensorParallelGroup) -> None:
        tp.broadcast_object(HEARTBEAT)


def run_tp_peer(
    server_args: ServerArgs, model_dir: str, dp_rank: int, tp_rank: int, init_method: str
) -> None:
    """Spawn target of TP rank `tp_rank` >= 1."""
    set_process_name(peer_process_name(tp_rank))
    set_parent_death_signal()  # rank 0 killed with SIGKILL must not leave this rank behind
    watch_parent_process()
    leave_stopping_to_the_launcher()  # it stops rank 0's whole process tree
    configure_process_logging(
        server_args.log_level, rank_label(tp_rank, dp_rank if server_args.dp_size > 1 else None)
    )
    runner = build_runner(server_args, model_dir, tp_rank, init_method, dp_rank)
    if server_args.headless:
        start_node_metrics(server_args, tp_rank, dp_rank)
    # NullReporter: rank 0 alone writes the log lines and the scheduler metrics
    peer_loop(Scheduler(server_args, runner))


def start_node_metrics(server_args: ServerArgs, tp_rank: int, dp_rank: int) -> None:
    """On a headless node every rank refreshes its process metrics (CPU, memory, open files), which that
    node's /metrics serves; on node 0, rank 0 reports for the group."""
    if server_args.metrics_enabled:
        from srt.metrics.collector import start_process_metrics

        labels = {"model_name": server_args.model_name, "tp_rank": str(tp_rank)}
        if server_args.dp_size > 1:
            labels["dp_rank"] = str(dp_rank)
        start_process_metrics("scheduler", labels)


def peer_loop(scheduler: Scheduler) -> None:
    """Apply rank 0's inputs and step until rank 0's group goes away (one line, a non-zero exit)."""
    try:
        replay_rank0(scheduler)
    except RuntimeError as e:
        reason = collective_failure(e)
        if reason is None:
            raise
        logger.error("tensor-parallel rank 0 is gone (%s); exiting", reason)
        os._exit(EXIT_PEER_DIED)


def replay_rank0(scheduler: Scheduler) -> None:
    """Apply rank 0's inputs and step, forever; replies and outputs are rank 0's to send."""
    tp = scheduler.runner.tp
    while True:
        msgs = tp.broadcast_object()
        if msgs is HEARTBEAT:
            continue
        for msg in msgs:
            scheduler.handle(msg)
        scheduler.step()
        scheduler.take_replies()  # rank 0 answers for the group
