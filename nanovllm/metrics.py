"""`LLM.get_metrics()`: what the engine has counted, as vLLM's metric records (`vllm.v1.metrics.reader`)
under vLLM's metric names, so that its `metrics.py` example reads them unchanged:

- gauges: `vllm:num_requests_running`, `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc`;
- counters: `vllm:prompt_tokens`, `vllm:generation_tokens`, `vllm:prefix_cache_queries` and
  `vllm:prefix_cache_hits` (in tokens), `vllm:num_preemptions`, `vllm:request_success` (by finished_reason);
- histograms, a value per finished request: `vllm:time_to_first_token_seconds`,
  `vllm:request_time_per_output_token_seconds`, `vllm:e2e_request_latency_seconds`,
  `vllm:request_prompt_tokens`, `vllm:request_generation_tokens`.
"""
import bisect
from collections import Counter as Tally
from dataclasses import dataclass, field


@dataclass
class Metric:
    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):
    value: int


@dataclass
class Vector(Metric):
    values: list[int]


@dataclass
class Gauge(Metric):
    value: float


@dataclass
class Histogram(Metric):
    count: int
    sum: float
    buckets: dict[str, int]  # upper bound ("+Inf" last) -> observations at or below it, as Prometheus counts


SECONDS_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
TOKEN_BUCKETS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000]


@dataclass
class Observations:
    """Values counted into buckets as they come (not kept: a long run's memory stays flat)."""
    bounds: list[float]
    counts: list[int] = field(init=False)
    total: float = 0.0

    def __post_init__(self):
        self.counts = [0] * (len(self.bounds) + 1)

    def add(self, value: float):
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    def histogram(self, name: str, labels: dict) -> Histogram:
        cumulative, buckets = 0, {}
        for bound, count in zip([*map(str, self.bounds), "+Inf"], self.counts):
            cumulative += count
            buckets[bound] = cumulative
        return Histogram(name, labels, cumulative, float(self.total), buckets)


class EngineStats:
    """What LLMEngine counts as it runs: tokens, finished requests and their timings."""

    def __init__(self):
        self.prompt_tokens = self.generation_tokens = 0
        self.finished_reasons: Tally = Tally()
        self.latencies = {name: Observations(SECONDS_BUCKETS) for name in
                          ("time_to_first_token_seconds", "request_time_per_output_token_seconds",
                           "e2e_request_latency_seconds")}
        self.lengths = {name: Observations(TOKEN_BUCKETS) for name in
                        ("request_prompt_tokens", "request_generation_tokens")}

    def note_progress(self, requests: list, now: float) -> list:
        """Requests that took tokens at `now`: their RequestMetrics' times, and the counts of a first token or a
        finish. Returns those that finished."""
        finished = []
        for request in requests:  # every running request, at every step: one call for them all
            metrics = request.metrics
            if metrics.first_token_time is None:
                metrics.first_token_time = now
                self.note_first_token(request)
            metrics.last_token_time = now
            if request.finished:
                metrics.finished_time = now
                self.note_finished(request)
                finished.append(request)
        return finished

    def note_first_token(self, request):
        """A request's prompt counts once, when its first token comes (as vLLM counts it)."""
        self.prompt_tokens += len(request.prompt_token_ids)

    def note_finished(self, request):
        """A finished request's lengths, reasons and timings (its RequestMetrics)."""
        metrics, generated = request.metrics, sum(len(seq.completion_token_ids) for seq in request.seqs)
        for seq in request.seqs:
            self.finished_reasons[seq.finish_reason or "abort"] += 1
        self.lengths["request_prompt_tokens"].add(len(request.prompt_token_ids))
        self.lengths["request_generation_tokens"].add(generated)
        if metrics.first_token_time is None:
            return
        self.latencies["time_to_first_token_seconds"].add(metrics.first_token_time - metrics.arrival_time)
        self.latencies["e2e_request_latency_seconds"].add(metrics.finished_time - metrics.arrival_time)
        if generated > 1:
            self.latencies["request_time_per_output_token_seconds"].add(
                (metrics.last_token_time - metrics.first_token_time) / (generated - 1))

    def metrics(self, engine) -> list[Metric]:
        labels = {"model_name": engine.config.model, "engine": "0"}
        scheduler, blocks = engine.scheduler, engine.scheduler.block_manager
        records: list[Metric] = [
            Gauge("vllm:num_requests_running", labels, len(scheduler.running)),
            Gauge("vllm:num_requests_waiting", labels, len(scheduler.waiting)),
            Gauge("vllm:kv_cache_usage_perc", labels, len(blocks.used_block_ids) / len(blocks.blocks)),
            Counter("vllm:prompt_tokens", labels, self.prompt_tokens),
            Counter("vllm:generation_tokens", labels, self.generation_tokens),
            Counter("vllm:prefix_cache_queries", labels, blocks.prefix_cache_queries),
            Counter("vllm:prefix_cache_hits", labels, blocks.prefix_cache_hits),
            Counter("vllm:num_preemptions", labels, scheduler.num_preemptions),
        ]
        records += [Counter("vllm:request_success", {**labels, "finished_reason": reason}, count)
                    for reason, count in sorted(self.finished_reasons.items())]
        records += [observations.histogram(f"vllm:{name}", labels)
                    for name, observations in {**self.latencies, **self.lengths}.items()]
        return records
