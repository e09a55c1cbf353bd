"""vLLM as a second engine behind the same workers (`backend: vllm`): VLLMEngine runs vLLM's
AsyncLLM in the worker's replica with AsyncEngine's surface, so the ingress, the routers, the
autoscaler, metrics and tracing do not know which engine they talk to.

    EngineWorker ─┬─ AsyncEngine  (kvrelay's engine, a step thread)        same calls: generate,
                  └─ VLLMEngine   (vllm.v1 AsyncLLM, its EngineCore process)  abort, stats, ...

What maps onto what:

    EngineConfig            model (a GGUF goes through kvrelay's safetensors conversion: vLLM on a
                            CPU cannot read one), dtype, block_size (rounded up to vLLM's CPU
                            attention's multiple of 32), max_model_len, max_num_seqs,
                            max_num_batched_tokens, enable_prefix_caching, seed, kv_cache_bytes
                            (kv_cache_memory_bytes), lora (enable_lora); `vllm:` vLLM's own
    SamplingParams          vllm.SamplingParams with deltas out (output_kind DELTA); `guided` ->
                            StructuredOutputsParams; top_k 0 -> vLLM's 0 (off)
    RequestOutput           vLLM's deltas: text, token ids, logprobs (the sampled token and the
                            top alternatives), finish and stop reasons, cached prompt tokens
    EngineStats             a stat logger of ours on vLLM's SchedulerStats and IterationStats: running
                            and waiting requests, KV usage, prefix-cache queries and hits, tokens

    KV events               relayed into kvrelay's hashes (vllm_events.py): the router's index and
                            the ingress's prompt hashes stay in one hash space, whichever engine a
                            pool runs

    P/D hand-off            with `kv_handoff` (a prefill or decode pool's replica), vLLM runs
                            kvrelay's KV connector (vllm_connector.py, the EngineCore's side;
                            vllm_handoff.py, this replica's): a prefill request (hold_kv) saves its
                            prompt's blocks into the range the worker reserved in the node's KV
                            arena (export_into, a ShmRange), export_kv hands it on; a decode request
                            (kv_payload) loads it before its first step, or vLLM recomputes it
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from serving.engine.config import EngineConfig, VLLMOptions
from serving.engine.errors import EngineDeadError, InvalidRequestError, ModelLoadError, RequestFailedError
from serving.engine.kv.payload import KVLayout, KVPayload, ShmRange
from serving.engine.outputs import CompletionOutput, EngineStats, RequestMetrics, RequestOutput, TokenLogprob
from serving.engine.params import SamplingParams
from serving.engine.prefill_rate import PrefillRate
from serving.engine.vllm.events import KVEventRelay
from serving.engine.vllm.handoff import Handoffs, payload_bytes

__all__ = ["VLLMEngine", "vllm_sampling_params"]

logger = logging.getLogger(__name__)


def vllm_sampling_params(params: SamplingParams, kv_transfer_params: dict | None = None):
    """kvrelay's SamplingParams as vLLM's, deltas out. Greedy with n > 1 (which vLLM refuses) is
    asked of vLLM once: its choices are all the same (VLLMEngine.generate copies it). A hand-off
    rides in `kv_transfer_params` (vllm_connector.HandoffSpec)."""
    from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams
    from vllm.sampling_params import SamplingParams as VSamplingParams

    structured = None
    guided = params.guided
    if guided is not None:
        structured = {
            # compact JSON, as kvrelay's grammars give (params.GuidedSpec)
            "json_schema": lambda v: StructuredOutputsParams(json=v, disable_any_whitespace=True),
            "json_object": lambda v: StructuredOutputsParams(json_object=True, disable_any_whitespace=True),
            "regex": lambda v: StructuredOutputsParams(regex=v),
            "choice": lambda v: StructuredOutputsParams(choice=json.loads(v)),
            "grammar": lambda v: StructuredOutputsParams(grammar=v),
        }[guided.kind](guided.value)
    return VSamplingParams(
        n=1 if _is_greedy(params) else params.n, max_tokens=params.max_tokens, min_tokens=params.min_tokens, temperature=params.temperature,
        top_p=params.top_p, top_k=max(params.top_k, 0), min_p=params.min_p,
        repetition_penalty=params.repetition_penalty, presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty, logit_bias=dict(params.logit_bias) if params.logit_bias else None,
        seed=params.seed, logprobs=params.logprobs, prompt_logprobs=params.prompt_logprobs,
        stop=list(params.stop) or None, stop_token_ids=list(params.stop_token_ids) or None,
        include_stop_str_in_output=params.include_stop_str_in_output, ignore_eos=params.ignore_eos,
        skip_special_tokens=params.skip_special_tokens, detokenize=params.detokenize,
        structured_outputs=structured, output_kind=RequestOutputKind.DELTA,
        extra_args={"kv_transfer_params": kv_transfer_params} if kv_transfer_params else None,
    )


# vLLM samples greedily below this temperature (and refuses n > 1 there)
_GREEDY_TEMPERATURE = 1e-5
# A prefill computing fewer tokens than this says more about overhead than rate (as engine.py)
_MIN_RATE_TOKENS = 32


def _is_greedy(params: SamplingParams) -> bool:
    return params.temperature < _GREEDY_TEMPERATURE


def _token_logprob(token_id: int, entry, k: int, *, with_rank: bool = False) -> TokenLogprob:
    """One of vLLM's {token id: Logprob} as kvrelay's TokenLogprob: the token's logprob (its rank
    too, when asked) and the `k` most likely by rank (the token is in vLLM's dict whatever its rank)."""
    chosen = entry.get(token_id)
    top = sorted(((t, lp) for t, lp in entry.items() if lp.rank is not None and 0 < lp.rank <= k), key=lambda x: x[1].rank)
    logprob = chosen.logprob if chosen is not None else float("-inf")
    rank = chosen.rank if with_rank and chosen is not None else None
    return TokenLogprob(token_id, logprob, [(t, lp.logprob) for t, lp in top], rank)


def _prompt_logprobs(prompt: list[int], entries, k: int | None) -> list[TokenLogprob] | None:
    """vLLM's prompt logprobs (None for the first token, then one entry each) as kvrelay's: the
    logprob of prompt token i + 1 at index i, with its rank and the top `k`."""
    if entries is None or k is None:
        return None
    return [_token_logprob(t, entry, k, with_rank=True) for t, entry in zip(prompt[1:], entries[1:])]


def _logprobs(token_ids, entries, k: int) -> list[TokenLogprob] | None:
    """vLLM's per-token logprobs as kvrelay's: each sampled token's, and the top `k`."""
    if entries is None:
        return None
    return [_token_logprob(t, entry, k) for t, entry in zip(token_ids, entries)]


class _Stats:
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


class _EngineView:
    """What the worker and the ingress read off `engine.engine` (ModelInfo.of, the block size, the
    hand-off's sizes)."""

    # vLLM's connector copies between its cache (CPU or GPU) and host shared memory itself: a
    # prefill worker may always reserve a range of the node's arena
    kv_exports_to_host = True

    def __init__(self, config: EngineConfig, vocab_size: int, max_model_len: int, eos_token_ids: tuple[int, ...],
                 kv_layout: KVLayout):
        self.config = config
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.kv_layout = kv_layout

    def kv_payload_bytes(self, num_tokens: int) -> int:
        return payload_bytes(self.kv_layout, num_tokens)


def _capped_max_model_len(config: EngineConfig, spec, kv_bytes: int | None) -> int | None:
    """The context window to ask vLLM for: as kvrelay's engine does, capped (with a warning) at
    what a KV budget of `kv_bytes` holds, in whole blocks of `config.block_size` less the null block
    vLLM keeps, where vLLM would refuse to start instead; None: vLLM's own (a GPU's budget is vLLM's to work out)."""
    if kv_bytes is None:
        return config.max_model_len
    per_token = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * (4 if config.dtype == "float32" else 2)
    capacity = (kv_bytes // (per_token * config.block_size) - 1) * config.block_size  # vLLM keeps a null block
    if capacity <= 0:
        raise ModelLoadError(f"kv_cache_bytes {kv_bytes} holds no block of {config.block_size} tokens beside vLLM's null block "
                             f"({per_token} bytes each): give the engine more KV cache")
    window = min(config.max_model_len or spec.max_position_embeddings, spec.max_position_embeddings)
    if capacity < window:
        logger.warning("the KV cache holds %d tokens, less than the context window %d: capping it", capacity, window)
        return capacity
    return config.max_model_len


def _engine_args(config: EngineConfig, model_dir, events_endpoint: str, kv_handoff: bool, spec=None):
    """vLLM's AsyncEngineArgs for `config` (the module docstring's table)."""
    import torch
    from vllm import AsyncEngineArgs
    from vllm.config import KVEventsConfig, KVTransferConfig

    from serving.engine.kv.cache import available_memory_bytes

    options = config.vllm or VLLMOptions()
    lora = {}
    if config.lora is not None:
        lora = dict(enable_lora=True, max_loras=options.max_loras, max_lora_rank=options.max_lora_rank)
    events = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=events_endpoint)
    # vLLM's CPU attention takes blocks of a multiple of 32 tokens: the next one up. The block
    # size it runs is the one the engine reports (ModelInfo.block_size), so the ingress hashes
    # prompts in its blocks and the router's predictions stay exact.
    block_size = config.block_size if config.device != "cpu" else -(-config.block_size // 32) * 32
    # The KV budget as kvrelay's engine reads it on a CPU (kv_cache_bytes, else a share of the
    # memory available); on a GPU vLLM's gpu_memory_utilization decides
    kv_bytes = config.kv_cache_bytes
    if kv_bytes is None and config.device == "cpu":
        kv_bytes = int(available_memory_bytes(torch.device("cpu")) * config.kv_cache_memory_fraction)
    max_model_len = config.max_model_len if spec is None else _capped_max_model_len(
        config.model_copy(update={"block_size": block_size}), spec, kv_bytes)
    transfer = None
    if kv_handoff:  # a pool that hands KV over: kvrelay's connector, a failed load recomputed
        if options.tensor_parallel_size > 1:
            raise ModelLoadError("vllm.tensor_parallel_size > 1 cannot hand KV off through kvrelay yet (each "
                                 "rank holds a slice of every block); run the P/D pools with 1, or mode: colocated")
        transfer = KVTransferConfig(kv_connector="KVRelayConnector", kv_connector_module_path="serving.engine.vllm.connector",
                                    kv_role="kv_both", kv_load_failure_policy="recompute")
    return AsyncEngineArgs(
        model=str(model_dir), tokenizer=str(model_dir), dtype="auto" if config.dtype == "auto" else config.dtype,
        block_size=block_size, max_model_len=max_model_len, max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens, enable_prefix_caching=config.enable_prefix_caching,
        seed=config.seed, enforce_eager=options.enforce_eager, tensor_parallel_size=options.tensor_parallel_size,
        gpu_memory_utilization=options.gpu_memory_utilization, quantization=options.quantization,
        kv_events_config=events if config.enable_prefix_caching else None,
        kv_cache_memory_bytes=kv_bytes, scheduling_policy="priority", kv_transfer_config=transfer,
        **lora,  # priority: the tiers', lower first
    )


class VLLMEngine:
    """AsyncEngine's surface over vLLM's AsyncLLM (module docstring). Built in the replica; the
    first generate starts vLLM's output loop on the caller's event loop."""

    exports_to_ranges = True  # export_into is a ShmRange: vLLM's cache is in its EngineCore process

    def __init__(self, config: EngineConfig, *, kv_handoff: bool = False):
        from serving.engine.modeling.loader import environment, load_model_spec, load_tokenizer, resolve_model_dir

        try:
            from vllm.v1.engine.async_llm import AsyncLLM
        except ImportError as exc:
            raise ModelLoadError(f"engine.backend: vllm needs vLLM installed (pip install 'kvrelay[vllm]'): {exc}") from exc
        self.config = config
        model_dir = resolve_model_dir(config.model)
        spec = load_model_spec(Path(model_dir))
        self._tokenizer = load_tokenizer(Path(model_dir))
        self._stats = _Stats()
        # KV events on an ipc socket of this engine's own (no port to collide with another replica)
        self._events_dir = tempfile.mkdtemp(prefix="kvrelay-vllm-")
        self._events_endpoint = f"ipc://{self._events_dir}/kv-events"
        args = _engine_args(config, model_dir, self._events_endpoint, kv_handoff, spec)
        # vLLM keeps a core more for a network connector's thread when one is set; kvrelay's copies
        # inside the step, so the cores are bound as without it, unless the operator says otherwise.
        # The EngineCore process vLLM starts now reads it (this process's environment is restored).
        reserved = {}
        if kv_handoff and config.device == "cpu" and "VLLM_CPU_NUM_OF_RESERVED_CPU" not in os.environ:
            reserved = {"VLLM_CPU_NUM_OF_RESERVED_CPU": str((config.vllm or VLLMOptions()).tensor_parallel_size)}
        started = time.monotonic()
        try:
            with environment(reserved):
                self._llm = AsyncLLM.from_engine_args(args, stat_loggers=[self._stats.logger_factory()])
        except Exception as exc:  # vLLM refuses the model or the options: say which, at load
            raise ModelLoadError(f"vLLM could not start {model_dir}: {type(exc).__name__}: {exc}") from exc
        max_model_len = self._llm.vllm_config.model_config.max_model_len
        block_size = self._llm.vllm_config.cache_config.block_size
        if block_size != config.block_size:
            logger.info("vLLM runs blocks of %d tokens (block_size %d asked): the engine reports %d", block_size,
                        config.block_size, block_size)
        config = self.config = config.model_copy(update={"block_size": block_size})
        self._num_blocks = self._llm.vllm_config.cache_config.num_gpu_blocks or 0  # vLLM's KV blocks
        dtype = str(self._llm.vllm_config.model_config.dtype).removeprefix("torch.")
        layout = KVLayout(spec.num_layers, spec.num_kv_heads, spec.head_dim, block_size, dtype, format="vllm")
        self.engine = _EngineView(config, spec.vocab_size, max_model_len, tuple(spec.eos_token_ids), layout)
        self._handoffs = Handoffs(layout, self._events_dir) if kv_handoff else None
        self._prefilling: dict[str, int] = {}  # requests before their first output -> prompt tokens
        # the same requests -> (priority, arrival number): vLLM's waiting queue is in that order, so
        # its length says which have not started (_still_waiting)
        self._queue_order: dict[str, tuple[int, int]] = {}
        self._num_in_vllm = 0  # requests handed to vLLM and not ended here
        self._arrivals = itertools.count()
        self._num_queue_timeouts = 0
        self._prefill_rate = PrefillRate()  # recent prefills' prompt tokens/s (vLLM's timestamps)
        self._lora_ids: dict[tuple[str, str], int] = {}
        self._lora_next = itertools.count(1)
        self._kv_callbacks: list[Callable] = []
        self._lora_paths: dict[str, str] = dict(config.lora.adapters) if config.lora is not None else {}
        self._events = KVEventRelay(self._events_endpoint, config.block_size, self._lora_paths,
                                     self._notify) if config.enable_prefix_caching else None
        self._dead: BaseException | None = None
        logger.info("vLLM %s started in %.1fs: %s, max_model_len %d", self.version, time.monotonic() - started,
                    model_dir, max_model_len)

    @property
    def version(self) -> str:
        import vllm

        return vllm.__version__

    @property
    def tokenizer(self):
        return self._tokenizer

    @property
    def is_alive(self) -> bool:
        return self._dead is None and not self._llm.errored

    def stats(self) -> EngineStats:
        s = self._stats
        return EngineStats(
            num_running=s.num_running, num_waiting=s.num_waiting, num_blocks=self._num_blocks,
            num_free_blocks=round((1.0 - s.kv_cache_usage) * self._num_blocks),
            kv_usage=s.kv_cache_usage, num_preemptions=s.num_preemptions,
            prefix_cache_query_tokens=s.prefix_queries, prefix_cache_hit_tokens=s.prefix_hits,
            num_computed_tokens=s.num_prompt + s.num_generated, num_generated_tokens=s.num_generated,
            num_held_exports=self._handoffs.num_held if self._handoffs else 0,
            num_expired_imports=self._handoffs.num_expired_imports if self._handoffs else 0,
            num_queued_prefill_tokens=sum(self._prefilling.values()), prefill_tokens_per_s=self._prefill_rate.tokens_per_s,
            kernel_path="vllm", kernel_reason=f"vLLM {self.version}", num_queue_timeouts=self._num_queue_timeouts,
            decode_steps=s.decode_steps, decode_step_rows=s.decode_rows, decode_step_s=s.decode_s,
        )

    def _first_output(self, request_id: str, out, metrics: RequestMetrics, num_prompt_tokens: int) -> None:
        """A request's first output: its prompt is no longer queued for prefill; when vLLM's own
        timestamps came with it (its EngineCore's monotonic clock, the node's), the TTFT's queue
        and prefill parts, and the prefill rate, as kvrelay's engine measures them."""
        self._prefilling.pop(request_id, None)
        self._queue_order.pop(request_id, None)
        stamps = getattr(out, "metrics", None)
        if stamps is None or not stamps.scheduled_ts:
            return
        metrics.first_scheduled_time = stamps.scheduled_ts
        computed = num_prompt_tokens - (out.num_cached_tokens or 0)
        seconds = stamps.first_token_ts - stamps.scheduled_ts
        if computed >= _MIN_RATE_TOKENS:
            self._prefill_rate.add(computed, seconds)

    async def generate(
        self, request_id: str, *, params: SamplingParams, prompt_token_ids: list[int], priority: int = 0,
        cache_salt: str | None = None, hold_kv: bool = False, kv_payload: KVPayload | None = None,
        lora_name: str | None = None, lora_path: str | None = None, prior_output_token_ids: list[int] | None = None,
        keep_cached: bool = True, export_into: ShmRange | None = None, export_until: float | None = None,
        arrival_time: float | None = None, expected_cached_tokens: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """As AsyncEngine.generate. Tokens generated elsewhere (`prior_output_token_ids`: a stream
        resumed on this replica after another died, or a hand-off's first token) continue as part
        of the prompt, counted against max_tokens (a structured output cannot resume here). A
        prompt only scored (max_tokens 0, which vLLM refuses) asks vLLM for one token and returns
        none. A hand-off (module docstring): `hold_kv` saves the prompt's KV into `export_into`
        (a range of the node's arena, written only before `export_until`) or a staging range of
        this replica's, for export_kv; `kv_payload` is loaded before the first step."""
        from vllm.exceptions import VLLMClientError
        from vllm.inputs import TokensPrompt

        if not prompt_token_ids:
            raise InvalidRequestError("prompt", "must not be empty")
        prior = list(prior_output_token_ids or [])
        if prior and params.guided is not None:
            raise InvalidRequestError("prior_output_token_ids", "a structured output cannot resume on the vLLM engine")
        scores_only = params.max_tokens == 0
        asked = params
        if prior or scores_only:
            max_tokens = None if params.max_tokens is None else max(params.max_tokens - len(prior), 0)
            asked = dataclasses.replace(params, max_tokens=1 if scores_only else max_tokens,
                                        min_tokens=max(params.min_tokens - len(prior), 0),
                                        prompt_logprobs=None if prior else params.prompt_logprobs)
        metrics = RequestMetrics(arrival_time if arrival_time is not None else time.monotonic())
        if asked.max_tokens == 0:  # the tokens before used it all
            yield RequestOutput(request_id, [CompletionOutput(i, "", [], None, "length") for i in range(params.n)],
                                True, len(prompt_token_ids), 0, metrics)
            return
        handoff = None
        if hold_kv or kv_payload is not None:
            if self._handoffs is None:
                raise InvalidRequestError("hold_kv" if hold_kv else "kv_payload", "this vLLM engine hands no KV over: "
                                          "only a prefill or decode pool's (mode: disaggregated) does")
            handoff = self._handoffs.begin(prompt_token_ids, prior, hold_kv, kv_payload, export_into, export_until)
        elif export_into is not None:
            raise InvalidRequestError("export_into", "needs hold_kv")
        prompt = TokensPrompt(prompt_token_ids=list(prompt_token_ids) + prior)
        if cache_salt:
            prompt["cache_salt"] = cache_salt
        copies = params.n if _is_greedy(params) else 1  # greedy: every choice is the first
        finished = yielded = seen = False
        # queued until its first output: the prefill tokens this replica owes, less what the worker
        # expects cached (vLLM says what it found only with that output; counting the cached part
        # too showed a prefix's holder busy with work it never had, LLMEngine.stats)
        expected = min(max(0, expected_cached_tokens), len(prompt_token_ids) - 1) if not prior else 0
        self._prefilling[request_id] = len(prompt_token_ids) + len(prior) - expected
        self._queue_order[request_id] = (priority, next(self._arrivals))
        self._num_in_vllm += 1
        # max_queue_wait_s, as kvrelay's scheduler has it: a request still waiting for its first
        # step then ends with queue_timeout; one continued from tokens generated elsewhere waits on
        limit = self.config.max_queue_wait_s
        deadline = None if limit is None or prior or kv_payload is not None else metrics.arrival_time + limit
        try:
            stream = self._llm.generate(prompt, vllm_sampling_params(asked, handoff.params() if handoff else None),
                                        request_id, priority=priority, lora_request=self._lora(lora_name, lora_path))
            async for out in self._until_started(stream, request_id, deadline):
                if out is None:  # waited past max_queue_wait_s without starting: vLLM dropped it
                    finished = True
                    self._num_queue_timeouts += 1
                    metrics.finished_time = time.monotonic()
                    yield RequestOutput(request_id, [CompletionOutput(i, "", [], None, "queue_timeout") for i in range(params.n)],
                                        True, len(prompt_token_ids), 0, metrics)
                    return
                if not seen:
                    seen = True
                    self._first_output(request_id, out, metrics, len(prompt_token_ids) + len(prior))
                finished = out.finished
                now = time.monotonic()
                if metrics.first_token_time is None and any(c.token_ids for c in out.outputs):
                    metrics.first_token_time = now
                if out.finished:
                    metrics.finished_time = now
                if any(c.finish_reason == "error" for c in out.outputs):
                    raise RequestFailedError(f"request {request_id} failed in vLLM (finish_reason error); no other "
                                             "request was affected", request_id=request_id, stage="vllm")
                if handoff is not None and (handoff.spec.op == "load" or out.finished):
                    self._handoffs.done(request_id, handoff, prompt_token_ids, finished=out.finished)
                    handoff = None
                if scores_only and not out.finished:
                    continue  # its one token is not wanted: the final output says length, with none
                choices = [
                    CompletionOutput(c.index + copy, "" if scores_only else c.text, [] if scores_only else list(c.token_ids),
                                     None if scores_only else _logprobs(c.token_ids, c.logprobs, params.logprobs or 0),
                                     "length" if scores_only else c.finish_reason, None if scores_only else c.stop_reason)
                    for c in out.outputs for copy in range(copies)
                ]
                yielded = True
                yield RequestOutput(request_id, choices, out.finished, len(prompt_token_ids), out.num_cached_tokens or 0,
                                    metrics, _prompt_logprobs(prompt_token_ids, out.prompt_logprobs, params.prompt_logprobs))
        except InvalidRequestError:
            raise
        except (ValueError, VLLMClientError) as exc:
            if yielded:  # mid-stream: vLLM's own failure, not the request's fields
                raise RequestFailedError.caused_by(request_id, "vllm", exc) from exc
            raise InvalidRequestError(getattr(exc, "parameter", None) or "request", str(exc)) from exc  # its checks
        except RequestFailedError:
            raise
        except Exception as exc:
            if self._llm.errored:
                self._dead = exc
                raise EngineDeadError(f"the vLLM engine stopped: {type(exc).__name__}: {exc}") from exc
            raise RequestFailedError.caused_by(request_id, "vllm", exc) from exc  # EngineGenerateError, ...
        finally:
            if not finished and not self._llm.errored:  # its caller went (cancelled, or closed this stream)
                try:
                    await self._llm.abort(request_id)  # vLLM stops it now (a request it never took: nothing)
                except Exception:  # noqa: BLE001 - the request is gone either way
                    logger.warning("aborting %s in vLLM failed", request_id, exc_info=True)
            self._prefilling.pop(request_id, None)
            self._queue_order.pop(request_id, None)
            self._num_in_vllm -= 1
            if handoff is not None:  # ended early (its caller went, or a failure): nothing is held
                self._handoffs.done(request_id, handoff, prompt_token_ids, finished=False)

    async def _until_started(self, stream, request_id: str, deadline: float | None):
        """vLLM's outputs of `request_id`; with a `deadline` (monotonic), a None instead of them
        when it passes with the request still in vLLM's waiting queue (it is aborted there first).
        A request that has started is never dropped: only the first output is waited for so."""
        outputs = aiter(stream)
        if deadline is not None:
            first = asyncio.ensure_future(anext(outputs))
            try:
                while True:
                    done, _ = await asyncio.wait({first}, timeout=max(deadline - time.monotonic(), 0.0))
                    if done:
                        break
                    waiting = self._still_waiting(request_id)
                    if waiting is False:
                        await first
                        break
                    if waiting:
                        await self._llm.abort(request_id)
                        first.cancel()
                        await asyncio.gather(first, return_exceptions=True)
                        yield None
                        return
                    deadline = time.monotonic() + 0.1  # the stats do not count it yet: look again
            except BaseException:
                first.cancel()
                raise
            try:
                out = first.result()
            except StopAsyncIteration:
                return
            yield out
        async for out in outputs:
            yield out

    def _still_waiting(self, request_id: str) -> bool | None:
        """Whether a request without output is still in vLLM's waiting queue (None: the latest
        scheduler stats do not count every request handed to vLLM yet, so they cannot say). vLLM's
        queue takes requests by (priority, arrival), so of those without output the last
        `num_waiting` in that order are the ones waiting; requests preempted back into the queue
        count there too, which can only make one look waiting."""
        mine = self._queue_order.get(request_id)
        if mine is None:
            return False
        if self._stats.num_running + self._stats.num_waiting < self._num_in_vllm:
            return None
        order = sorted(self._queue_order.values())
        return order.index(mine) >= len(order) - self._stats.num_waiting

    def _lora(self, name: str | None, path: str | None):
        if name is None:
            return None
        from vllm.lora.request import LoRARequest

        self._check_lora(name)
        path = path or self.config.lora.adapters.get(name)
        if path is None:
            raise InvalidRequestError("model", f"unknown adapter {name!r}")
        key = (name, str(path))  # a name loaded again from another path is another adapter to vLLM
        if key not in self._lora_ids:
            self._lora_ids[key] = next(self._lora_next)
        self._lora_paths[name] = path  # the relay hashes this adapter's blocks with its path
        return LoRARequest(name, self._lora_ids[key], path)

    # ---- the P/D hand-off (vllm_handoff.py) --------------------------------------------------
    async def export_kv(self, request_id: str, *, release: bool = True) -> KVPayload:
        """A finished `hold_kv` request's saved KV (KeyError: nothing was saved)."""
        if self._handoffs is None:
            raise KeyError(f"no held KV for request {request_id!r}: this engine hands no KV over")
        return self._handoffs.export(request_id, release=release)

    async def release_kv(self, request_id: str) -> bool:
        return self._handoffs is not None and self._handoffs.release(request_id)

    def release_kv_soon(self, request_id: str) -> None:
        if self._handoffs is not None:
            self._handoffs.release(request_id)

    async def abort(self, request_id: str) -> bool:
        await self._llm.abort(request_id)
        return True

    def subscribe_kv_events(self, callback: Callable) -> None:
        """`callback(events)` with kvrelay's KV events, on the relay's thread (as AsyncEngine's
        on its step thread)."""
        self._kv_callbacks.append(callback)

    def _notify(self, events: list) -> None:
        for callback in self._kv_callbacks:
            try:
                callback(events)
            except Exception:  # noqa: BLE001 - a subscriber's failure is its own
                logger.exception("a KV event subscriber failed")

    def _check_lora(self, name: str) -> None:
        if self.config.lora is None:
            raise InvalidRequestError("model", f"adapter {name!r}: this engine serves no LoRA adapters (EngineConfig.lora)")

    async def check_adapter(self, name: str, path: str) -> None:
        self._check_lora(name)
        config = Path(path) / "adapter_config.json"
        if not config.is_file():
            raise InvalidRequestError("lora_path", f"{config}: no adapter_config.json")

    def shutdown(self, timeout_s: float = 10.0) -> None:
        self._llm.shutdown()
        if self._events is not None:
            self._events.close()
        shutil.rmtree(self._events_dir, ignore_errors=True)
