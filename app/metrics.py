"""Prometheus metrics, named after vLLM's: cache gauges and token counters read from the
engine at scrape time, latency histograms observed per turn."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

if TYPE_CHECKING:
    from engine.snapshot import EngineSnapshot

disable_created_metrics()  # no *_created series: scrapers do not need them

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)


class EngineCollector:
    def __init__(self, snapshot: Callable[[], EngineSnapshot]) -> None:
        self._snapshot = snapshot

    def collect(self):
        snap = self._snapshot()
        usage = GaugeMetricFamily(
            "pensieve:kv_cache_usage_perc", "KV cache usage per tier (1 = full).", labels=["tier"]
        )
        blocks = GaugeMetricFamily(
            "pensieve:kv_cache_blocks",
            "KV cache blocks per tier and state.",
            labels=["tier", "state"],
        )
        for tier, pool in (("gpu", snap.gpu), ("cpu", snap.cpu)):
            usage.add_metric([tier], pool.used / pool.total if pool.total else 0.0)
            for state in ("total", "used", "free"):
                blocks.add_metric([tier, state], getattr(pool, state))
        layer_bytes = GaugeMetricFamily(
            "pensieve:kv_cache_bytes",
            "KV bytes in use per tier and layer type (full: layers that attend to every key; "
            "sliding: layers that keep only their window).",
            labels=["tier", "layers"],
        )
        for tier, kinds in snap.kv_bytes.items():
            for kind, n in kinds.items():
                layer_bytes.add_metric([tier, kind], n)
        yield usage
        yield blocks
        yield layer_bytes
        c = snap.counters
        yield GaugeMetricFamily(
            "pensieve:num_requests_running", "Turns in the running batch.", value=c.running
        )
        yield GaugeMetricFamily(
            "pensieve:num_requests_waiting", "Turns waiting to be admitted.", value=c.waiting
        )
        yield GaugeMetricFamily(
            "pensieve:num_conversations",
            "Conversations with KV state in the engine.",
            value=len(snap.conversations),
        )
        simple = {
            "prompt_tokens": ("pensieve:prompt_tokens", "New prompt tokens computed."),
            "generated_tokens": ("pensieve:generation_tokens", "Tokens generated."),
            "recomputed_tokens": (
                "pensieve:recomputed_tokens",
                "Dropped context recomputed from history.",
            ),
            "dropped_tokens": (
                "pensieve:dropped_tokens",
                "Context tokens evicted from the CPU tier.",
            ),
            "suspensions": ("pensieve:num_preemptions", "Running turns suspended to CPU."),
            "prefetched_tokens": (
                "pensieve:prefetched_tokens",
                "Context brought back to the GPU tier while the user was typing.",
            ),
            "shared_tokens": (
                "pensieve:shared_tokens",
                "Prompt tokens of new conversations found in chunks shared with others.",
            ),
            "reencoded_tokens": (
                "pensieve:reencoded_tokens",
                "Reply tokens re-encoded as the chat template renders them in history.",
            ),
        }
        for key, (name, doc) in simple.items():
            yield CounterMetricFamily(name, doc, value=getattr(c, key))
        reused = CounterMetricFamily(
            "pensieve:context_tokens_reused",
            "Context tokens served from a cache tier.",
            labels=["tier"],
        )
        reused.add_metric(["gpu"], c.cached_tokens)
        reused.add_metric(["cpu"], c.swapped_in_tokens)
        reused.add_metric(["disk"], c.disk_tokens)
        yield reused
        swaps = CounterMetricFamily(
            "pensieve:swapped_tokens", "Tokens copied between tiers.", labels=["direction"]
        )
        swaps.add_metric(["in"], c.swapped_in_tokens)
        swaps.add_metric(["out"], c.swapped_out_tokens)
        yield swaps
        ahead = CounterMetricFamily(
            "pensieve:swap_ahead_chunks",
            "Chunks copied to the CPU ahead of time (copied), and of them: GPU block reclaimed "
            "later at no cost (reclaimed), read back by a swap-in (read), copy given up while "
            "still on the GPU (wasted).",
            labels=["outcome"],
        )
        for outcome in ("copied", "reclaimed", "read", "wasted"):
            key = "ahead_chunks" if outcome == "copied" else f"ahead_{outcome}_chunks"
            ahead.add_metric([outcome], getattr(c, key))
        yield ahead
        pinned = GaugeMetricFamily(
            "pensieve:kv_cache_pinned_bytes",
            "Bytes of KV that clients pinned in memory (retention.ttl_s), per tier.",
            labels=["tier"],
        )
        pinned.add_metric(["gpu"], snap.pins.gpu_bytes)
        pinned.add_metric(["cpu"], snap.pins.cpu_bytes)
        yield pinned
        yield GaugeMetricFamily(
            "pensieve:kv_cache_pinned_conversations",
            "Conversations a client pinned in memory.",
            value=snap.pins.conversations,
        )
        yield GaugeMetricFamily(
            "pensieve:kv_cache_shared_chunks",
            "Chunks held by more than one conversation, stored once.",
            value=snap.sharing.chunks,
        )
        yield GaugeMetricFamily(
            "pensieve:kv_cache_shared_saved_blocks",
            "Blocks a copy per conversation of the shared chunks would take on top.",
            value=snap.sharing.saved_blocks,
        )


class Metrics:
    """One registry per app, so several servers can live in one process (tests)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.ttft = Histogram(
            "pensieve:time_to_first_token_seconds",
            "From the message frame to the first generated token.",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            "pensieve:e2e_request_latency_seconds",
            "From the message frame to the end of the reply.",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.finished = Counter(
            "pensieve:request_success",
            "Finished turns by reason.",
            ["finished_reason"],
            registry=self.registry,
        )

        # Totals for the admin page's TTFT chart (it charts the mean per poll interval).
        self.turns = 0
        self.ttft_sum_s = 0.0

    def watch(self, snapshot: Callable[[], EngineSnapshot]) -> None:
        self.registry.register(EngineCollector(snapshot))

    def observe_turn(self, ttft_s: float, total_s: float, finish_reason: str) -> None:
        self.ttft.observe(ttft_s)
        self.turns += 1
        self.ttft_sum_s += ttft_s
        self.e2e.observe(total_s)
        self.finished.labels(finish_reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
