"""The scheduler subprocess: loads the model, reports readiness, then turns the loop — drain the input
socket, run one step, send that step's outputs — until it is killed.

With `--tp-size N` this process is tensor-parallel rank 0: it starts ranks 1..N-1 (`tp_peers.py`), which
run the same scheduler without sockets, and each iteration broadcasts the messages it drained so that every
rank applies the same inputs and takes the same step. Only rank 0 talks to the detokenizer and reports.
"""

from __future__ import annotations

import logging
import time
import traceback
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

import zmq

from srt.io_struct import SchedulerReady
from srt.kv_events.publisher import start_kv_event_publisher
from srt.port_args import PortArgs
from srt.process_logging import configure_process_logging, rank_label
from srt.scheduler.runner_builder import build_runner
from srt.scheduler.scheduler import Scheduler
from srt.scheduler.scheduler_tracing import SchedulerTracing
from srt.server_args import ServerArgs
from srt.sockets import get_zmq_socket

if TYPE_CHECKING:
    from srt.scheduler.tp_peers import TpPeers

logger = logging.getLogger(__name__)

# While idle the loop blocks on the socket, waking at this period so periodic work (the stats summary,
# process metrics) still happens.
IDLE_POLL_MS = 1000
# While the only work is on a worker thread (a grammar compiling, an adapter's files being read): how often to
# look whether it is done.
BACKGROUND_POLL_MS = 2


def run_scheduler_process(
    server_args: ServerArgs, port_args: PortArgs, model_dir: str, ready_writer: Connection, dp_rank: int = 0
) -> None:
    from srt.scheduler.step_reporter import build_reporter

    configure_process_logging(
        server_args.log_level, rank_label(0, dp_rank if server_args.dp_size > 1 else None)
    )
    try:
        start = time.monotonic()
        peers = dist_init_method = None
        if server_args.tp_size > 1:
            from srt.scheduler.tp_peers import TpPeers, check_tp_size, tp_init_method

            check_tp_size(model_dir, server_args.tp_size)  # before any peer starts: one clear error
            dist_init_method = tp_init_method(server_args, port_args, dp_rank)
            peers = TpPeers.start(server_args, model_dir, dp_rank, dist_init_method)
        runner = build_runner(server_args, model_dir, 0, dist_init_method, dp_rank)
        reporter = build_reporter(
            server_args, runner, dp_rank, time.monotonic() - start, load_dir=port_args.ipc_dir
        )
        kv_events = start_kv_event_publisher(server_args, dp_rank, reporter.collector)
        tracing = SchedulerTracing.create(server_args, dp_rank)
        scheduler = Scheduler(server_args, runner, reporter, kv_events=kv_events, tracing=tracing)
        ctx = zmq.Context()
        recv_sock = get_zmq_socket(ctx, zmq.PULL, port_args.scheduler_input_for(dp_rank), bind=True)
        send_sock = get_zmq_socket(ctx, zmq.PUSH, port_args.detokenizer_input, bind=False)
    except Exception:
        ready_writer.send(traceback.format_exc())
        raise
    logger.info(
        "Scheduler ready: KV capacity %d tokens, max running requests %d, attention backend %s",
        runner.max_total_num_tokens,
        runner.max_running_requests,
        runner.attention_backend_name,
    )
    ready_writer.send(ready_message(scheduler))
    ready_writer.close()
    try:
        event_loop(scheduler, recv_sock, send_sock, peers)
    except RuntimeError as e:
        if peers is not None:
            peers.exit_if_group_lost(e)  # a rank gone: one line, not a traceback
        raise


def ready_message(scheduler: Scheduler) -> SchedulerReady:
    """What a scheduler tells its launcher once it can serve: the limits the HTTP process enforces."""
    runner = scheduler.runner
    return SchedulerReady(
        max_total_num_tokens=runner.max_total_num_tokens,
        max_req_input_len=scheduler.max_req_input_len,
        context_len=runner.context_len,
        max_running_requests=runner.max_running_requests,
        attention_backend=runner.attention_backend_name,
        quantization=runner.quantization,
        vocab_size=runner.vocab_size,
        eos_token_ids=list(runner.eos_token_ids),
    )


def event_loop(
    scheduler: Scheduler, recv_sock: zmq.Socket, send_sock: zmq.Socket, peers: TpPeers | None = None
) -> None:
    poller = zmq.Poller()
    poller.register(recv_sock, zmq.POLLIN)
    was_busy = False
    while True:
        if scheduler.is_idle and not scheduler.finished_outside_step:
            if was_busy:
                scheduler.reporter.on_idle(scheduler.load())
                was_busy = False
            if not poller.poll(IDLE_POLL_MS):
                if peers is not None:
                    peers.heartbeat(scheduler.runner.tp)
                scheduler.reporter.on_tick(scheduler.load())
                continue
        elif scheduler.only_background_work:
            # nothing to run until a grammar compiles, an adapter's files are read or a message arrives
            poller.poll(BACKGROUND_POLL_MS)
        msgs = drain(recv_sock)
        if peers is not None:
            peers.share_step(scheduler.runner.tp, msgs)
        for msg in msgs:
            reply = scheduler.handle(msg)
            if reply is not None:
                send_sock.send_pyobj(reply)
        out = scheduler.step()
        if out is not None:
            send_sock.send_pyobj(out)
        for reply in scheduler.take_replies():
            send_sock.send_pyobj(reply)
        was_busy = True
        scheduler.reporter.on_tick(scheduler.load())


def drain(sock: zmq.Socket) -> list:
    """Every message waiting on `sock`, without blocking."""
    msgs = []
    while True:
        try:
            msgs.append(sock.recv_pyobj(zmq.NOBLOCK))
        except zmq.Again:
            return msgs
