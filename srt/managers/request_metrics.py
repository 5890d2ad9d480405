"""Request-level metrics in the TokenizerManager: turns what arrives for each request (main-process receive
times, the scheduler's step stamps) into TTFT, inter-token latencies and the finished-request record
(METRICS.md "Events"). With metrics off it only keeps the stamps."""

from __future__ import annotations

from typing import TYPE_CHECKING

from srt.managers.io_struct import BatchStrOut, FinishReason
from srt.server_args import ServerArgs

if TYPE_CHECKING:
    from srt.managers.tokenizer_manager import ReqState


class RequestMetricsRecorder:
    def __init__(self, server_args: ServerArgs, context_len: int):
        self.collector = None
        if server_args.metrics_enabled:
            from srt.metrics.collector import TokenizerMetricsCollector

            self.collector = TokenizerMetricsCollector(
                {"model_name": server_args.model_name},
                context_len,
                server_args.bucket_time_to_first_token,
                server_args.bucket_inter_token_latency,
                server_args.bucket_e2e_request_latency,
            )

    def on_tokens(self, st: ReqState, token_ts: list[float], has_tokens: bool, now: float) -> None:
        """TTFT when the first token arrives (streamed or not); one ITL per token after the first."""
        if has_tokens and st.first_token_recv_ts is None:
            st.first_token_recv_ts = now
            if self.collector is not None:
                self.collector.observe_time_to_first_token(now - st.arrival_ts)
        if token_ts:
            if self.collector is not None:
                from srt.metrics.request_stats import inter_token_latencies

                itl = inter_token_latencies(st.last_token_ts, token_ts)
                if itl:
                    self.collector.observe_inter_token_latencies(itl)
            st.last_token_ts = token_ts[-1]

    def on_finish(self, st: ReqState, b: BatchStrOut, i: int, reason: FinishReason, now: float) -> None:
        if self.collector is None:
            return
        from srt.metrics.request_stats import FinishedRequestStats

        if reason.type == "abort":
            self.collector.inc_aborted_requests()
        self.collector.observe_finished_request(
            FinishedRequestStats(
                prompt_tokens=b.prompt_tokens[i],
                generation_tokens=b.completion_tokens[i],
                cached_tokens=b.cached_tokens[i],
                finished_reason=reason.type,
                arrival_ts=st.arrival_ts,
                first_token_recv_ts=st.first_token_recv_ts,
                finish_recv_ts=now,
                queued_ts=b.queued_ts[i] or None,
                scheduled_ts=b.scheduled_ts[i] or None,
                first_token_ts=b.first_token_ts[i] or None,
                last_token_ts=st.last_token_ts,
                num_retractions=b.num_retractions[i],
                max_tokens_param=st.max_new_tokens,
                n_param=st.n,
            ),
            # usage's rule: a prompt and its cache hit count once, with its first sample (index p * n)
            counts_prompt=st.index % st.n == 0,
        )
