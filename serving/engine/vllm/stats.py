"""What EngineStats needs of a vLLM engine, kept up to date by a stat logger of ours on vLLM's
SchedulerStats and IterationStats: running and waiting requests, KV usage, prefix-cache queries
and hits, tokens, preemptions, and the decode step account (engine.DecodeSteps)."""

from __future__ import annotations

import logging
from collections.abc import Callable

__all__ = ["VLLMStats"]

logger = logging.getLogger(__name__)


class VLLMStats:
    """The figures EngineStats needs, kept up to date by vLLM's stat logger callback."""

    def __init__(self) -> None:
        self.num_running = self.num_waiting = 0
        self.kv_cache_usage = 0.0
        self.prefix_queries = self.prefix_hits = 0
        self.num_preemptions = 0
        self.num_generated = self.num_prompt = 0
        # The decode step account (engine.DecodeSteps), from vLLM's iterations: one that computed
        # no prompt token and followed one after which requests still ran counts, its period the
        # time since that one's outputs (the handler's clock: the jitter cancels over a run)
        self.decode_steps = self.decode_rows = 0
        self.decode_s = 0.0
        self._previous: tuple[float, bool] | None = None  # (its outputs' time, requests still ran)

    def decoded(self, iteration, scheduler) -> None:
        """One of vLLM's iterations into the decode step account (rows: the tokens it generated,
        one a sequence without speculative decoding)."""
        now = iteration.iteration_timestamp
        if self._previous is not None and self._previous[1] and iteration.num_prompt_tokens == 0 \
                and iteration.num_generation_tokens > 0:
            self.decode_steps += 1
            self.decode_rows += iteration.num_generation_tokens
            self.decode_s += max(0.0, now - self._previous[0])
        still_running = scheduler is not None and scheduler.num_running_reqs > 0
        self._previous = (now, still_running)

    def logger_factory(self) -> Callable:
        from vllm.v1.metrics.loggers import StatLoggerBase

        stats = self

        class _Logger(StatLoggerBase):
            def __init__(self, vllm_config, engine_index: int = 0):
                pass

            def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
                if scheduler_stats is not None:
                    stats.num_running = scheduler_stats.num_running_reqs
                    stats.num_waiting = scheduler_stats.num_waiting_reqs + scheduler_stats.num_skipped_waiting_reqs
                    stats.kv_cache_usage = scheduler_stats.kv_cache_usage
                    prefix = scheduler_stats.prefix_cache_stats
                    stats.prefix_queries += prefix.queries
                    stats.prefix_hits += prefix.hits
                if iteration_stats is not None:
                    stats.num_generated += iteration_stats.num_generation_tokens
                    prompt = iteration_stats.prompt_token_stats  # computed here, not read from the cache
                    stats.num_prompt += getattr(prompt, "computed", iteration_stats.num_prompt_tokens)
                    stats.num_preemptions += iteration_stats.num_preempted_reqs
                    stats.decoded(iteration_stats, scheduler_stats)

            def log_engine_initialized(self):
                pass

        return _Logger
