"""LLMEngine: the synchronous core. add / step / abort, plus KV export and import.

One `step()` = schedule → (write imported KV) → one forward pass → sample → detokenize and check
stops → free what finished. Everything here runs on one thread; AsyncEngine drives it from a
background thread for asyncio callers (and implements the engine contract, contract.py).

LLMEngine wires parts of one job each:

    intake.py             admission: check, build the choices, adapter slots, grammars compiling
    request_table.py      the requests held, and the one way each leaves (finish, end, fail)
    engine_step.py        the scheduling step: schedule, forward, score, sample
    output_processing.py  sampled tokens into deltas: grammar, detokenize, stop checks, forks
    spec_verification.py  speculative proposals verified against their rows, and proposed
    kv_exchange.py        KV export (held prompts) and import (a payload into its blocks)

A failure that belongs to one request (writing its imported KV, sampling its row, detokenizing or
stop-checking its token) ends that request alone: its blocks are freed, the error waits in
`take_failures()`, and the rest of the batch goes on. A failure with no culprit (the forward pass,
scheduling) raises out of `step()`; the caller must treat the engine as dead.

A request with `n > 1` is one sequence per choice. Choice 0 computes the prompt; the others wait
and, once it is done, start from its full prompt blocks (shared by reference count), computing
only the partial last block themselves.

Prompt logprobs (`params.prompt_logprobs`) are scored by choice 0 from the rows of its prompt
chunks that the model runner keeps beside the sampling rows (prompt_logprobs.py), and leave with
the request's first output once the whole prompt is scored. A request with `max_tokens=0` ends
when its prompt is computed: finish_reason "length", no tokens, every choice.

A structured output (`params.guided`) needs its grammar compiled (sampling/grammar.py; intake.py
says how a request waits for it). Each choice has its own matcher, which first replays the tokens
generated elsewhere (`prior_output_token_ids`: the prefill worker's first token, or a resumed
stream's), so a request continues in its grammar across the prefill→decode hand-off. The ingress
compiles every spec before it sends it, so over HTTP a spec that fails is a 400 naming the
request's field.

With `config.speculative` (spec/speculative.py), a sequence gets proposed tokens after each of its
steps, and its next step verifies them (spec_verification.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from serving.engine.config import EngineConfig
from serving.engine.contract import EngineRequest
from serving.engine.engine_step import StepRunner
from serving.engine.errors import InvalidRequestError, ModelLoadError, RequestFailedError
from serving.engine.intake import Intake
from serving.engine.kv.block_manager import BlockManager
from serving.engine.kv.events import KVEvent
from serving.engine.kv.held import HeldKV
from serving.engine.kv.hybrid_block_manager import HybridBlockManager
from serving.engine.kv.payload import KVLayout, KVPayload
from serving.engine.kv_exchange import KVExchange
from serving.engine.modeling.lora import LoRAManager
from serving.engine.modeling.runner import ModelRunner
from serving.engine.output_processing import OutputProcessor
from serving.engine.outputs import EngineStats, RequestOutput, merge_outputs
from serving.engine.params import SamplingParams
from serving.engine.prefill_rate import PrefillRate
from serving.engine.request import RequestStatus
from serving.engine.request_table import RequestTable
from serving.engine.sampling.grammar import GrammarCompiler
from serving.engine.sampling.sampler import Sampler
from serving.engine.scheduler import Scheduler
from serving.engine.setup import build_parts
from serving.engine.spec.speculative import Speculator
from serving.engine.spec_verification import SpecVerifier
from serving.engine.step_costs import measure_step_costs
from serving.engine.validation import ModelInfo

__all__ = ["DecodeSteps", "LLMEngine", "engine_stats"]

logger = logging.getLogger(__name__)


@dataclass
class DecodeSteps:
    """Decode steps run back to back (the step loop adds them: async_engine.py): how many, the
    sequences they decoded, and each one's period, from its start to the next step's start. A
    period is what a stream waits for its next token: the step, the outputs' hand-over, and any
    CPU the replica's other threads took meanwhile. Only steps that computed no prompt token,
    followed by another step with no wait for work between them, count. The autoscaling planner
    reads its decode correction from them: a step's time is linear in its batch, so
    seconds / (base x steps + per_seq x rows) is the multiplier on the profile with no Jensen
    gap (router/autoscaling/planner.py)."""

    steps: int = 0
    rows: int = 0
    seconds: float = 0.0

    def add(self, period_s: float, rows: int) -> None:
        self.steps += 1
        self.rows += rows
        self.seconds += period_s


class LLMEngine:
    """The engine's parts, wired (module docstring); its methods hand each call to the part whose job it is."""

    def __init__(self, config: EngineConfig | None = None):
        parts = build_parts(config or EngineConfig())  # model, dtype, kernels, KV cache (setup.py)
        self.config, self.device, self.spec, self.tokenizer = parts.config, parts.device, parts.spec, parts.tokenizer
        self.dtype_choice, self.kernels, self.model, self.kv_cache = parts.dtype_choice, parts.kernels, parts.model, parts.kv_cache
        self.bytes_per_token, self.max_model_len = parts.bytes_per_token, parts.max_model_len
        config, spec = self.config, self.spec
        self.block_manager = _block_manager(config, self.kv_cache, spec)
        self.scheduler = _scheduler(config, self.block_manager, spec)
        self.runner = ModelRunner(self.model, self.kv_cache)
        self.loras = LoRAManager(config.lora.adapters, config.lora.max_loras, spec, self.model.dtype,
                                 self.device) if config.lora is not None else None
        self.runner.lora_manager = self.loras
        self.vocab_size = self.model.vocab_size
        # Speculative decoding (spec/speculative.py); None: off, every sequence decodes one token a step
        self.speculator = _speculator(config, parts, self.max_model_len) if config.speculative else None
        self.eos_token_ids = spec.eos_token_ids
        self.kv_layout = KVLayout(
            spec.num_layers, spec.num_kv_heads, spec.head_dim, config.block_size, config.dtype,
            self.kv_cache.sliding_layers,
        )
        self.held_kv = HeldKV(self.block_manager, self.kv_cache, self.kv_layout)  # hold_kv requests' KV
        self.kv = KVExchange(self.held_kv, self.block_manager, self.kv_cache, config.block_size, self.bytes_per_token)
        self.table = RequestTable(self.scheduler, self.block_manager, self.held_kv, self.loras, self.speculator)
        self.compiling, self.lora_waiting = self.table.compiling, self.table.lora_waiting
        self.intake = Intake(self, self.table)
        self.output_processor = OutputProcessor(self.table, Sampler(self.vocab_size, seed=config.seed),
                                                self.block_manager, self.scheduler, self.eos_token_ids, self.max_model_len)
        self.prefill_rate = PrefillRate()  # steps' prefill tokens/s, for the routers (prefill_rate.py)
        self.decode_steps = DecodeSteps()
        self.stepper = StepRunner(
            table=self.table, intake=self.intake, scheduler=self.scheduler, runner=self.runner,
            block_manager=self.block_manager, kv=self.kv, processor=self.output_processor, prefill_rate=self.prefill_rate,
            verifier=SpecVerifier(self.speculator, self.table, self.output_processor, self.block_manager, self.scheduler),
        )

    # ---- requests (intake.py, request_table.py) ------------------------------------------------
    def add_request(
        self, request_id: str, prompt: str | None = None, params: SamplingParams | None = None, *,
        prompt_token_ids: list[int] | None = None, **fields,
    ) -> int:
        """`add` for a caller of its own (tests, benchmarks): a prompt as text or ids, the rest
        EngineRequest's fields by name."""
        if prompt_token_ids is None:
            if prompt is None:
                raise InvalidRequestError("prompt", "give a prompt or prompt_token_ids")
            prompt_token_ids = self.tokenizer(prompt).input_ids
        return self.add(EngineRequest(request_id, list(prompt_token_ids), params or SamplingParams(), **fields))

    def add(self, request: EngineRequest) -> int:
        """Validate and queue a request (contract.py says what each field asks); returns its
        prompt length. `lora_path` registers the adapter under `lora_name` first (an adapter
        loaded at run time reaches a worker this way; LoRAManager.register says when that is
        refused). `export_into` (with hold_kv) is a contiguous tensor of exactly
        kv_payload_bytes(len(prompt)) bytes on the cache's device, e.g. a shared-memory arena range."""
        return self.intake.add(request)

    def abort_request(self, request_id: str) -> bool:
        """Stop a request now and free its blocks; its final output says finish_reason 'abort'."""
        was_held = self.held_kv.release(request_id)
        request = self.table.requests.get(request_id)
        if request is None:
            return was_held
        self.table.pending_outputs.append(self.table.end(request, RequestStatus.FINISHED_ABORTED))
        return True

    def take_failures(self) -> list[RequestFailedError | InvalidRequestError]:
        """The requests that failed on their own since the last call (each is gone, its blocks
        freed): the caller tells each one's client. An InvalidRequestError (its `request_id` set)
        is the client's to fix: its adapter was replaced or its files went bad while it waited."""
        return self.table.take_failures()

    def has_unfinished_requests(self) -> bool:
        return bool(self.table.requests) or bool(self.table.pending_outputs)

    @property
    def grammars(self) -> GrammarCompiler:
        """This process's compiler for the engine's tokenizer (shared with an in-process ingress)."""
        return self.intake.grammars

    def check_adapter(self, name: str, path: str) -> None:
        """Whether the PEFT adapter at `path` loads on this engine's model (POST
        /v1/load_lora_adapter asks before any request names it); LoRAError names file and field."""
        if self.loras is None:
            raise InvalidRequestError("lora_name", "this engine serves no LoRA adapters: set engine.lora "
                                      "(lora.allow_runtime_updates for adapters loaded at run time)")
        try:
            self.loras.check(name, path)
        except ModelLoadError as exc:  # LoRAError: names the file and the field
            raise InvalidRequestError("lora_path", str(exc)) from exc

    # ---- the step (engine_step.py) -----------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        return self.stepper.step()

    @property
    def is_stalled(self) -> bool:
        """The last step could schedule nothing: only a command, a compiled grammar or a queue timeout changes that."""
        return self.stepper.is_stalled

    # ---- KV export / import (kv_exchange.py) -------------------------------------------------
    def export_kv(self, request_id: str, *, release: bool = True, into: torch.Tensor | None = None) -> KVPayload:
        return self.kv.export(request_id, release=release, into=into)

    def release_kv(self, request_id: str) -> bool:
        return self.kv.release(request_id)

    def kv_payload_bytes(self, num_tokens: int) -> int:
        return self.kv.payload_bytes(num_tokens)

    # ---- observability -----------------------------------------------------------------------
    def model_info(self) -> ModelInfo:
        return ModelInfo(vocab_size=self.vocab_size, max_model_len=self.max_model_len,
                         eos_token_ids=tuple(self.eos_token_ids), block_size=self.config.block_size)

    def take_kv_events(self) -> list[KVEvent]:
        return self.block_manager.take_events()

    def stats(self) -> EngineStats:
        return engine_stats(self)

    # ---- convenience -------------------------------------------------------------------------
    def generate(
        self,
        prompts: list[str] | list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts to completion; returns one RequestOutput per prompt with full choices."""
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        ids = []
        for i, (prompt, p) in enumerate(zip(prompts, params_list)):
            request_id = f"generate-{id(prompts)}-{i}"
            if isinstance(prompt, str):
                self.add_request(request_id, prompt, p)
            else:
                self.add_request(request_id, params=p, prompt_token_ids=prompt)
            ids.append(request_id)
        merged: dict[str, RequestOutput] = {}
        while self.has_unfinished_requests():
            for out in self.step():
                merged[out.request_id] = merge_outputs(merged.get(out.request_id), out)
            if self.is_stalled:
                self.compiling.wait()
        failures = self.take_failures()
        if failures:
            raise failures[0]
        return [merged[i] for i in ids]


def _block_manager(config: EngineConfig, kv_cache, spec) -> BlockManager | HybridBlockManager:
    block_manager = BlockManager(kv_cache.num_blocks, config.block_size, enable_prefix_caching=config.enable_prefix_caching)
    if kv_cache.sliding_layers:  # interleaved sliding layers: their KV in a pool of its own
        block_manager = HybridBlockManager(block_manager, BlockManager(
            kv_cache.num_sliding_blocks, config.block_size, enable_prefix_caching=config.enable_prefix_caching,
        ), spec.hybrid_window)
    return block_manager


# The scheduler's limits, as EngineConfig names them
_SCHEDULER_LIMITS = ("max_num_seqs", "max_num_batched_tokens", "long_prefill_token_threshold",
                     "max_long_partial_prefills", "max_queue_wait_s", "priority_aging_s")


def _scheduler(config: EngineConfig, block_manager, spec) -> Scheduler:
    return Scheduler(
        block_manager, **{name: getattr(config, name) for name in _SCHEDULER_LIMITS},
        # blocks leave a sequence as its window moves (the sliding pool's only, with full layers too)
        sliding_window=spec.every_layer_window or spec.hybrid_window,
    )


def _speculator(config: EngineConfig, parts, max_model_len: int) -> Speculator:
    num_speculative = config.speculative.num_speculative_tokens
    return Speculator(
        config.speculative, max_model_len, step_costs=lambda: measure_step_costs(
            parts.model, parts.kv_cache, max_rows=min(config.max_num_batched_tokens // (1 + num_speculative), config.max_num_seqs),
            num_speculative_tokens=num_speculative,
        ), target=parts,
    )


def engine_stats(engine: LLMEngine) -> EngineStats:
    """The engine's figures now, by where each comes from: its queues, KV blocks, counters, and what runs."""
    bm, scheduler, table, loras, steps = engine.block_manager, engine.scheduler, engine.table, engine.loras, engine.decode_steps
    queued = (*scheduler.waiting, *scheduler.running)
    return EngineStats(
        # queues: the scheduler's, and the requests waiting for a grammar or an adapter slot
        num_running=len(scheduler.running),
        num_waiting=len(scheduler.waiting) + len(table.compiling) + len(table.lora_waiting),
        num_preemptions=scheduler.num_preemptions, num_expired_imports=scheduler.num_expired_imports,
        num_queue_timeouts=scheduler.num_queue_timeouts,
        num_queued_prefill_tokens=sum(
            max(0, seq.num_prompt_tokens - max(seq.num_computed_tokens, seq.expected_cached_tokens)) for seq in queued
        ) + sum(table[r].num_prompt_tokens for r in table.lora_waiting),
        # KV blocks and the prefix cache
        num_blocks=bm.num_blocks, num_free_blocks=bm.num_free_blocks, kv_usage=bm.usage,
        prefix_cache_query_tokens=bm.num_prefix_query_tokens, prefix_cache_hit_tokens=bm.num_prefix_hit_tokens,
        num_held_exports=len(engine.held_kv),
        # counters and rates of the steps
        num_computed_tokens=engine.stepper.num_computed_tokens,
        num_generated_tokens=engine.output_processor.num_generated_tokens,
        prefill_tokens_per_s=engine.prefill_rate.tokens_per_s,
        decode_steps=steps.steps, decode_step_rows=steps.rows, decode_step_s=steps.seconds,
        # what runs, and why
        dtype=engine.dtype_choice.dtype, dtype_reason=engine.dtype_choice.reason,
        kernel_path=engine.kernels.path.value, kernel_reason=engine.kernels.reason,
        linear_path=engine.model.linear_choice.summary, deterministic=engine.model.invariance_reason,
        lora_resident=tuple(loras.resident) if loras is not None else (),
        lora_load_s=loras.load_s if loras is not None else 0.0,
        lora_slots_free=loras.slots_free if loras is not None else -1,
        **(engine.speculator.stats() if engine.speculator is not None else {}),
    )
