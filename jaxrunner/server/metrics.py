"""Prometheus metrics of the server, in a registry of its own (several servers per process in
tests, no global state)."""

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

PREFIX = "jaxrunner"
# Seconds; fine at the bottom for inter-token latency, long at the top for TTFT under load.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                   2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/generate",
          "/v1/embeddings", "/v1/models", "/health", "/get_server_info", "/metrics")
FINISH_REASONS = ("stop", "length", "abort")


class ServerMetrics:
    """Counters per engine request (one HTTP request with n=2 makes two), HTTP counters per
    route and status, and gauges read from the engine loop's latest snapshot."""

    def __init__(self, stats: Callable[[], dict]):
        self.registry = r = CollectorRegistry()
        self.http_requests = Counter(f"{PREFIX}_http_requests", "HTTP requests by route and status",
                                     ["route", "status"], registry=r)
        self.requests = Counter(f"{PREFIX}_requests", "Engine requests finished, by finish reason",
                                ["finish_reason"], registry=r)
        self.prompt_tokens = Counter(f"{PREFIX}_prompt_tokens", "Prompt tokens of finished "
                                     "requests", registry=r)
        self.generation_tokens = Counter(f"{PREFIX}_generation_tokens", "Tokens generated",
                                         registry=r)
        # Every labelled family has its samples from the start, so a gateway aggregating the
        # replicas' metrics (sglang-router's /engine_metrics) reads the same names from all.
        for reason in FINISH_REASONS:
            self.requests.labels(reason)
        for route in ROUTES:
            self.http_requests.labels(route, "200")
        self.ttft = Histogram(f"{PREFIX}_time_to_first_token_seconds", "Arrival to first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(f"{PREFIX}_inter_token_latency_seconds", "Between two tokens of a "
                             "request", buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram(f"{PREFIX}_e2e_request_latency_seconds", "Arrival to finish",
                             buckets=LATENCY_BUCKETS, registry=r)
        gauges = {
            "num_requests_running": "Requests decoding or prefilling",
            "num_requests_waiting": "Requests queued for admission",
            "kv_cache_usage": "Fraction of KV pages in use",
            "kv_pages_free": "KV pages no request holds (free or evictable prefix cache)",
            "kv_pages_cached": "KV pages in the prefix cache",
            # 0 for a model without a sliding-window pool (mem_cache/swa_memory_pool.py).
            "swa_kv_pages_free": "Sliding-window KV pages no request holds (free or evictable)",
        }
        for name, doc in gauges.items():
            Gauge(f"{PREFIX}_{name}", doc, registry=r).set_function(
                lambda name=name: stats().get(name, 0))
        # Speculative decoding: verify rounds and the tokens they gave, of finished requests.
        self.spec_verify_steps = Counter(f"{PREFIX}_spec_verify_steps", "Speculative verify "
                                         "rounds of finished requests", registry=r)
        self.spec_tokens = Counter(f"{PREFIX}_spec_completion_tokens", "Completion tokens of "
                                   "finished requests served speculatively", registry=r)
        self._spec_totals = [0, 0]  # tokens, rounds
        Gauge(f"{PREFIX}_spec_accept_length", "Mean tokens per verify round (completion tokens"
              " / verify rounds) of finished requests", registry=r).set_function(
            lambda: self._spec_totals[0] / max(self._spec_totals[1], 1))

    def observe_http(self, path: str, status: int) -> None:
        self.http_requests.labels(path if path in ROUTES else "other", str(status)).inc()

    def observe_finished(self, reason: str, prompt_tokens: int, e2e_s: float,
                         completion_tokens: int = 0, spec_verify_ct: int = 0) -> None:
        self.requests.labels(reason).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.e2e.observe(e2e_s)
        if spec_verify_ct:
            self.spec_verify_steps.inc(spec_verify_ct)
            self.spec_tokens.inc(completion_tokens)
            self._spec_totals[0] += completion_tokens
            self._spec_totals[1] += spec_verify_ct

    def render(self) -> bytes:
        return generate_latest(self.registry)
