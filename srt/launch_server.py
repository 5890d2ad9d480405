"""`python -m srt.launch_server`: start the scheduler and detokenizer processes, then serve HTTP.

Start-up order matters: the HTTP port is bound and the metrics directory set up first, so a taken port or an
unusable directory fails in one line before anything heavy starts; the metrics directory exists before
anything imports prometheus_client and before any child is spawned (children inherit
`PROMETHEUS_MULTIPROC_DIR`); the HTTP server accepts traffic only after every child reported ready. A
watchdog thread turns the death of any child into an unhealthy `/health`, failed in-flight requests and a
non-zero exit of the whole tree within a few seconds.

With `--nnodes N`, node 0 runs this launcher as usual (its scheduler is tensor-parallel rank 0 of ranks spread
over N machines) and every other node runs `HeadlessNode`: its ranks only, behind /health and /metrics.

Exit codes: 0 after a signal (in-flight requests drained, see srt/http_server/uvicorn_server.py), 2 for a
configuration error (a bad flag, environment value or model; one line saying what to change), 1 when a
process crashed.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import shutil
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from srt.child_startup import (
    EXIT_CHILD_FAILED,
    EXIT_CONFIG_ERROR,
    ConfigError,
    StartupError,
    StartupFailure,
    one_line,
    run_child,
)
from srt.heap import keep_heap_for_children
from srt.port_args import PortArgs
from srt.process_control import CHILD_STOP_SIGNAL, kill_process_tree, raise_fd_limit
from srt.process_logging import configure_process_logging
from srt.server_args import ServerArgs
from srt.sockets import bind_listener

if TYPE_CHECKING:
    from srt.http_server.middleware import AdmissionGate

logger = logging.getLogger("srt.launch_server")

SCHEDULER_TARGET = ("srt.scheduler.scheduler_process", "run_scheduler_process")
HEADLESS_RANKS_TARGET = ("srt.scheduler.headless_ranks", "run_headless_ranks")
DETOKENIZER_TARGET = ("srt.detokenizer.detokenizer_manager", "run_detokenizer_process")
# How often the start-up wait and the watchdog look at the children.
POLL_SECONDS = 0.2
# After a child died, the launcher is gone within this many seconds even if the HTTP server hangs.
HARD_EXIT_SECONDS = 8.0


@dataclass
class Child:
    name: str
    process: mp.process.BaseProcess
    ready_reader: multiprocessing.connection.Connection


class Launcher:
    """Owns the child processes and the HTTP server of one srt instance."""

    role = "srt server"

    def __init__(self, server_args: ServerArgs, listener=None):
        self.args = server_args
        self.listener = listener  # the HTTP socket, bound by main() before anything else started
        self.port_args = PortArgs.create()
        self.children: list[Child] = []
        self.exit_code = 0
        self.server = None
        self.tokenizer_manager = None
        self.dead_reason: str | None = None  # set when a child died: the server is going down
        self.stopping = threading.Event()

    # ---- start-up ----
    def _spawn(self, name: str, target: tuple[str, str], *args, **kwargs) -> Child:
        ctx = mp.get_context("spawn")
        reader, writer = ctx.Pipe(duplex=False)
        proc = ctx.Process(
            target=run_child,
            args=(f"srt-{name}", *target, *args, writer),
            kwargs=kwargs,
            name=f"srt-{name}",
        )
        proc.start()
        writer.close()  # only the child holds the write end: EOF on the reader means the child is gone
        child = Child(name, proc, reader)
        self.children.append(child)
        return child

    def _wait_ready(self, child: Child):
        """Block until `child` reports ready; raise StartupError with its message if it fails instead."""
        while True:
            if child.ready_reader.poll(POLL_SECONDS):
                try:
                    msg = child.ready_reader.recv()
                except EOFError:
                    child.process.join(POLL_SECONDS)
                    raise StartupError(
                        f"{child.name} process exited during start-up (exit code {child.process.exitcode})"
                    ) from None
                if isinstance(msg, StartupFailure):
                    raise StartupError(f"{child.name}: {msg.message}", msg.config_error, msg.detail)
                return msg
            if not child.process.is_alive():
                raise StartupError(
                    f"{child.name} process exited during start-up (exit code {child.process.exitcode})"
                )

    def _start_children(self, model_dir: str):
        a, p = self.args, self.port_args
        logger.info("IPC directory: %s", p.ipc_dir)
        schedulers = [
            self._spawn(
                "scheduler" if a.dp_size == 1 else f"scheduler{rank}",
                SCHEDULER_TARGET,
                a,
                p,
                model_dir,
                dp_rank=rank,
            )
            for rank in range(a.dp_size)
        ]
        detokenizer = self._spawn("detokenizer", DETOKENIZER_TARGET, a, p, model_dir)
        from srt.constrained.judge import READY_WAIT_SECONDS
        from srt.http_server.tokenizer_manager import TokenizerManager

        # Loading the tokenizer here overlaps with the children's start-up.
        try:
            self.tokenizer_manager = TokenizerManager(a, p, model_dir)
        except Exception as e:
            where = a.tokenizer_path or model_dir
            raise StartupError(
                f"cannot load the tokenizer from {where} ({one_line(str(e))[:300]}): check --tokenizer-path "
                "or --model-path",
                config_error=True,
            ) from e
        self.tokenizer_manager.judge.start()  # built while the scheduler starts, not beside the first requests
        ready = [self._wait_ready(s) for s in schedulers][0]  # every replica has the same limits
        self._wait_ready(detokenizer)
        logger.info(
            "scheduler ready: KV capacity %d tokens, max input %d tokens, context %d, attention %s",
            ready.max_total_num_tokens,
            ready.max_req_input_len,
            ready.context_len,
            ready.attention_backend,
        )
        self.tokenizer_manager.set_ready(ready)
        judge = self.tokenizer_manager.judge
        judge.start()
        if not judge.wait_started(READY_WAIT_SECONDS):
            logger.warning("the grammar judge is still starting: constrained requests wait for it")

    def run(self) -> int:
        try:
            return self._run()
        except StartupError as e:
            if e.detail:
                logger.debug("start-up failure in detail:\n%s", e.detail)
            logger.error("start-up failed: %s", e)
            return EXIT_CONFIG_ERROR if e.config_error else EXIT_CHILD_FAILED
        finally:
            self.shutdown()

    def _model_dir(self) -> str:
        from srt.gguf_metadata import check_gguf
        from srt.model_source import is_gguf_file, resolve_model_path

        try:
            path = resolve_model_path(self.args.model_path)
            if is_gguf_file(path):
                check_gguf(path)  # a broken file fails here, before any child starts
            return path
        except (OSError, RuntimeError, ValueError) as e:  # ValueError: the file's own (GGUFError)
            raise StartupError(
                f"cannot load model {self.args.model_path or '(embedded)'}: {one_line(str(e))}",
                config_error=self.args.model_path is not None,  # the embedded model failing is a bug
            ) from e

    def _run(self) -> int:
        model = self._model_dir()
        from srt.model_executor.layers.cpu_kernel_build import build_in_background

        build_in_background(self.args.device, self.args.quantization_or_default)
        self._start_children(model)

        from srt.http_server.app import create_app
        from srt.http_server.uvicorn_server import make_server

        if self.args.metrics_enabled:
            from srt.metrics.collector import start_process_metrics

            start_process_metrics("tokenizer", {"model_name": self.args.model_name})
        app = create_app(self.tokenizer_manager, self.args)
        gate = app.state.admission
        self.server = make_server(
            app, self.args, lambda: self._begin_drain(gate), lambda: self._end_drain(gate)
        )
        return self._serve()

    def _serve(self) -> int:
        """Run the HTTP server (made by `_run`) under the watchdog until a signal or a child's death."""
        threading.Thread(target=self._watchdog, name="watchdog", daemon=True).start()
        self.server.run(sockets=[self.listener] if self.listener is not None else None)
        return self.exit_code

    def _begin_drain(self, gate: AdmissionGate) -> None:
        """SIGTERM/SIGINT (or a dead child): admit nothing new; what is in flight may finish."""
        gate.close("the server is shutting down")
        if gate.in_flight:
            logger.info(
                "shutting down: %d request(s) in flight get up to %g s to finish",
                gate.in_flight,
                self.args.graceful_shutdown_timeout,
            )

    def _end_drain(self, gate: AdmissionGate) -> None:
        """The drain time is up: end every request still running with a clean error."""
        if gate.in_flight:
            logger.info("failing %d request(s) still running after the drain", gate.in_flight)
        self.tokenizer_manager.fail_all(
            "the server is shutting down: the request did not finish within "
            f"--graceful-shutdown-timeout ({self.args.graceful_shutdown_timeout:g} s)"
        )

    # ---- faults ----
    def _watchdog(self) -> None:
        """Announce the server once it listens; on any child's death fail everything and exit."""
        announced = False
        by_sentinel = {c.process.sentinel: c for c in self.children}
        while not self.stopping.is_set():
            dead = multiprocessing.connection.wait(list(by_sentinel), timeout=POLL_SECONDS)
            if not announced and self.server is not None and self.server.started:
                announced = True
                logger.info(
                    "%s listening at %s, serving model %s", self.role, self.args.url, self.args.model_name
                )
            if dead and not self.stopping.is_set():
                self._on_child_death(by_sentinel[dead[0]])
                return

    def _on_child_death(self, child: Child) -> None:
        child.process.join(POLL_SECONDS)
        if self.args.metrics_enabled:
            from srt.metrics.multiprocess import mark_process_dead

            mark_process_dead(child.process.pid)  # its live gauges leave /metrics at once
        reason = (
            f"{child.name} process (pid {child.process.pid}) died with exit code {child.process.exitcode}"
        )
        logger.error("%s; shutting down", reason)
        self.exit_code = EXIT_CHILD_FAILED
        self.dead_reason = reason
        tm = self.tokenizer_manager
        loop = getattr(tm, "loop", None)
        if loop is not None and loop.is_running():
            loop.call_soon_threadsafe(tm.fail_all, reason)
        elif tm is not None:
            tm.dead_reason = reason
        if self.server is not None:
            self.server.should_exit = True
        # Should the HTTP server not stop in time, the launcher still must not outlive its child.
        deadline = time.monotonic() + HARD_EXIT_SECONDS
        while time.monotonic() < deadline:
            if self.stopping.is_set():
                return
            time.sleep(POLL_SECONDS)
        logger.error("HTTP server did not stop in %.0f s; exiting hard", HARD_EXIT_SECONDS)
        self.shutdown()
        os._exit(EXIT_CHILD_FAILED)

    # ---- shutdown ----
    def shutdown(self) -> None:
        """Stop every child (CHILD_STOP_SIGNAL, then SIGKILL), drop their live gauges, remove the temp dirs."""
        if self.stopping.is_set():
            return
        self.stopping.set()
        if threading.current_thread() is threading.main_thread():
            # A second Ctrl-C must not interrupt the clean-up half way.
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        for child in self.children:
            if child.process.pid is not None:
                kill_process_tree(child.process.pid, sig=CHILD_STOP_SIGNAL)
                child.process.join(POLL_SECONDS)
        if self.tokenizer_manager is not None:
            self.tokenizer_manager.judge.close()  # spawned at start-up, before the app's lifespan owns it
        if self.args.metrics_enabled:
            from srt.metrics.multiprocess import cleanup_multiprocess_dir, mark_process_dead

            for child in self.children:
                if child.process.pid is not None:
                    mark_process_dead(child.process.pid)
            cleanup_multiprocess_dir()
        shutil.rmtree(self.port_args.ipc_dir, ignore_errors=True)
        if self.listener is not None:
            self.listener.close()
        logger.info("shut down")


class HeadlessNode(Launcher):
    """Node R > 0 of a multi-node server: one child per data-parallel replica, this node's first
    tensor-parallel rank of it (which starts the node's other ranks of the replica), and an HTTP server with /health (200 once the ranks joined, 503 after one died) and
    /metrics (this node's processes), so one Prometheus job scrapes every node. No tokenizer, no API: requests
    go to node 0. When node 0's group goes away the ranks exit, and so does this launcher (exit code 1)."""

    role = "headless node"

    def _run(self) -> int:
        a = self.args
        logger.info(
            "node %d of %d: tensor-parallel ranks %s of %d, rank 0 at %s",
            a.node_rank,
            a.nnodes,
            ", ".join(map(str, a.node_tp_ranks)),
            a.tp_size,
            a.dist_init_addr,
        )
        model_dir = self._model_dir()
        replicas = [
            self._spawn(
                replica_name(a.node_rank, d, a.dp_size), HEADLESS_RANKS_TARGET, a, model_dir, dp_rank=d
            )
            for d in range(a.dp_size)
        ]
        for ranks in replicas:
            self._wait_ready(ranks)
        from srt.http_server.uvicorn_server import make_server

        self.server = make_server(self._app(), a, lambda: None, lambda: None)
        return self._serve()

    def _app(self):
        from starlette.applications import Starlette
        from starlette.responses import JSONResponse
        from starlette.routing import Route

        node = {"node_rank": self.args.node_rank, "tp_ranks": list(self.args.node_tp_ranks)}

        async def health(request):
            if self.dead_reason is not None:
                return JSONResponse({"status": "unhealthy", "reason": self.dead_reason, **node}, 503)
            return JSONResponse({"status": "ok", **node})

        routes = [Route("/health", health)]
        if self.args.metrics_enabled:
            from srt.metrics.collector import make_metrics_asgi_app

            routes.append(Route("/metrics", make_metrics_asgi_app()))
        return Starlette(routes=routes)


def replica_name(node_rank: int, dp_rank: int, dp_size: int) -> str:
    """A headless node's child for one replica: `node1`, or `node1-dp0` with data parallelism."""
    return f"node{node_rank}" if dp_size == 1 else f"node{node_rank}-dp{dp_rank}"


def _exit_on_signal(signum, frame) -> None:
    """Before uvicorn runs (and after it re-raises the signal it caught), SIGTERM/SIGINT mean: unwind
    through the launcher's `finally`, which stops the children and removes the temp dirs."""
    raise SystemExit(0)


def main(argv: list[str] | None = None) -> int:
    server_args = ServerArgs.parse(argv)  # a bad flag: argparse's one error line, exit 2
    configure_process_logging(server_args.log_level, "main")
    try:
        listener = bind_listener(server_args.host, server_args.port)
        if server_args.export_metrics_to_file:
            from srt.metrics.request_export import check_export_dir

            check_export_dir(server_args.export_metrics_to_file_dir)
        if server_args.metrics_enabled:
            from srt.metrics.multiprocess import setup_multiprocess_dir

            setup_multiprocess_dir()
    except ConfigError as e:
        logger.error("start-up failed: %s", e)
        return EXIT_CONFIG_ERROR
    before, after = raise_fd_limit()
    if after != before:
        logger.info("open-files limit raised from %d to %d", before, after)
    keep_heap_for_children()
    signal.signal(signal.SIGTERM, _exit_on_signal)
    signal.signal(signal.SIGINT, _exit_on_signal)
    return (HeadlessNode if server_args.headless else Launcher)(server_args, listener).run()


if __name__ == "__main__":
    sys.exit(main())
