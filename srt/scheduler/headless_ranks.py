"""The tensor-parallel ranks of a node other than 0 (`--node-rank R > 0`): no sockets, no tokenizer, no
outputs; they replay rank 0's steps so that the collectives of every forward pass pair up.

The headless launcher (`HeadlessNode` in `srt/launch_server.py`) spawns this node's first rank of each
data-parallel replica, which starts the node's other ranks of that replica (`TpPeers`, as rank 0 does on node
0), joins the replica's group at node 0's `--dist-init-addr` (port + replica), reports ready,
then replays rank 0's broadcasts until the group goes away. Every rank of the node refreshes its process
metrics, which the node's own `/metrics` serves.
"""

from __future__ import annotations

import logging
from multiprocessing.connection import Connection

from srt.process_logging import configure_process_logging, rank_label
from srt.scheduler.runner_builder import build_runner
from srt.scheduler.scheduler import Scheduler
from srt.scheduler.scheduler_process import ready_message
from srt.scheduler.tp_peers import TpPeers, check_tp_size, peer_loop, start_node_metrics, tp_init_method
from srt.server_args import ServerArgs

logger = logging.getLogger(__name__)


def run_headless_ranks(
    server_args: ServerArgs, model_dir: str, ready_writer: Connection, dp_rank: int = 0
) -> None:
    """Spawn target of this node's first rank of replica `dp_rank` (a child of the headless launcher)."""
    first = server_args.node_tp_ranks[0]
    label = rank_label(first, dp_rank if server_args.dp_size > 1 else None)
    configure_process_logging(server_args.log_level, f"node{server_args.node_rank} {label}")
    check_tp_size(model_dir, server_args.tp_size)  # before any peer starts: one clear error
    init_method = tp_init_method(server_args, None, dp_rank)
    TpPeers.start(
        server_args, model_dir, dp_rank, init_method
    )  # watched: a local peer's death ends this rank
    runner = build_runner(server_args, model_dir, first, init_method, dp_rank)
    start_node_metrics(server_args, first, dp_rank)
    scheduler = Scheduler(server_args, runner)  # NullReporter: rank 0 writes the log lines and metrics
    logger.info(
        "node %d ready: tp ranks %s of %d joined rank 0 at %s",
        server_args.node_rank,
        ", ".join(map(str, server_args.node_tp_ranks)),
        server_args.tp_size,
        init_method,
    )
    ready_writer.send(ready_message(scheduler))
    ready_writer.close()
    peer_loop(scheduler)
