"""Prometheus metrics of one server, in a registry of its own (several apps can live in one process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)


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
        self.queue_depth = Gauge("gptj_queue_depth", "Prompts waiting for a decode slot", registry=r)
        self.queue_wait = Histogram(
            "gptj_queue_wait_seconds",
            "Time a prompt waited for a decode slot",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.time_to_first_token = Histogram(
            "gptj_time_to_first_token_seconds",
            "Time from a prompt's arrival to its first generated token",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.inter_token_latency = Histogram(
            "gptj_inter_token_latency_seconds",
            "Time between a prompt's successive generated tokens",
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.slots = Gauge("gptj_slots", "Decode slots: the most prompts generated together", registry=r)
        self.busy_slots = Gauge("gptj_busy_slots", "Decode slots holding a prompt now", registry=r)
        self.kv_pages = Gauge("gptj_kv_pages", "Pages of the decode slots' KV cache", registry=r)
        self.kv_pages_used = Gauge("gptj_kv_pages_used", "KV cache pages that sequences hold now", registry=r)
        self.decode_steps = Counter("gptj_decode_steps", "Decode steps run", registry=r)
        # busy / all slot-steps over an interval is the mean occupancy over it
        self.slot_steps = Counter("gptj_slot_steps", "Decode steps run, times the number of slots", registry=r)
        self.busy_slot_steps = Counter(
            "gptj_busy_slot_steps", "Decode steps run, times the slots that generated a token in them", registry=r
        )
        self.generated_tokens = Counter("gptj_generated_tokens", "Tokens generated, streamed or not", registry=r)
        self.prompt_tokens = Counter(
            "gptj_prompt_tokens",
            "Prompt tokens admitted to decode slots, and the inputs of scored prompts (all tokens but the last)",
            registry=r,
        )
        self.prefilled_tokens = Counter(
            "gptj_prompt_tokens_prefilled",
            "Prompt tokens run through the model to prefill them (the others came from the prefix cache)",
            registry=r,
        )
        self.prefix_cache_hit_rate = Gauge(
            "gptj_prefix_cache_hit_rate",
            "Prompt tokens served from the prefix cache, as a share of the prompt tokens admitted so far",
            registry=r,
        )
        self.prefix_cache_pages = Gauge(
            "gptj_prefix_cache_pages", "KV cache pages that the prefix cache holds (in use or idle)", registry=r
        )
        self.scoring_cache_pages = Gauge(
            "gptj_scoring_cache_pages",
            "Pages of scored prompts (keys, values and scores) that the scoring prefix cache holds in host memory",
            registry=r,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
