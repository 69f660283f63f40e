"""Prometheus metrics of one server, in a registry of its own (several apps can live in one process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "gptj_requests", "HTTP requests answered, by endpoint and status code", ["endpoint", "status"], registry=r
        )
        self.request_latency = Histogram(
            "gptj_request_latency_seconds",
            "Time from request to complete response, completion endpoints",
            ["endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_depth = Gauge("gptj_queue_depth", "Prompts waiting for the batch worker", registry=r)
        self.queue_wait = Histogram(
            "gptj_queue_wait_seconds",
            "Time a request waited before its batch started",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.batch_size = Histogram(
            "gptj_batch_size", "Prompts per batched generate call", buckets=BATCH_BUCKETS, registry=r
        )
        self.batch_latency = Histogram(
            "gptj_batch_seconds", "Duration of one batched generate call", buckets=LATENCY_BUCKETS, registry=r
        )
        # Streamed completions are not counted: LanguageModel.stream reports text, not tokens.
        self.generated_tokens = Counter(
            "gptj_generated_tokens", "Tokens generated for non-streamed completions", registry=r
        )
        self.tokens_per_second = Gauge(
            "gptj_tokens_per_second", "Generated tokens per second in the last non-streamed batch", registry=r
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
