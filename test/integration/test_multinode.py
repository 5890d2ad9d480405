"""Multi-node tensor parallelism on one machine as two hosts: node 0 and node 1 run in two network namespaces
joined by a veth pair (10.213.0.1 and 10.213.0.2), `--tp-size 2 --nnodes 2`, one rank each, meeting over TCP
at node 0's `--dist-init-addr`. Node 0 answers greedily exactly as one rank does, with one replica or two
(`--dp-size 2`: each replica's ranks span both nodes); node 1 is headless and serves its own /health and
/metrics. A node that dies, drops off the network or never joins ends the server with one clear line and a
non-zero exit within `--dist-timeout` and a few seconds, never a hang.

Needs the privilege to make network namespaces (root); skipped where it is missing."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator

import httpx
import pytest

from srt.metrics.text_format import parse_metrics_text, select
from srt_bench.server import srt_command, start_server
from test.integration.conftest import ServerHandle, flush_cache
from test.integration.netns import Host, netns_unavailable, two_hosts

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "Once upon a time", "1, 2, 3, 4,", "Request number 7 says"]
MAX_TOKENS = 12
# The namespaces are the test's own: fixed ports cannot collide with anything.
HTTP_PORT = 30000
DIST_PORT = 29500
# Long enough for the two nodes' start-up skew on a busy 2-core machine; the failure tests wait this out.
DIST_TIMEOUT_SECONDS = 20
# Quick failures: a node that never joins, a node cut off the network.
SHORT_DIST_TIMEOUT_SECONDS = 8
# After its peer node is killed (its sockets close at once), node 0 must be gone this soon.
EXIT_AFTER_KILL_SECONDS = 15.0
# Beyond --dist-timeout: the idle heartbeat's period, the shutdown, and a loaded machine.
EXIT_SLACK_SECONDS = 15.0
# Importing torch and loading the tiny model on a busy 2-core machine, before the rendezvous starts.
STARTUP_TIMEOUT_SECONDS = 300.0
POLL_SECONDS = 0.5


@pytest.fixture(scope="module")
def hosts() -> Iterator[tuple[Host, Host]]:
    reason = netns_unavailable()
    if reason is not None:
        pytest.skip(f"two hosts on one machine need network namespaces: {reason}")
    with two_hosts() as pair:
        yield pair


@pytest.fixture(scope="module")
def one_rank_outputs(tiny_fp32_server) -> list[list[int]]:
    # fp32 on both sides: int8 quantizes each rank's shard on its own, so tp=2 int8 is not bit-equal to tp=1
    flush_cache(tiny_fp32_server)
    r = httpx.post(f"{tiny_fp32_server.base_url}/generate", json=generate_body(), timeout=120)
    r.raise_for_status()
    return [out["output_ids"] for out in r.json()]


def generate_body() -> dict:
    """The prompts in one batched /generate, so that they share forward steps."""
    params = {"max_new_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    return {"text": PROMPTS, "sampling_params": params}


def start_node(
    host: Host, node_rank: int, model_dir: str, rendezvous: str, dist_timeout: float, *extra: str
) -> ServerHandle:
    """`python -m srt.launch_server` of one node, inside `host`'s namespace, in a session of its own."""
    flags = [*extra, "--model-path", model_dir, "--quantization", "none", "--tp-size", "2", "--nnodes", "2"]
    flags += ["--node-rank", str(node_rank), "--dist-init-addr", rendezvous]
    flags += ["--dist-timeout", str(dist_timeout), "--host", host.address]
    command = host.command(*srt_command(HTTP_PORT, *flags))
    return start_server(command, HTTP_PORT, name=f"srt-node{node_rank}", flags=flags)


@contextlib.contextmanager
def nodes(
    *started: tuple[Host, int, str, float], model_dir: str, flags: tuple[str, ...] = ()
) -> Iterator[list[ServerHandle]]:
    """Start each (host, node rank, rendezvous, timeout) with `flags`; stop every node's session afterwards,
    always."""
    handles: list[ServerHandle] = []
    try:
        for host, rank, rendezvous, timeout in started:
            handles.append(start_node(host, rank, model_dir, rendezvous, timeout, *flags))
        yield handles
    finally:
        for handle in handles:
            handle.stop(signal.SIGKILL)
            handle.log_path.unlink(missing_ok=True)


def url(host: Host, path: str) -> str:
    return f"http://{host.address}:{HTTP_PORT}{path}"


def wait_healthy(pairs: list[tuple[Host, ServerHandle]]) -> float:
    """Seconds until every node's /health answers 200; fails with the logs if a node exits first."""
    start = time.monotonic()
    waiting = list(pairs)
    while waiting:
        for host, node in list(waiting):
            assert node.proc.poll() is None, f"node exited with {node.proc.returncode}:\n{node.logs()}"
            if host.fetch(url(host, "/health"), timeout=2)[0] == 200:
                waiting.remove((host, node))
        if time.monotonic() - start > STARTUP_TIMEOUT_SECONDS:
            pytest.fail("nodes not healthy:\n" + "\n".join(n.logs() for _, n in waiting))
        time.sleep(POLL_SECONDS if waiting else 0)
    return time.monotonic() - start


def exit_seconds(node: ServerHandle, since: float, bound: float) -> float:
    """Seconds from `since` until `node`'s launcher exited; fails if it is still running after `bound`."""
    try:
        node.proc.wait(max(0.0, since + bound - time.monotonic()))
    except subprocess.TimeoutExpired:
        pytest.fail(f"node still running {bound:.0f} s later:\n{node.logs()}")
    return time.monotonic() - since


def error_lines(node: ServerHandle) -> list[str]:
    return [line for line in node.logs().splitlines() if " ERROR " in line]


def test_two_nodes_answer_as_one_rank_and_a_killed_node_ends_the_server(
    hosts, tiny_model_dir, one_rank_outputs
):
    a, b = hosts
    rendezvous = f"{a.address}:{DIST_PORT}"
    with nodes((a, 0, rendezvous, DIST_TIMEOUT_SECONDS), (b, 1, rendezvous, DIST_TIMEOUT_SECONDS),
               model_dir=tiny_model_dir) as (node0, node1):  # fmt: skip
        healthy_after = wait_healthy([(a, node0), (b, node1)])

        status, body = a.fetch(url(a, "/generate"), generate_body(), timeout=120)
        assert status == 200, body
        outputs = [out["output_ids"] for out in json.loads(body)]
        assert outputs == one_rank_outputs

        status, body = b.fetch(url(b, "/health"))
        assert json.loads(body) == {"status": "ok", "node_rank": 1, "tp_ranks": [1]}
        status, body = b.fetch(url(b, "/metrics"))
        assert status == 200
        node1_samples = parse_metrics_text(body)
        assert select(node1_samples, "sglang:process_resident_memory_bytes", tp_rank="1")
        assert not select(node1_samples, "sglang:num_running_reqs"), "node 0 reports the scheduler"
        node0_samples = parse_metrics_text(a.fetch(url(a, "/metrics"))[1])
        assert select(node0_samples, "sglang:num_running_reqs", tp_rank="0")
        assert b.fetch(url(b, "/v1/models"))[0] == 404, "a headless node serves no API"

        killed_at = time.monotonic()
        os.killpg(node1.proc.pid, signal.SIGKILL)
        took = exit_seconds(node0, killed_at, EXIT_AFTER_KILL_SECONDS)
        assert node0.proc.returncode not in (0, None)
        lost = [line for line in error_lines(node0) if "lost a tensor-parallel rank on node 1" in line]
        assert len(lost) == 1, node0.logs()
        assert "Traceback" not in node0.logs()
    print(
        f"\nmultinode: healthy {healthy_after:.1f} s after start; greedy equal to tp=1: {outputs == one_rank_outputs}; "
        f"node 1 killed -> node 0 exited in {took:.1f} s ({lost[0].split('ERROR ')[1]})"
    )


def test_a_node_that_never_joins_or_never_answers_fails_in_one_line(hosts, tiny_model_dir):
    """Node 0 alone waits for node 1 and gives up; node 1 alone (pointed where no node 0 listens) gives up
    too; each within the timeout, in one line naming the node it missed, exit code 1."""
    a, b = hosts
    timeout = SHORT_DIST_TIMEOUT_SECONDS
    alone, nowhere = f"{a.address}:{DIST_PORT + 1}", f"{a.address}:{DIST_PORT + 2}"  # no node 0 listens there
    with nodes((a, 0, alone, timeout), (b, 1, nowhere, timeout),
               model_dir=tiny_model_dir) as (node0, node1):  # fmt: skip
        started = time.monotonic()
        took = [exit_seconds(node, started, STARTUP_TIMEOUT_SECONDS) for node in (node0, node1)]
        assert (node0.proc.returncode, node1.proc.returncode) == (1, 1)
        [missing] = error_lines(node0)
        assert (
            f"node 1 (tp rank 1) did not join the tensor-parallel group at {alone} within {timeout:g} s"
            in missing
        )
        [unanswered] = error_lines(node1)
        assert f"node 0 did not answer at {nowhere} within {timeout:g} s" in unanswered
    print(
        f"\nmultinode: node 1 never joined -> node 0 exited {took[0]:.1f} s after start "
        f"({missing.split('ERROR ')[1]}); node 0 never answered -> node 1 exited {took[1]:.1f} s after start"
    )


def test_two_replicas_across_two_nodes_answer_as_one_rank_and_a_cut_link_ends_both(
    hosts, tiny_model_dir, one_rank_outputs
):
    """`--dp-size 2`: each replica's two ranks span both nodes, meeting at the port and the port + 1, and each
    answers as one rank. Then node 1's link is cut: no socket closes when a cable is pulled, so the
    collectives' timeout is what notices, on both sides. Four schedulers start here, two per node, so the
    rendezvous gets the timeout that covers a busy machine's start-up skew (the short one failed there)."""
    a, b = hosts
    timeout = DIST_TIMEOUT_SECONDS
    rendezvous = f"{a.address}:{DIST_PORT + 3}"  # and DIST_PORT + 4 for replica 1
    with nodes((a, 0, rendezvous, timeout), (b, 1, rendezvous, timeout), model_dir=tiny_model_dir,
               flags=("--dp-size", "2")) as (node0, node1):  # fmt: skip
        healthy_after = wait_healthy([(a, node0), (b, node1)])
        for replica in (0, 1):
            body = {**generate_body(), "data_parallel_rank": replica}
            status, text = a.fetch(url(a, "/generate"), body, timeout=120)
            assert status == 200, text
            assert [out["output_ids"] for out in json.loads(text)] == one_rank_outputs, f"replica {replica}"
        node1_samples = parse_metrics_text(b.fetch(url(b, "/metrics"))[1])
        for replica in ("0", "1"):
            assert select(node1_samples, "sglang:process_resident_memory_bytes", tp_rank="1", dp_rank=replica)

        cut_at = time.monotonic()
        b.cut_link()
        took = [exit_seconds(node, cut_at, timeout + EXIT_SLACK_SECONDS) for node in (node0, node1)]
        assert node0.proc.returncode not in (0, None) and node1.proc.returncode not in (0, None)
        assert any("lost a tensor-parallel rank on node 1 (Timed out" in line for line in error_lines(node0))
        assert any("tensor-parallel rank 0 is gone" in line for line in error_lines(node1))
    print(
        f"\nmultinode: --dp-size 2 over 2 nodes healthy {healthy_after:.1f} s after start, both replicas "
        f"greedy-equal to tp=1; node 1 cut off -> node 0 exited in {took[0]:.1f} s, node 1 in {took[1]:.1f} s"
    )
