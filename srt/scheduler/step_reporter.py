"""The scheduler's reporter: the Prefill/Decode log lines, the periodic summary and the system metrics.

Per step it only adds numbers (the collector accumulates plain ints); it formats a line after each prefill
batch and every `--decode-log-interval` decode steps, and pushes to prometheus at those moments, at most
every `FLUSH_PERIOD` seconds otherwise, and when the scheduler goes idle (so idle gauges read 0 at once).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from srt.metrics import stat_logger
from srt.scheduler.step_hooks import SchedulerLoad, StepReporter
from srt.server_args import ServerArgs
from srt.speculative.defaults import most_drafts_per_step

if TYPE_CHECKING:
    from srt.model_executor.model_runner import ModelRunner
    from srt.speculative.stats import SpecStepStats

logger = logging.getLogger("srt.scheduler")

# Longest a scrape may see counters lag behind the scheduler while it is busy.
FLUSH_PERIOD = 1.0


class SchedulerReporter(StepReporter):
    def __init__(
        self,
        args: ServerArgs,
        capacity: int,
        collector=None,
        residency_observer=None,
        spec_metrics_factory: Callable[[int], Any] | None = None,
    ):
        self.args = args
        self.capacity = capacity
        self.collector = collector
        self.residency_observer = residency_observer
        self.summary = stat_logger.StatsSummaryLogger(args.log_stats_interval)
        # srt/metrics/spec_collector.py (with metrics on) and the SpecDecoding log line: from the start with
        # --speculative-algorithm, else from the first verify step (a request's prediction)
        self._spec_metrics_factory = spec_metrics_factory
        self.lora_state = None  # srt/metrics/lora_state.py's writer, with multi-LoRA and metrics on
        self.load_writer = (
            None  # srt/metrics/load_snapshot.py's writer: the load gateways read, metrics or not
        )
        self.spec_metrics = None
        self.spec_log: stat_logger.SpecDecodingLogger | None = None
        if args.speculative_algorithm:
            self._start_speculation()
        self.decode_steps = 0
        self.throughput_meter = stat_logger.GenThroughputMeter()
        self.gen_throughput = 0.0
        self.last_hit_rate = 0.0
        self.last_flush = time.monotonic()

    # ---- per step ----
    def on_prefill(
        self,
        load: SchedulerLoad,
        *,
        new_seqs,
        new_tokens,
        cached_tokens,
        prefix_queries,
        prefix_hits,
        decode_tokens,
        forward_seconds,
    ) -> None:
        """A prefill step, or a mixed one (`decode_tokens` > 0): its Prefill line, and for the decoded tokens
        what a decode step counts (throughput, the Decode line's cadence)."""
        if prefix_queries:
            self.last_hit_rate = prefix_hits / prefix_queries
        if self.collector is not None:
            self.collector.on_prefill_batch(
                new_seqs,
                new_tokens,
                cached_tokens,
                prefix_queries,
                prefix_hits,
                forward_seconds,
                decode_tokens,
            )
        self.summary.on_prefill(new_tokens, prefix_queries, prefix_hits, num_requests=new_seqs)
        logger.info(
            stat_logger.format_prefill_line(
                new_seq=new_seqs,
                new_token=new_tokens,
                cached_token=cached_tokens,
                token_usage=load.used_tokens / self.capacity,
                running_req=load.running,
                queue_req=load.waiting,
            )
        )
        if decode_tokens:
            self._decoded(load, decode_tokens)
        self.flush(load)

    def on_decode(self, load: SchedulerLoad, *, num_tokens, forward_seconds) -> None:
        if self.collector is not None:
            self.collector.on_decode_batch(num_tokens, forward_seconds)
        if self._decoded(load, num_tokens):
            self.flush(load)

    def _decoded(self, load: SchedulerLoad, num_tokens: int) -> bool:
        """Count a step's decoded tokens; True when the step writes the Decode line."""
        self.summary.on_decode(num_tokens)
        self.decode_steps += 1
        self.throughput_meter.add(num_tokens)
        if self.decode_steps % self.args.decode_log_interval:
            return False
        self.gen_throughput = self.throughput_meter.take()
        logger.info(
            stat_logger.format_decode_line(
                running_req=load.running,
                token=load.used_tokens,
                token_usage=load.used_tokens / self.capacity,
                gen_throughput=self.gen_throughput,
                queue_req=load.waiting,
            )
        )
        return True

    def _start_speculation(self) -> None:
        most = most_drafts_per_step(self.args.speculative_drafts_per_step)
        self.spec_log = stat_logger.SpecDecodingLogger(self.args.log_stats_interval, most)
        if self._spec_metrics_factory is not None:
            self.spec_metrics = self._spec_metrics_factory(most)

    def on_verify(self, step: SpecStepStats) -> None:
        if self.spec_log is None:
            self._start_speculation()
        if self.spec_metrics is not None:
            self.spec_metrics.on_verify(step)
        self.spec_log.add(step.num_drafts, step.num_draft_tokens, step.accepted_per_position)

    def on_draft_budget(self, drafts_per_request: int) -> None:
        if self.spec_metrics is not None:
            self.spec_metrics.draft_budget = drafts_per_request

    def on_retraction(self, n: int) -> None:
        if self.collector is not None:
            self.collector.on_retraction(n)

    def on_finished(self, prompt_tokens: int, output_tokens: int, cached_tokens: int) -> None:
        if self.collector is not None:
            self.collector.on_finished_request(prompt_tokens, output_tokens, cached_tokens)

    def on_idle(self, load: SchedulerLoad) -> None:
        self.gen_throughput = 0.0
        self.throughput_meter.take()
        self.flush(load)

    def on_tick(self, load: SchedulerLoad) -> None:
        now = time.monotonic()
        if now - self.last_flush >= FLUSH_PERIOD and not load.idle:
            self.flush(load)
        line = self.summary.maybe_log(
            now,
            running=load.running,
            waiting=load.waiting,
            kv_usage=load.used_tokens / self.capacity,
        )
        if line:
            logger.info(line)
        if self.spec_log is not None:
            spec_line = self.spec_log.maybe_line(now)
            if spec_line:
                logger.info(spec_line)

    # ---- prometheus ----
    def flush(self, load: SchedulerLoad) -> None:
        self.last_flush = time.monotonic()
        if self.spec_metrics is not None:
            self.spec_metrics.flush()
        if self.load_writer is not None:
            self.load_writer.write(
                running=load.running_with_chunked,
                waiting=load.waiting,
                used_tokens=load.used_tokens,
                capacity=self.capacity,
                gen_throughput=self.gen_throughput,
                cache_hit_rate=self.last_hit_rate,
            )
        if self.lora_state is not None and load.lora is not None:
            lora = load.lora
            self.lora_state.write(lora.running, lora.waiting, lora.slots_used, lora.slots_total, lora.loaded)
        if self.collector is None:
            return
        from srt.metrics.scheduler_collector import SchedulerStats

        self.collector.flush(
            SchedulerStats(
                num_running_reqs=load.running_with_chunked,
                num_queue_reqs=load.waiting,
                num_used_tokens=load.used_tokens,
                token_usage=load.used_tokens / self.capacity,
                gen_throughput=self.gen_throughput,
                cache_hit_rate=self.last_hit_rate,
                new_token_ratio=load.new_token_ratio,
                kv_headroom_tokens=load.headroom_tokens,
            )
        )


def build_reporter(
    args: ServerArgs, runner: ModelRunner, dp_rank: int, startup_seconds: float, load_dir: str | None = None
) -> SchedulerReporter:
    """`load_dir`: where the scheduler keeps its load record (the IPC directory)."""
    collector = observer = grammar_metrics = spec_metrics_factory = None
    if args.metrics_enabled:
        from srt.metrics.collector import SchedulerMetricsCollector, start_process_metrics
        from srt.metrics.scheduler_collector import make_cache_config

        labels = {"model_name": args.model_name, "tp_rank": "0"}
        if args.dp_size > 1:
            labels["dp_rank"] = str(dp_rank)
        cache_config = make_cache_config(
            page_size=1,
            max_total_num_tokens=runner.max_total_num_tokens,
            max_running_requests=runner.max_running_requests,
            chunked_prefill_size=args.chunked_prefill_size,
            prefix_caching=not args.disable_radix_cache,
            kv_cache_dtype=str(runner.kv_cache_dtype).removeprefix("torch."),
            attention_backend=runner.attention_backend_name,
            context_len=runner.context_len,
        )
        collector = SchedulerMetricsCollector(
            labels, cache_config, runner.max_total_num_tokens, context_len=runner.context_len
        )
        collector.set_startup_times(startup_seconds, runner.load_weights_seconds)
        start_process_metrics("scheduler", labels)
        from srt.metrics.grammar_collector import GrammarMetricsCollector

        grammar_metrics = GrammarMetricsCollector(labels)
        if args.kv_cache_metrics:
            from srt.metrics.kv_residency import KVResidencyObserver

            observer = KVResidencyObserver(labels, args.kv_cache_metrics_sample)
        from srt.metrics.spec_collector import SpecDecodeMetricsCollector

        spec_metrics_factory = functools.partial(SpecDecodeMetricsCollector, labels)
    reporter = SchedulerReporter(args, runner.max_total_num_tokens, collector, observer, spec_metrics_factory)
    reporter.grammar_metrics = grammar_metrics
    if load_dir is not None:
        from srt.metrics.load_snapshot import SchedulerLoadWriter

        reporter.load_writer = SchedulerLoadWriter(load_dir, dp_rank)
        reporter.load_writer.write(running=0, waiting=0, used_tokens=0, capacity=runner.max_total_num_tokens)
    if args.metrics_enabled and runner.lora is not None:
        from srt.metrics.lora_state import LoRAStateWriter
        from srt.metrics.multiprocess import multiprocess_dir

        reporter.lora_state = LoRAStateWriter(
            multiprocess_dir(), labels, runner.lora.config.max_loras_per_batch
        )
    return reporter
