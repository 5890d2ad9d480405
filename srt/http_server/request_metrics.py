"""Request-level metrics in the TokenizerManager: turns what arrives for each request (main-process receive
times, the scheduler's step stamps) into TTFT, inter-token latencies and the finished-request record
(docs/metrics.md, "Per-request intervals").

The finished-request record (FinishedRequestStats) is built once per request, at finish, whether metrics are
on or not; the histograms observe it, the response's timings read it (it travels on the final ReqOutput), and
the request export writes it — three views of one record. With metrics off only the record is kept."""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING

from srt.http_server.openai.chat_reasoning import ReasoningReading, ReasoningTracker
from srt.io_struct import BatchStrOut, FinishReason
from srt.metrics.custom_labels import CustomLabelPolicy, parse_allowed_custom_labels
from srt.metrics.request_stats import FinishedRequestStats, inter_token_latencies
from srt.sampling.sampling_params import SamplingParams
from srt.server_args import ServerArgs
from srt.speculative.defaults import most_drafts_per_step

if TYPE_CHECKING:
    from srt.http_server.req_state import ReqState

logger = logging.getLogger(__name__)

_SCALAR = (int, float, bool, str, type(None))


def exported_params(params: SamplingParams) -> dict:
    """The scalar sampling parameters (lists, schemas and biases are left out: they can be large)."""
    return {k: v for k, v in dataclasses.asdict(params).items() if isinstance(v, _SCALAR)}


class RequestMetricsRecorder:
    def __init__(self, server_args: ServerArgs, context_len: int, reasoning: ReasoningReading | None = None):
        """`reasoning`: how a --reasoning-parser server reads its outputs (None: no parser)."""
        self.reasoning = reasoning
        self.collector = None
        self.exporter = None
        self.labels: CustomLabelPolicy = parse_allowed_custom_labels(
            server_args.tokenizer_metrics_allowed_custom_labels
        )
        self.labels_header = server_args.tokenizer_metrics_custom_labels_header.lower()
        metric_labels = {"model_name": server_args.model_name}
        if server_args.metrics_enabled:
            from srt.metrics.collector import TokenizerMetricsCollector

            self.collector = TokenizerMetricsCollector(
                metric_labels,
                context_len,
                server_args.bucket_time_to_first_token,
                server_args.bucket_inter_token_latency,
                server_args.bucket_e2e_request_latency,
                custom_label_names=self.labels.names,
            )
        if server_args.export_metrics_to_file:
            from srt.metrics.request_export import RequestExporter

            self.exporter = RequestExporter(
                server_args.export_metrics_to_file_dir,
                metric_labels if server_args.metrics_enabled else None,
            )
        # the speculative decoding counters, moved by each request's final figures: from the start with
        # --speculative-algorithm, else from the first request that ran a verify step (a `prediction`)
        self.spec_collector = None
        self._spec_labels = metric_labels if server_args.metrics_enabled else None
        self._spec_max_drafts = most_drafts_per_step(server_args.speculative_drafts_per_step)
        if server_args.metrics_enabled and server_args.speculative_algorithm:
            self._start_spec_counters()

    def _start_spec_counters(self) -> None:
        from srt.metrics.spec_collector import SpecRequestMetricsCollector

        self.spec_collector = SpecRequestMetricsCollector(self._spec_labels, self._spec_max_drafts)

    def custom_labels(self, headers) -> tuple[str, ...]:
        """The request's custom label values from its headers (a Starlette Headers or a dict); () if none
        are configured."""
        if not self.labels.allowed:
            return ()
        return self.labels.resolve(headers.get(self.labels_header) if headers is not None else None)

    def on_tokens(self, st: ReqState, token_ts: list[float], has_tokens: bool, now: float) -> None:
        """TTFT when the first token arrives (streamed or not); one ITL per token after the first."""
        stamps = st.stamps
        if has_tokens and stamps.first_token_recv_ts is None:
            stamps.first_token_recv_ts = now
            if self.collector is not None:
                self.collector.observe_time_to_first_token(now - st.arrival_ts, st.labels)
        if token_ts:
            if self.collector is not None:
                itl = inter_token_latencies(stamps.last_token_ts, token_ts)
                if itl:
                    self.collector.observe_inter_token_latencies(itl, st.labels)
            stamps.last_token_ts = token_ts[-1]

    def on_text(self, st: ReqState, text: str, ids: list[int], now: float) -> None:
        """A request whose output is read for reasoning (GenerateInput.thinking) feeds its tracker."""
        if self.reasoning is None or st.thinking is None:
            return
        if st.stamps.reasoning is None:
            st.stamps.reasoning = ReasoningTracker(self.reasoning, st.thinking)
        st.stamps.reasoning.feed(text, ids, now)

    def finished_stats(
        self, st: ReqState, b: BatchStrOut, i: int, reason: FinishReason, now: float
    ) -> FinishedRequestStats:
        """The request's finished record, from the same stamps the histograms observe."""
        labels = dict(zip(self.labels.names, st.labels, strict=True)) if st.labels else None
        tracker = st.stamps.reasoning
        reasoning_tokens = tracker.finish(now) if tracker is not None else None
        return FinishedRequestStats(
            prompt_tokens=b.prompt_tokens[i],
            generation_tokens=b.completion_tokens[i],
            cached_tokens=b.cached_tokens[i],
            finished_reason=reason.type,
            arrival_ts=st.arrival_ts,
            first_token_recv_ts=st.stamps.first_token_recv_ts,
            finish_recv_ts=now,
            queued_ts=b.queued_ts[i] or None,
            scheduled_ts=b.scheduled_ts[i] or None,
            first_token_ts=b.first_token_ts[i] or None,
            last_token_ts=st.stamps.last_token_ts,
            num_retractions=b.num_retractions[i],
            max_tokens_param=st.max_new_tokens,
            n_param=st.n,
            wall_offset=time.time() - time.monotonic(),
            rid=st.rid,
            params=exported_params(st.params) if self.exporter is not None and st.params else None,
            labels=labels,
            spec=b.spec_stats[i] if b.spec_stats is not None else None,
            lora_name=st.lora_name,
            reasoning_tokens=reasoning_tokens,
            first_answer_recv_ts=tracker.first_answer_ts if tracker is not None else None,
        )

    def on_finish(self, st: ReqState, stats: FinishedRequestStats) -> None:
        if self.collector is not None:
            if stats.finished_reason == "abort":
                self.collector.inc_aborted_requests(st.labels)
            # usage's rule: a prompt and its cache hit count once, with its first sample (index p * n)
            self.collector.observe_finished_request(
                stats, counts_prompt=st.index % st.n == 0, custom=st.labels
            )
            if stats.spec is not None:
                if self.spec_collector is None:
                    self._start_spec_counters()
                self.spec_collector.on_request(stats.spec)
        if st.abandoned and st.export:
            self.export(stats)  # no response will carry it

    def handed_over(self, stats: FinishedRequestStats | None, export: bool) -> None:
        """The final output reached the HTTP response: stamp it, and export the request."""
        if stats is None or stats.response_sent_ts is not None:
            return
        stats.response_sent_ts = time.time()
        if export:
            self.export(stats)

    def export(self, stats: FinishedRequestStats) -> None:
        if self.exporter is not None:
            self.exporter.submit(stats.export_record())

    def close(self) -> None:
        if self.exporter is not None:
            self.exporter.close()
