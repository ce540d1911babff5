"""Prometheus metrics named after vLLM's (prefix `jserve:` instead of `vllm:`), one registry per app.

Engine-wide gauges and counters are read from the snapshot the engine thread publishes after every step, so
a scrape never touches the engine itself; latency histograms are observed by the engine thread as outputs
appear.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from jserve.engine.engine import EngineSnapshot

# vLLM's buckets, so dashboards port unchanged.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0)


class _SnapshotCollector(Collector):
    def __init__(self, snapshot: Callable[[], EngineSnapshot | None], model_name: str):
        self._snapshot = snapshot
        self._labels = {"model_name": model_name}

    def _gauge(self, name: str, doc: str, value: float) -> Metric:
        metric = GaugeMetricFamily(name, doc, labels=list(self._labels))
        metric.add_metric(list(self._labels.values()), value)
        return metric

    def _counter(self, name: str, doc: str, value: float) -> Metric:
        metric = CounterMetricFamily(name, doc, labels=list(self._labels))
        metric.add_metric(list(self._labels.values()), value)
        return metric

    def collect(self) -> Iterator[Metric]:
        s = self._snapshot() or EngineSnapshot()  # zeros while the model loads
        yield self._gauge("jserve:num_requests_running", "Sequences in the running batch.", s.num_running)
        yield self._gauge("jserve:num_requests_waiting", "Sequences waiting to be scheduled.", s.num_waiting)
        yield self._gauge("jserve:kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = full).",
                          s.kv_cache_usage)
        yield self._counter("jserve:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                            s.prefix_cache_queries)
        yield self._counter("jserve:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                            s.prefix_cache_hits)
        yield self._counter("jserve:num_preemptions", "Sequences preempted to free KV cache.", s.num_preemptions)
        yield self._counter("jserve:prompt_tokens", "Prefill tokens computed.", s.prompt_tokens)
        yield self._counter("jserve:generation_tokens", "Tokens generated.", s.generation_tokens)
        # speculative decoding (docs/speculative.md), vLLM's names
        yield self._counter("jserve:spec_decode_num_drafts", "Sequence steps that verified draft tokens.",
                            s.spec_num_drafts)
        yield self._counter("jserve:spec_decode_num_draft_tokens", "Draft tokens proposed.", s.spec_num_draft_tokens)
        yield self._counter("jserve:spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                            s.spec_num_accepted_tokens)
        per_pos = CounterMetricFamily("jserve:spec_decode_num_accepted_tokens_per_pos",
                                      "Draft tokens accepted at each draft position.",
                                      labels=[*self._labels, "position"])
        for position, count in enumerate(s.spec_accepted_per_pos):
            per_pos.add_metric([*self._labels.values(), str(position)], count)
        yield per_pos


class ServerMetrics:
    """Every metric of one server, in its own CollectorRegistry (so apps and tests never share state)."""

    def __init__(self, model_name: str, snapshot: Callable[[], EngineSnapshot | None]):
        self.registry = CollectorRegistry()
        self.registry.register(_SnapshotCollector(snapshot, model_name))
        labels = {"model_name": model_name}

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labelnames=list(labels), buckets=buckets,
                             registry=self.registry).labels(**labels)

        self.time_to_first_token = histogram("jserve:time_to_first_token_seconds",
                                             "Time from admission to the first output token.", TTFT_BUCKETS)
        self.inter_token_latency = histogram("jserve:inter_token_latency_seconds",
                                             "Time between successive outputs of a request.", ITL_BUCKETS)
        self.e2e_request_latency = histogram("jserve:e2e_request_latency_seconds",
                                             "Time from admission to the last output token.", REQUEST_BUCKETS)
        self.request_queue_time = histogram("jserve:request_queue_time_seconds",
                                            "Time a request waited before it was first scheduled.",
                                            REQUEST_BUCKETS)
        self.request_success = Counter("jserve:request_success", "Finished requests by finish reason.",
                                       labelnames=["model_name", "finished_reason"], registry=self.registry)
        self.step_failures = Counter("jserve:engine_step_failures", "Engine steps that raised (each fails the "
                                     "requests it held).", labelnames=["model_name"],
                                     registry=self.registry).labels(**labels)
        self._model_name = model_name
        # Per API key (labelled by the key's id, never its secret), and load shedding.
        key_labels = ["model_name", "key_id"]
        self.api_key_requests = Counter("jserve:api_key_requests",
                                        "Requests by API key id and outcome (admitted, rate_limited, shed, timeout).",
                                        labelnames=[*key_labels, "outcome"], registry=self.registry)
        self.api_key_tokens = Counter("jserve:api_key_tokens", "Prompt plus generated tokens by API key id.",
                                      labelnames=key_labels, registry=self.registry)
        self.api_key_running = Gauge("jserve:api_key_requests_running", "Requests in flight by API key id.",
                                     labelnames=key_labels, registry=self.registry)
        self.requests_shed = Counter("jserve:requests_shed", "Requests refused because the estimated queue wait "
                                     "exceeded --max-queue-delay.", labelnames=list(labels),
                                     registry=self.registry).labels(**labels)
        self.request_timeouts = Counter("jserve:request_timeouts", "Requests aborted at their X-Request-Timeout.",
                                        labelnames=list(labels), registry=self.registry).labels(**labels)
        self.estimated_queue_wait = Gauge("jserve:estimated_queue_wait_seconds",
                                          "Estimated queue wait of a new lowest-priority request (0 when a seat is "
                                          "free; +Inf when requests are queued and none has finished lately).",
                                          labelnames=list(labels), registry=self.registry).labels(**labels)

    def request_finished(self, reason: str) -> None:
        self.request_success.labels(model_name=self._model_name, finished_reason=reason).inc()

    def key_request(self, key_id: str, outcome: str) -> None:
        self.api_key_requests.labels(model_name=self._model_name, key_id=key_id, outcome=outcome).inc()

    def key_tokens(self, key_id: str, tokens: int) -> None:
        self.api_key_tokens.labels(model_name=self._model_name, key_id=key_id).inc(max(0, tokens))

    def key_running(self, key_id: str, running: int) -> None:
        self.api_key_running.labels(model_name=self._model_name, key_id=key_id).set(running)

    def set_queue_wait_source(self, source: Callable[[], float]) -> None:
        self.estimated_queue_wait.set_function(source)

    def render(self) -> bytes:
        return generate_latest(self.registry)
