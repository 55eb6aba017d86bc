"""The server's Prometheus metrics, in a registry of its own (never prometheus-client's global one).

Names follow Prometheus's conventions (``_total`` counters, ``_seconds`` histograms, base units) under
the ``llama_cache_`` prefix. Request metrics are counted as requests finish; cache, queue and slot
figures are read when ``/metrics`` is scraped, from ``cache.stats()``, the gate and the engine::

    llama_cache_requests_total{endpoint, status}        requests answered, by route and HTTP status (a
                                                        path no route serves, refused for its key: "other")
    llama_cache_time_to_first_token_seconds{endpoint}   arrival to first sampled token (queueing included)
    llama_cache_prompt_tokens_total                     prompt tokens requested
    llama_cache_prompt_tokens_cached_total              of those, not evaluated: reused from the context's
                                                        live tokens or restored from the prompt cache
                                                        (hit ratio = cached / prompt)
    llama_cache_generation_tokens_total                 tokens sampled (end-of-generation tokens included)
    llama_cache_cache_entries{tier}, _cache_bytes{tier}, _cache_capacity_bytes{tier}
    llama_cache_cache_hits_total{tier}, _cache_misses_total{tier}, _cache_evictions_total{tier}
    llama_cache_queue_depth                             requests waiting for a place (``--max-queue``)
    llama_cache_requests_running                        requests holding a place
    llama_cache_slots                                   places (``--parallel``)
    llama_cache_evaluations_waiting                     sequences submitted to the engine, not yet admitted
    llama_cache_evaluated_tokens_total                  tokens evaluated (prompts' new tokens, generated tokens)
    llama_cache_engine_steps_total                      the engine's decodes
    llama_cache_engine_shared_tokens_total              prompt tokens taken from another sequence's cells
    llama_cache_engine_restored_tokens_total            prompt tokens restored from the cache tiers
    llama_cache_engine_evicted_sequences_total          idle sequences evicted (their state stored first)
    llama_cache_engine_preempted_total                  generations whose cells were dropped for want of room
    llama_cache_engine_step_seconds_total               seconds in the engine's steps: decode, sampling, streaming
    llama_cache_engine_decode_seconds_total             seconds of those in ``llama_decode`` alone (the rest,
                                                        over steps_total, is the Python around a decode)
    llama_cache_kv_cells, llama_cache_kv_cells_in_use   the KV pool and the cells its sequences hold
    llama_cache_engine_decode_step_seconds              mean time of a step of generated tokens alone
    llama_cache_engine_prompt_row_seconds               mean time a prompt row adds to a step
    llama_cache_engine_prompt_rows_while_generating     prompt rows a step may carry beside generating
                                                        sequences now (those two measurements' ratio,
                                                        8 to the engine's prompt rows per step)
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

__all__ = ["ServerMetrics"]

logger = logging.getLogger(__name__)

PREFIX = "llama_cache"
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class _LiveCollector(Collector):
    """Reads the caches' counters and the pool's queue at scrape time."""

    def __init__(self, caches: Callable[[], Iterable[tuple[str, Any]]], queue_depth: Callable[[], int],
                 running: Callable[[], int], slots: Callable[[], int],
                 engine: Callable[[], Mapping[str, float]] | None) -> None:
        self._caches = caches
        self._queue_depth = queue_depth
        self._running = running
        self._slots = slots
        self._engine = engine

    def collect(self) -> Iterable[Metric]:
        families = {
            "entries": GaugeMetricFamily(f"{PREFIX}_cache_entries", "States held by the prompt cache",
                                         labels=["tier"]),
            "bytes": GaugeMetricFamily(f"{PREFIX}_cache_bytes", "Bytes of states held by the prompt cache",
                                       labels=["tier"]),
            "capacity_bytes": GaugeMetricFamily(f"{PREFIX}_cache_capacity_bytes",
                                                "Byte budget of the prompt cache", labels=["tier"]),
            "hits": CounterMetricFamily(f"{PREFIX}_cache_hits", "Prompt cache lookups that found a state",
                                        labels=["tier"]),
            "misses": CounterMetricFamily(f"{PREFIX}_cache_misses", "Prompt cache lookups that found nothing",
                                          labels=["tier"]),
            "evictions": CounterMetricFamily(f"{PREFIX}_cache_evictions",
                                             "States evicted from the prompt cache", labels=["tier"]),
            "index_resets": CounterMetricFamily(f"{PREFIX}_cache_index_resets",
                                                "Damaged indexes moved aside, the tier starting empty",
                                                labels=["tier"]),
        }
        for tier, cache in self._caches():
            try:
                stats = cache.stats()
            except Exception as error:  # noqa: BLE001 - a failing cache must not break /metrics
                logger.warning("could not read the %s cache's stats: %s", tier, error)
                continue
            for name, family in families.items():
                family.add_metric([tier], float(getattr(stats, name)))
        yield from families.values()
        yield GaugeMetricFamily(f"{PREFIX}_queue_depth", "Requests waiting for a slot", value=self._queue_depth())
        yield GaugeMetricFamily(f"{PREFIX}_requests_running", "Requests holding a slot", value=self._running())
        yield GaugeMetricFamily(f"{PREFIX}_slots", "Contexts serving requests", value=self._slots())
        if self._engine is not None:
            figures = self._engine()
            yield GaugeMetricFamily(f"{PREFIX}_evaluations_waiting",
                                    "Sequences submitted to the engine, not yet admitted", value=figures["waiting"])
            yield CounterMetricFamily(f"{PREFIX}_evaluated_tokens",
                                      "Tokens evaluated: prompts' new tokens and generated tokens",
                                      value=figures["tokens"])
            for name, help_text in _ENGINE_COUNTERS.items():
                yield CounterMetricFamily(f"{PREFIX}_engine_{name}", help_text, value=figures[name])
            yield GaugeMetricFamily(f"{PREFIX}_kv_cells", "Cells of the KV pool", value=figures["kv_cells"])
            yield GaugeMetricFamily(f"{PREFIX}_kv_cells_in_use", "Cells of the KV pool its sequences hold",
                                    value=figures["kv_cells_in_use"])
            for name, help_text in _ENGINE_GAUGES.items():
                yield GaugeMetricFamily(f"{PREFIX}_engine_{name}", help_text, value=figures[name])


_ENGINE_COUNTERS = {
    "steps": "The engine's decodes",
    "shared_tokens": "Prompt tokens taken from another sequence's cells (llama_memory_seq_cp)",
    "restored_tokens": "Prompt tokens restored from the cache tiers into a sequence",
    "evicted_sequences": "Idle sequences evicted for room (their state stored in the tiers first)",
    "preempted": "Generations whose cells were dropped for want of room (they evaluate again)",
    "step_seconds": "Seconds in the engine's steps (admission, batch, decode, sampling, streaming)",
    "decode_seconds": "Seconds of those in llama_decode alone",
}

_ENGINE_GAUGES = {
    "decode_step_seconds": "Mean seconds of a step of generated tokens alone (0: none measured yet)",
    "prompt_row_seconds": "Mean seconds a prompt row adds to a step (0: none measured yet)",
    "prompt_rows_while_generating": "Prompt rows a step may carry beside generating sequences now",
}


class ServerMetrics:
    """The counters and histograms of one app, in their own :class:`CollectorRegistry`.

    Args:
        caches: returns ``(tier, cache)`` pairs to report (``tier`` is ``"ram"``, ``"disk"`` or ``"redis"``).
        queue_depth, running, slots: read the pool at scrape time.
        engine: returns the engine's figures at scrape time (:meth:`llama_cache.engine.Engine.figures`);
            None: not reported.
        per_key: count prompt tokens per API key id too (``llama_cache_key_prompt_tokens_total``).

    Thread-safe (prometheus-client's metrics are).
    """

    def __init__(self, caches: Callable[[], Iterable[tuple[str, Any]]], queue_depth: Callable[[], int],
                 running: Callable[[], int], slots: Callable[[], int],
                 engine: Callable[[], Mapping[str, float]] | None = None, per_key: bool = False) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(f"{PREFIX}_requests", "HTTP requests answered, by endpoint and status",
                                ["endpoint", "status"], registry=self.registry)
        self.time_to_first_token = Histogram(
            f"{PREFIX}_time_to_first_token_seconds",
            "Seconds from a completion request's arrival to its first sampled token (queueing included)",
            ["endpoint"], buckets=TTFT_BUCKETS, registry=self.registry,
        )
        self.prompt_tokens = Counter(f"{PREFIX}_prompt_tokens", "Prompt tokens requested", registry=self.registry)
        self.prompt_tokens_cached = Counter(
            f"{PREFIX}_prompt_tokens_cached",
            "Prompt tokens not evaluated: reused from a context's live tokens or restored from the prompt cache",
            registry=self.registry,
        )
        self.generation_tokens = Counter(f"{PREFIX}_generation_tokens",
                                         "Tokens sampled (end-of-generation tokens included)",
                                         registry=self.registry)
        self._key_prompt_tokens: Counter | None = None
        self._key_prompt_tokens_cached: Counter | None = None
        if per_key:
            self._key_prompt_tokens = Counter(f"{PREFIX}_key_prompt_tokens", "Prompt tokens requested, by API key id",
                                              ["key"], registry=self.registry)
            self._key_prompt_tokens_cached = Counter(
                f"{PREFIX}_key_prompt_tokens_cached", "Prompt tokens not evaluated, by API key id", ["key"],
                registry=self.registry)
        self.registry.register(_LiveCollector(caches, queue_depth, running, slots, engine))

    def count_key_tokens(self, key: str, prompt_tokens: int, cached_tokens: int) -> None:
        """Count a request's prompt tokens under its API key's id (never a salt: clients choose those,
        and each would become a series). Does nothing unless made with ``per_key``."""
        if self._key_prompt_tokens is None or self._key_prompt_tokens_cached is None:
            return
        self._key_prompt_tokens.labels(key).inc(prompt_tokens)
        self._key_prompt_tokens_cached.labels(key).inc(cached_tokens)

    def render(self) -> bytes:
        """The registry in Prometheus's text exposition format."""
        return generate_latest(self.registry)
