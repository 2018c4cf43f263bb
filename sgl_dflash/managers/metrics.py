"""Prometheus metrics under SGLang's names (`sglang:*`), served at GET /metrics.

Each server gets its own registry, so several servers can live in one process (tests).
Scheduler gauges are read from the scheduler's latest stats at scrape time; request counters
and latency histograms are updated when a request finishes.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.05, 0.1, 0.2, 0.4, 0.8, 1.0, 2.0, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0)


class ServerMetrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        self.labels = {"model_name": model_name}
        names = list(self.labels)
        reg = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, names, registry=reg)

        self.num_running_reqs = gauge("sglang:num_running_reqs", "The number of running requests.")
        self.num_queue_reqs = gauge("sglang:num_queue_reqs", "The number of requests in the waiting queue.")
        self.token_usage = gauge("sglang:token_usage", "Fraction of KV cache pages in use.")
        self.num_used_tokens = gauge("sglang:num_used_tokens", "KV cache slots in use (whole pages).")
        self.max_total_num_tokens = gauge("sglang:max_total_num_tokens", "KV cache capacity in tokens.")
        self.spec_accept_length = gauge(
            "sglang:spec_accept_length",
            "Average speculative accept length (tokens per verify step, bonus included) "
            "over finished requests.",
        )
        self.spec_accept_rate = gauge(
            "sglang:spec_accept_rate", "Accepted drafts / proposed drafts over finished requests."
        )
        self.spec_mean_verify_len = gauge(
            "sglang:spec_mean_verify_len",
            "Average drafts sent to verification per decode step over finished requests "
            "(the block size - 1 unless --speculative-adaptive chooses per step).",
        )
        self.spec_no_spec_fraction = gauge(
            "sglang:spec_no_spec_fraction",
            "Fraction of decode steps that verified no draft (plain decode steps chosen by "
            "--speculative-adaptive) over finished requests.",
        )
        self.num_retracted_reqs = gauge(
            "sglang:num_retracted_reqs", "Retractions so far (requests preempted for KV pages)."
        )

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, names + list(extra), registry=reg)

        self.prompt_tokens = counter("sglang:prompt_tokens", "Prompt tokens of finished requests.", ("is_streaming",))
        self.generation_tokens = counter(
            "sglang:generation_tokens", "Generated tokens of finished requests.", ("is_streaming",)
        )
        self.num_requests = counter("sglang:num_requests", "Requests finished.", ("is_streaming",))
        self._aborted = counter("sglang:num_aborted_requests", "Requests aborted (client gone or error).")
        self.num_aborted_requests = self._aborted.labels(**self.labels)

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, names + ["is_streaming"], buckets=LATENCY_BUCKETS, registry=reg)

        self.e2e_request_latency = histogram(
            "sglang:e2e_request_latency_seconds", "End-to-end request latency in seconds."
        )
        self.time_to_first_token = histogram(
            "sglang:time_to_first_token_seconds", "Time to first token in seconds."
        )

    def on_request_finished(
        self,
        *,
        prompt_tokens: int,
        completion_tokens: int,
        e2e_latency: float,
        ttft: float,
        is_stream: bool,
        aborted: bool,
    ) -> None:
        labels = {**self.labels, "is_streaming": str(bool(is_stream)).lower()}
        if aborted:
            self.num_aborted_requests.inc()
        self.num_requests.labels(**labels).inc()
        self.prompt_tokens.labels(**labels).inc(prompt_tokens)
        self.generation_tokens.labels(**labels).inc(completion_tokens)
        self.e2e_request_latency.labels(**labels).observe(e2e_latency)
        if completion_tokens:
            self.time_to_first_token.labels(**labels).observe(ttft)

    def update_scheduler_gauges(self, stats: dict[str, Any], page_size: int) -> None:
        lab = self.labels
        self.num_running_reqs.labels(**lab).set(stats.get("num_running", 0))
        self.num_queue_reqs.labels(**lab).set(stats.get("num_waiting", 0))
        total = stats.get("total_pages", 0)
        free = stats.get("num_free_pages", 0)
        self.token_usage.labels(**lab).set(stats.get("token_usage", 0.0))
        self.num_used_tokens.labels(**lab).set((total - free) * page_size)
        self.max_total_num_tokens.labels(**lab).set(total * page_size)
        self.num_retracted_reqs.labels(**lab).set(stats.get("num_retractions", 0))
        accept_length = stats.get("avg_spec_accept_length")
        accept_rate = stats.get("spec_accept_rate")
        self.spec_accept_length.labels(**lab).set(accept_length if accept_length is not None else 0.0)
        self.spec_accept_rate.labels(**lab).set(accept_rate if accept_rate is not None else 0.0)
        for gauge, key in ((self.spec_mean_verify_len, "spec_mean_verify_len"),
                           (self.spec_no_spec_fraction, "spec_no_spec_fraction")):
            value = stats.get(key)
            gauge.labels(**lab).set(value if value is not None else 0.0)

    def render(self) -> bytes:
        return generate_latest(self.registry)
