"""Multi-node flags and the rendezvous, without a second machine: every bad combination of --nnodes,
--node-rank, --dist-init-addr and --dist-timeout is one line naming the flag; node r hosts tp ranks
r * tp / nnodes onwards; a rank 0 whose peers never come names the nodes it missed, a rank that finds no node
0 says where it looked, both within the timeout. test/integration/test_multinode.py runs two real nodes."""

from __future__ import annotations

import time

import pytest

from srt.model_executor.parallel_state import collective_failure
from srt.model_executor.rendezvous import (
    GLOO_INTERFACE_ENV,
    RendezvousError,
    interface_towards,
    join_tcp_store,
)
from srt.scheduler.tp_peers import tp_init_method
from srt.server_args import ServerArgs
from srt.sockets import find_free_port
from test.unit.test_startup_errors import FAST_FAIL_SECONDS, assert_one_line_error, launch

TWO_NODES = {"tp_size": 2, "nnodes": 2, "dist_init_addr": "10.0.0.1:5000"}
JOIN_TIMEOUT_SECONDS = 1.0
# The store's own connection retries and a busy machine, beyond the timeout.
JOIN_SLACK_SECONDS = 5.0


@pytest.mark.parametrize(
    ("fields", "flag"),
    [
        ({**TWO_NODES, "node_rank": 2}, "--node-rank must be in 0..1"),
        ({**TWO_NODES, "node_rank": -1}, "--node-rank must be in 0..1"),
        ({"nnodes": 0}, "--nnodes must be >= 1"),
        ({**TWO_NODES, "dist_init_addr": None}, "--nnodes 2 needs --dist-init-addr"),
        ({**TWO_NODES, "dist_init_addr": "node0"}, "--dist-init-addr must be HOST:PORT"),
        ({**TWO_NODES, "dist_init_addr": "node0:99999"}, "--dist-init-addr must be HOST:PORT"),
        ({**TWO_NODES, "dist_init_addr": "node0:port"}, "--dist-init-addr must be HOST:PORT"),
        ({**TWO_NODES, "tp_size": 3}, "--tp-size 3 must be a multiple of --nnodes 2"),
        ({**TWO_NODES, "dist_timeout": 0}, "--dist-timeout must be > 0"),
    ],
)
def test_bad_multinode_flags_are_one_line_naming_the_flag(fields, flag):
    with pytest.raises(ValueError, match=flag) as err:
        ServerArgs(**fields)
    assert "\n" not in str(err.value)


def test_well_formed_addresses_pass():
    for addr in ("10.0.0.1:5000", "node0.cluster:29500", "[fe80::1]:29500"):
        assert ServerArgs(**{**TWO_NODES, "dist_init_addr": addr}).dist_init_addr == addr


def test_a_bad_address_is_refused_on_the_command_line_with_exit_2():
    r, took = launch("--tp-size", "2", "--nnodes", "2", "--dist-init-addr", "10.0.0.1")
    assert_one_line_error(r, "--dist-init-addr must be HOST:PORT")
    assert took < FAST_FAIL_SECONDS


def test_each_data_parallel_replica_meets_at_its_own_port():
    args = ServerArgs(**TWO_NODES, dp_size=3)
    assert [tp_init_method(args, None, d) for d in range(3)] == [
        "tcp://10.0.0.1:5000",
        "tcp://10.0.0.1:5001",
        "tcp://10.0.0.1:5002",
    ]
    ipv6 = ServerArgs(**{**TWO_NODES, "dist_init_addr": "[fe80::1]:29500"}, dp_size=2)
    assert tp_init_method(ipv6, None, 1) == "tcp://[fe80::1]:29501"


def test_node_r_hosts_its_consecutive_share_of_the_ranks():
    layout = {r: ServerArgs(**{**TWO_NODES, "tp_size": 4, "node_rank": r}).node_tp_ranks for r in (0, 1)}
    assert {r: list(ranks) for r, ranks in layout.items()} == {0: [0, 1], 1: [2, 3]}
    assert not ServerArgs(**TWO_NODES).headless and ServerArgs(**TWO_NODES, node_rank=1).headless
    assert list(ServerArgs(tp_size=2).node_tp_ranks) == [0, 1]  # one node: all of them


def test_rank_0_names_the_nodes_that_never_joined_within_the_timeout(monkeypatch):
    monkeypatch.delenv(GLOO_INTERFACE_ENV, raising=False)
    addr = f"tcp://127.0.0.1:{find_free_port()}"
    start = time.monotonic()
    with pytest.raises(RendezvousError) as err:
        join_tcp_store(addr, rank=0, size=4, ranks_per_node=2, timeout_seconds=JOIN_TIMEOUT_SECONDS)
    assert time.monotonic() - start < JOIN_TIMEOUT_SECONDS + JOIN_SLACK_SECONDS
    assert str(err.value) == (
        f"nodes 0, 1 (tp ranks 1, 2, 3) did not join the tensor-parallel group at {addr[6:]} within 1 s"
    )


def test_a_rank_that_finds_no_node_0_says_where_it_looked(monkeypatch):
    monkeypatch.delenv(GLOO_INTERFACE_ENV, raising=False)
    addr = f"127.0.0.1:{find_free_port()}"
    start = time.monotonic()
    with pytest.raises(RendezvousError, match=f"on node 1 \\(tp rank 1\\): node 0 did not answer at {addr}"):
        join_tcp_store(
            f"tcp://{addr}", rank=1, size=2, ranks_per_node=1, timeout_seconds=JOIN_TIMEOUT_SECONDS
        )
    assert time.monotonic() - start < JOIN_TIMEOUT_SECONDS + JOIN_SLACK_SECONDS


def test_gloo_talks_over_the_interface_that_reaches_node_0():
    assert interface_towards("127.0.0.1") == "lo"


@pytest.mark.parametrize(
    ("message", "reason"),
    [
        (
            "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [10.0.0.2]:4242: Connection "
            "reset by peer. This is typically caused by a remote worker hanging",
            "Read error [10.0.0.2]:4242: Connection reset by peer",
        ),
        (
            "[/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:129] Timed out waiting 8000ms for "
            "send operation to complete",
            "Timed out waiting 8000ms for send operation to complete",
        ),
        ("CUDA error: an illegal memory access was encountered", None),
    ],
)
def test_only_a_failed_collective_reads_as_a_lost_rank(message, reason):
    assert collective_failure(RuntimeError(message)) == reason
