"""The server's Prometheus metrics, in vLLM's names under a `jaxpage:` prefix (GET /metrics).

Gauges are read from the engine when scraped (EngineGauges; an engine in a process of its own sends them with its
turns, at most a tenth of a second apart while it steps): sequences running and waiting (vLLM's requests: a request
with n > 1 runs as n sequences there too), and the KV cache's used share. Counters and histograms are fed by the engine
loop (`observe`, with every RequestOutput it hands over): prompt and generation tokens, finished requests by reason,
time to first token, inter-token latency (between a request's outputs, one observation per output: a step that gives
a sequence several tokens, by speculative decoding, is one observation) and end-to-end latency; prefix-cache queries
and hits, the prefix cache's host tier (hit tokens, pages and bytes copied each way, the share of its slots in use),
and the speculative decoding counters, are the engine's own counts; so is the speculation policy's state:
whether it speculates now (a gauge, 1 or 0), its turns on and off, its probes of the arm not taken, and the estimates
of its latest decision (seconds per token of a verify step and of a decode step, the drafts' acceptance rate).
"""

from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from jaxpage.engine.llm_engine import LLMEngine
from jaxpage.engine.replica import HostTierCounts, host_tier_counts
from jaxpage.outputs import RequestOutput

PREFIX = "jaxpage:"
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                   40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class EngineGauges:
    """What the metrics read of the engine, at one moment."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_counts: tuple[int, int]  # (queries, hits)
    spec_decoding_stats: object  # jaxpage.spec_decode.stats.SpecDecodingStats, None without speculative decoding
    spec_decoding_policy: object  # jaxpage.spec_decode.policy.PolicyState, None without speculative decoding
    host_tier: HostTierCounts | None  # None without a host tier
    host_bytes_moved: dict[str, int] | None  # by direction ("offload", "load")


def engine_gauges(engine: LLMEngine) -> EngineGauges:
    """engine's gauges now (copies: they do not change after)."""
    host_tier = host_tier_counts(engine.replicas)
    bytes_moved = dict(engine.runner.pool.host.bytes_moved) if host_tier is not None else None
    return EngineGauges(
        engine.num_running(),
        engine.num_waiting(),
        engine.kv_cache_usage(),
        engine.prefix_cache_counts(),
        copy.deepcopy(engine.spec_decoding_stats),
        engine.spec_decoding_policy,
        host_tier,
        bytes_moved,
    )


class EngineCounts:
    """A collector of the engine's own running counts (prefix cache, speculative decoding)."""

    def __init__(self, gauges: Callable[[], EngineGauges]):
        self.gauges = gauges

    def collect(self):
        gauges = self.gauges()
        queries, hits = gauges.prefix_cache_counts
        yield _counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache", queries)
        yield _counter("prefix_cache_hits", "Prompt tokens found in the prefix cache", hits)
        yield from self._host_tier(gauges)
        stats = gauges.spec_decoding_stats
        if stats is not None:
            yield _counter("spec_decode_num_drafts", "Drafts verified", stats.num_drafts)
            yield _counter("spec_decode_num_draft_tokens", "Draft tokens verified", stats.num_draft_tokens)
            yield _counter("spec_decode_num_accepted_tokens", "Draft tokens accepted", stats.num_accepted_tokens)
            per_position = CounterMetricFamily(
                PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                "Draft tokens accepted, by position",
                labels=["position"],
            )
            for position, count in enumerate(stats.num_accepted_tokens_per_pos):
                per_position.add_metric([str(position)], count)
            yield per_position
        policy = gauges.spec_decoding_policy
        if policy is not None:
            yield _gauge("spec_decode_speculating", "1: drafts are verified now, 0: not", policy.speculating)
            switches = CounterMetricFamily(
                PREFIX + "spec_decode_num_switches", "Times the policy turned speculation on or off", labels=["to"]
            )
            switches.add_metric(["on"], policy.num_switches_on)
            switches.add_metric(["off"], policy.num_switches_off)
            yield switches
            yield _counter("spec_decode_num_probes", "Probes of the arm the policy does not take", policy.num_probes)
            yield _counter("spec_decode_num_declined", "Steps with drafts that decoded instead", policy.num_declined)
            estimates = (
                ("verify_seconds_per_token", "A verify step's seconds per expected token", policy.verify_s_per_token),
                ("decode_seconds_per_token", "A decode step's seconds per token", policy.decode_s_per_token),
                ("acceptance_rate_estimate", "Estimated accepted / draft tokens", policy.acceptance_rate),
            )
            for name, documentation, value in estimates:
                if value is not None:
                    yield _gauge("spec_decode_" + name, documentation, value)

    @staticmethod
    def _host_tier(gauges: EngineGauges):
        """The prefix cache's host tier (engine argument kv_offload_bytes): nothing without one."""
        counts = gauges.host_tier
        if counts is None:
            return
        yield _counter(
            "kv_offload_hit_tokens", "Prompt tokens whose KV pages came back from host memory", counts.hit_tokens
        )
        pages = CounterMetricFamily(
            PREFIX + "kv_offload_pages", "KV pages copied between the device and host memory", labels=["direction"]
        )
        moved = CounterMetricFamily(
            PREFIX + "kv_offload_bytes", "Bytes copied between the device and host memory", labels=["direction"]
        )
        bytes_moved = gauges.host_bytes_moved
        for direction, count in (("offload", counts.offloaded_pages), ("load", counts.loaded_pages)):
            pages.add_metric([direction], count)
            moved.add_metric([direction], bytes_moved[direction])
        yield pages
        yield moved
        yield _gauge(
            "kv_offload_usage", "The share of the host tier's page slots in use", counts.used_slots / counts.slots
        )


def _counter(name: str, documentation: str, value: int) -> CounterMetricFamily:
    return CounterMetricFamily(PREFIX + name, documentation, value=value)


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(PREFIX + name, documentation, value=value)


class ServerMetrics:
    def __init__(self, gauges: Callable[[], EngineGauges]):
        """gauges: the engine's now (AsyncEngine.gauges)."""
        self.registry = registry = CollectorRegistry()
        running = Gauge(PREFIX + "num_requests_running", "Sequences running", registry=registry)
        running.set_function(lambda: gauges().num_running)
        waiting = Gauge(PREFIX + "num_requests_waiting", "Sequences waiting", registry=registry)
        waiting.set_function(lambda: gauges().num_waiting)
        usage = Gauge(PREFIX + "kv_cache_usage_perc", "Share of the KV pages in use (1 = all)", registry=registry)
        usage.set_function(lambda: gauges().kv_cache_usage)
        self.prompt_tokens = Counter(
            PREFIX + "prompt_tokens", "Prompt tokens of the requests served", registry=registry
        )
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Tokens generated", registry=registry)
        self.request_success = Counter(
            PREFIX + "request_success", "Sequences finished, by reason", ["finished_reason"], registry=registry
        )
        histogram = dict(buckets=LATENCY_BUCKETS, registry=registry)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Arrival to first token", **histogram)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "Between a request's outputs", **histogram)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Arrival to the last token", **histogram)
        registry.register(EngineCounts(gauges))
        self._seen: dict[str, float] = {}  # request_id -> when its latest tokens came, while it runs

    def observe(self, output: RequestOutput) -> None:
        """Called by the engine loop with every output of the engine: a streamed request's each hold what its step
        added (RequestOutputKind.DELTA), a whole request's one its whole completions (FINAL_ONLY)."""
        now = time.time()
        tokens = sum(len(c.token_ids) for c in output.outputs)
        last = self._seen.get(output.request_id)
        if tokens:
            self.generation_tokens.inc(tokens)
            if last is None:
                self.prompt_tokens.inc(len(output.prompt_token_ids))
                self.ttft.observe(max(now - output.metrics.arrival_time, 0.0))
            else:
                self.itl.observe(now - last)
            self._seen[output.request_id] = now
        if output.finished:
            self._seen.pop(output.request_id, None)
            for completion in output.outputs:
                self.request_success.labels(completion.finish_reason or "abort").inc()
            self.e2e.observe(max(now - output.metrics.arrival_time, 0.0))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
