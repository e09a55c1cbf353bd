"""LLMEngine: the synchronous core. add_request / step / abort, plus KV export and import.

One `step()` = schedule → (write imported KV) → one forward pass → sample → detokenize and check
stops → free what finished. Everything here runs on one thread; AsyncEngine drives it from a
background thread for asyncio callers.

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

A structured output (`params.guided`) needs its grammar compiled (serving/engine/sampling/grammar.py): a
cached one starts at once; otherwise the request waits, compiling, outside the scheduler while
the compiler's threads work and the batch goes on; when the grammar is ready it is queued as any
request (its queue wait counts from its arrival). Each choice has its own matcher, which first
replays the tokens generated elsewhere (`prior_output_token_ids`: the prefill worker's first
token, or a resumed stream's), so a request continues in its grammar across the prefill→decode
hand-off. A spec that fails to compile here ends its request with the InvalidRequestError naming
`guided` (take_failures); the ingress compiles every spec before it sends it, so over HTTP that is
a 400 naming the request's field.

With `config.speculative` (speculative.py), a sequence gets proposed
tokens after each of its steps, and its next step verifies them: its 1 + k sampling rows are
sampled as ones, each row with the proposals before it as output so far (and that position's
seed key); the proposals the rows' tokens agree with, then the first disagreeing row's token,
are appended one at a time through the usual checks (so a stop ends the sequence at the first
token that triggers it), into one delta; KV slots of rejected proposals are dropped. For sampled
rows that is rejection sampling with a one-hot draft (speculative.py says why it is exact). A
structured output's row m is masked by its grammar after the first m proposals (SpeculativeMask).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from serving.engine.config import EngineConfig
from serving.engine.errors import InvalidRequestError, ModelLoadError, RequestFailedError
from serving.engine.kv.block_hash import block_extra_keys
from serving.engine.kv.block_manager import BlockManager
from serving.engine.kv.events import KVEvent
from serving.engine.kv.held import HeldKV
from serving.engine.kv.hybrid_block_manager import HybridBlockManager
from serving.engine.kv.payload import KVLayout, KVPayload
from serving.engine.modeling.lora import LoRAManager
from serving.engine.modeling.runner import ModelRunner
from serving.engine.outputs import CompletionOutput, EngineStats, RequestMetrics, RequestOutput, TokenLogprob, merge_outputs
from serving.engine.params import SamplingParams
from serving.engine.prefill_rate import PrefillRate
from serving.engine.request import RequestStatus, Sequence
from serving.engine.sampling.detokenizer import IncrementalDetokenizer
from serving.engine.sampling.grammar import GrammarCompiler, GrammarMatcher, PendingGrammars, SpeculativeMask, compiler_for
from serving.engine.sampling.prompt_logprobs import score_span
from serving.engine.sampling.sampler import LogitBias, Sampler, SamplingRow
from serving.engine.sampling.stop_checker import StopChecker
from serving.engine.scheduler import Scheduler
from serving.engine.setup import build_parts
from serving.engine.spec.speculative import Speculator
from serving.engine.step_costs import measure_step_costs
from serving.engine.validation import check_request

__all__ = ["LLMEngine"]

logger = logging.getLogger(__name__)

_MIN_RATE_TOKENS = 32  # steps with fewer prefill tokens say more about overhead than about rate


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


@dataclass
class _SeqState:
    seq: Sequence
    detokenizer: IncrementalDetokenizer | None  # None: the caller detokenizes (params.detokenize False)
    stop_checker: StopChecker
    finish_reason: str | None = None
    matcher: GrammarMatcher | None = None  # its place in params.guided's grammar


@dataclass
class _Request:
    request_id: str
    seqs: list[_SeqState]
    num_prompt_tokens: int
    arrival_time: float
    waiting_children: list[Sequence] = field(default_factory=list)
    logit_bias: LogitBias | None = None  # its params' logit_bias as tensors, for every step's rows
    prompt_logprobs_sent: bool = False  # its prompt logprobs went out (in its first output after them)

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.seqs)


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None):
        parts = build_parts(config or EngineConfig())  # model, dtype, kernels, KV cache (setup.py)
        self.config, self.device, self.spec, self.tokenizer = parts.config, parts.device, parts.spec, parts.tokenizer
        self.dtype_choice, self.kernels, self.model, self.kv_cache = parts.dtype_choice, parts.kernels, parts.model, parts.kv_cache
        self.bytes_per_token, self.max_model_len = parts.bytes_per_token, parts.max_model_len
        config, spec, num_blocks = self.config, self.spec, self.kv_cache.num_blocks

        self.block_manager = BlockManager(
            num_blocks, config.block_size, enable_prefix_caching=config.enable_prefix_caching
        )
        if self.kv_cache.sliding_layers:  # interleaved sliding layers: their KV in a pool of its own
            self.block_manager = HybridBlockManager(self.block_manager, BlockManager(
                self.kv_cache.num_sliding_blocks, config.block_size, enable_prefix_caching=config.enable_prefix_caching,
            ), spec.hybrid_window)
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            long_prefill_token_threshold=config.long_prefill_token_threshold,
            max_long_partial_prefills=config.max_long_partial_prefills,
            max_queue_wait_s=config.max_queue_wait_s,
            priority_aging_s=config.priority_aging_s,
            # blocks leave a sequence as its window moves (the sliding pool's only, with full layers too)
            sliding_window=spec.every_layer_window or spec.hybrid_window,
        )
        self.runner = ModelRunner(self.model, self.kv_cache)
        self.loras = LoRAManager(config.lora.adapters, config.lora.max_loras, spec, self.model.dtype,
                                 self.device) if config.lora is not None else None
        self.runner.lora_manager = self.loras
        self.vocab_size = self.model.vocab_size
        self.sampler = Sampler(self.vocab_size, seed=config.seed)
        # Speculative decoding (speculative.py); None: off, every sequence decodes one token a step
        self.speculator = Speculator(
            config.speculative, self.max_model_len, step_costs=lambda: measure_step_costs(
                self.model, self.kv_cache, max_rows=min(config.max_num_batched_tokens // (1 + config.speculative.num_speculative_tokens), config.max_num_seqs),
                num_speculative_tokens=config.speculative.num_speculative_tokens,
            ), target=parts,
        ) if config.speculative else None
        self.eos_token_ids = spec.eos_token_ids
        self.kv_layout = KVLayout(
            spec.num_layers, spec.num_kv_heads, spec.head_dim, config.block_size, config.dtype,
            self.kv_cache.sliding_layers,
        )
        self._requests: dict[str, _Request] = {}
        self.held_kv = HeldKV(self.block_manager, self.kv_cache, self.kv_layout)  # hold_kv requests' KV
        self._pending_outputs: list[RequestOutput] = []
        self._failures: list[RequestFailedError | InvalidRequestError] = []  # requests a step ended on their own error
        self.num_computed_tokens = 0
        self.num_generated_tokens = 0
        self.is_stalled = False  # the last step could schedule nothing (see step)
        self.prefill_rate = PrefillRate()  # steps' prefill tokens/s, for the routers (prefill_rate.py)
        # Sequences the last step decoded when it computed no prompt token, else 0 (the step
        # loop's decode account, DecodeSteps)
        self.last_decode_rows = 0
        self.decode_steps = DecodeSteps()
        self._grammars: GrammarCompiler | None = None  # built on the first structured output
        # Requests waiting for their grammar; its on_ready wakes an AsyncEngine's step loop.
        self.compiling = PendingGrammars()
        # Requests whose LoRA adapter has no slot yet (every slot held by running requests): they
        # wait here, strictly first come first served (a LoRA request arriving while any waits
        # goes behind it, so slots drain to it), and queue once one frees; or leave after
        # max_queue_wait_s, as the scheduler's queue does (lora.py).
        self.lora_waiting: dict[str, tuple[str, str]] = {}  # request id -> (adapter name, its path then)

    # ---- requests ----------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | None = None,
        params: SamplingParams | None = None,
        *,
        prompt_token_ids: list[int] | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        hold_kv: bool = False,
        kv_payload: KVPayload | None = None,
        prior_output_token_ids: list[int] | None = None,
        export_into: torch.Tensor | None = None,
        export_until: float | None = None,
        keep_cached: bool = True,
        lora_name: str | None = None,
        lora_path: str | None = None,
        expected_cached_tokens: int = 0,
    ) -> int:
        """Validate and queue a request; returns its prompt length.

        `lora_name`: the LoRA adapter (EngineConfig.lora) it runs with; None: the base model.
        `lora_path`: its PEFT directory, registered under the name first (an adapter loaded at
        run time reaches a worker this way; LoRAManager.register says when that is refused).

        `hold_kv` keeps the KV after the request finishes, for `export_kv` (prefill worker);
        `export_into` (with hold_kv) is where its payload is read out: a contiguous tensor of
        exactly kv_payload_bytes(len(prompt)) bytes, e.g. a shared-memory arena range, written
        only before `export_until` (time.monotonic(); after it, a new tensor is).
        `keep_cached=False` frees the blocks it computes to the prefix cache's eviction end
        (block_manager.py): the router's call when they are worth less than what they would evict.
        `kv_payload` imports KV computed elsewhere; `prior_output_token_ids` are tokens already
        generated there (they count towards max_tokens and are not emitted again).
        `expected_cached_tokens`: what the caller expects its prompt to find cached by the time it
        runs (the worker's view, which counts the prompts still being computed ahead of it): until
        it is scheduled, its queued prefill is the rest (stats; the engine's own lookup when it is
        queued counts too).
        """
        params = params or SamplingParams()
        if request_id in self._requests or request_id in self.held_kv:
            raise InvalidRequestError("request_id", f"{request_id!r} is already in use")
        if prompt_token_ids is None:
            if prompt is None:
                raise InvalidRequestError("prompt", "give a prompt or prompt_token_ids")
            prompt_token_ids = self.tokenizer(prompt).input_ids
        prompt_token_ids = list(prompt_token_ids)
        prior = list(prior_output_token_ids or [])
        check_request(
            prompt_token_ids, prior, params, hold_kv=hold_kv, kv_payload=kv_payload,
            vocab_size=self.vocab_size, max_model_len=self.max_model_len, kv_layout=self.kv_layout,
        )
        num_prompt = len(prompt_token_ids)
        if export_into is not None:
            need = self.kv_payload_bytes(num_prompt)
            have = export_into.numel() * export_into.element_size()
            if not hold_kv or have != need or not export_into.is_contiguous() or export_into.device != self.kv_cache.data.device:
                raise InvalidRequestError(
                    "export_into", f"needs hold_kv and a contiguous {self.kv_cache.data.device} buffer of "
                    f"{need} bytes for a {num_prompt}-token prompt; got {have} bytes",
                )
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - num_prompt
        adapters = []
        if lora_name is not None:
            if self.loras is None:
                raise InvalidRequestError("model", f"adapter {lora_name!r}: this engine serves no LoRA adapters "
                                          "(EngineConfig.lora)")
            if lora_path is not None:
                self.loras.register(lora_name, lora_path)
            try:
                # one use per choice; None: no slot now (or others wait for one first)
                adapter = None if self.lora_waiting else self.loras.try_acquire(lora_name, params.n)
                if self.lora_waiting:
                    self.loras.check_known(lora_name)
            except ModelLoadError as exc:  # LoRAError: its files, named with the field at fault
                raise InvalidRequestError("model", f"adapter {lora_name!r} cannot be loaded here: {exc}") from exc
            adapters = [adapter] * params.n if adapter is not None else []
        # an adapter's blocks hash apart from the base model's and every other adapter's
        extra_keys = block_extra_keys(cache_salt, lora_name, self.loras.paths[lora_name] if lora_name is not None else None)
        arrival = arrival_time if arrival_time is not None else time.monotonic()

        states: list[_SeqState] = []
        for index in range(params.n):
            seq = Sequence(
                request_id=request_id, index=index, prompt_token_ids=prompt_token_ids,
                params=params, max_tokens=max_tokens, priority=priority, arrival_time=arrival,
                extra_keys=extra_keys, hold_kv=hold_kv, keep_cached=keep_cached,
                lora=adapters[index] if adapters else None,
            )
            for token_id in prior:
                seq.append_token(token_id)
            detokenizer = IncrementalDetokenizer(
                self.tokenizer, skip_special_tokens=params.skip_special_tokens,
            ) if params.detokenize else None
            states.append(_SeqState(seq, detokenizer, StopChecker.for_params(params, self.eos_token_ids, max_tokens)))
        request = _Request(request_id, states, num_prompt, arrival, logit_bias=LogitBias.of(params.logit_bias, self.device))
        first = states[0].seq
        if params.prompt_logprobs is not None and not prior and kv_payload is None:
            first.prompt_logprobs = []  # else they came from the engine that computed the prompt
        first.pending_import = kv_payload
        first.expected_cached_tokens = max(0, expected_cached_tokens)
        first.export_into = export_into
        first.export_until = export_until
        if lora_name is not None and not adapters:
            if params.guided is not None:
                self.grammars.submit(params.guided)  # compiles while it waits (cached for _admit)
            self._requests[request_id] = request
            self.lora_waiting[request_id] = (lora_name, self.loras.paths[lora_name])
            return num_prompt
        self._admit(request)
        return num_prompt

    def _admit(self, request: _Request) -> None:
        """A request with what it needs to run (its adapter's slot): queued, or compiling its grammar."""
        request_id, states, params = request.request_id, request.seqs, request.seqs[0].seq.params
        if params.guided is not None:
            grammar = self.grammars.submit(params.guided)
            if not grammar.done():
                self._requests[request_id] = request
                self.compiling.add(request_id, grammar)
                return
            try:
                self._start_grammar(request, grammar.result())  # raises for a spec that did not compile
            except Exception:
                for state in states:
                    self._release_lora(state.seq)
                raise
        self._queue(request)
        self._requests[request_id] = request

    def _queue_lora_waiting(self) -> list[RequestOutput]:
        """Requests whose adapter now has a slot go on, in arrival order, up to the first that has
        none; those that waited past max_queue_wait_s end (their outputs returned)."""
        ended = []
        limit = self.config.max_queue_wait_s
        for request_id, (name, path) in list(self.lora_waiting.items()):
            request = self._requests[request_id]
            if limit is not None and time.monotonic() - request.arrival_time > limit:
                ended.append(self._end(request, RequestStatus.FINISHED_QUEUE_TIMEOUT))
                self.scheduler.num_queue_timeouts += 1
                continue
            try:
                if self.loras.paths.get(name) != path:
                    raise InvalidRequestError("model", f"adapter {name!r} was unloaded or replaced (now "
                                              f"{self.loras.paths.get(name)}, was {path}) while the request waited")
                adapter = self.loras.try_acquire(name, len(request.seqs))
            except Exception as exc:  # its files went bad meanwhile: this request alone ends
                del self.lora_waiting[request_id]
                if isinstance(exc, ModelLoadError):  # LoRAError, naming the file and field: a 400 as at once
                    exc = InvalidRequestError("model", f"adapter {name!r} cannot be loaded here: {exc}")
                self._fail_request(request_id, "lora", exc)
                continue
            if adapter is None:
                break
            del self.lora_waiting[request_id]
            for state in request.seqs:
                state.seq.lora = adapter
            try:
                self._admit(request)
            except Exception as exc:  # a grammar that did not compile: this request alone ends
                self._requests[request_id] = request
                self._fail_request(request_id, "grammar", exc)
        return ended

    def _queue(self, request: _Request) -> None:
        states = request.seqs
        first = states[0].seq
        first.forks_pending = len(states) > 1
        # What its prompt will find cached, for the queued prefill tokens the routers read: a
        # prefix hit queued behind a step is its uncached tail, as the router counted it. With
        # the whole prompt, a stats snapshot taken between its arrival and its step showed the
        # cached part as queued work, which the router kept on the replica until the next
        # snapshot (on a loaded machine, 256 phantom tokens on a prefix's holder sent the next
        # request of the prefix to compute it elsewhere).
        first.expected_cached_tokens = max(first.expected_cached_tokens,
                                           len(self.block_manager.lookup_prefix(first)) * self.block_manager.block_size)
        self.scheduler.add(first)
        for state in states[1:]:
            state.seq.status = RequestStatus.WAITING_FOR_PARENT
            request.waiting_children.append(state.seq)

    # ---- structured outputs (grammar.py) ---------------------------------------------------
    @property
    def grammars(self) -> GrammarCompiler:
        """This process's compiler for the engine's tokenizer (shared with an in-process ingress)."""
        if self._grammars is None:
            self._grammars = compiler_for(self.tokenizer, self.vocab_size, tuple(self.eos_token_ids))
        return self._grammars

    def _start_grammar(self, request: _Request, compiled) -> None:
        """A matcher per choice, past the tokens generated elsewhere."""
        for state in request.seqs:
            state.matcher = self.grammars.matcher(compiled, replay=state.seq.output_token_ids)

    def _queue_compiled(self) -> None:
        """Queue the requests whose grammar is ready; end those whose spec did not compile."""
        for request_id, grammar in self.compiling.take_ready():
            try:
                self._start_grammar(self._requests[request_id], grammar.result())
            except Exception as exc:
                self._fail_request(request_id, "grammar", exc)
                continue
            self._queue(self._requests[request_id])

    def abort_request(self, request_id: str) -> bool:
        """Stop a request now and free its blocks; its final output says finish_reason 'abort'."""
        was_held = self.held_kv.release(request_id)
        request = self._requests.get(request_id)
        if request is None:
            return was_held
        self._pending_outputs.append(self._end(request, RequestStatus.FINISHED_ABORTED))
        return True

    def _end(self, request: _Request, status: RequestStatus) -> RequestOutput:
        """End a request before it finished on its own (aborted, or timed out in the queue): its
        unfinished choices end with `status`, their blocks are freed; its final output."""
        self.compiling.discard(request.request_id)
        self.lora_waiting.pop(request.request_id, None)
        outputs = []
        for state in request.seqs:
            if state.finish_reason is None:
                state.finish_reason = status.value
                state.seq.status = status
                self._release_lora(state.seq)
                self.scheduler.remove(state.seq)
                if self.speculator is not None:
                    self.speculator.release(state.seq)
                if state.seq.block_ids:
                    self.block_manager.free(state.seq)
                outputs.append(CompletionOutput(state.seq.index, "", [], None, status.value))
        request.waiting_children.clear()
        del self._requests[request.request_id]
        return self._request_output(request, outputs)

    def take_failures(self) -> list[RequestFailedError | InvalidRequestError]:
        """The requests that failed on their own since the last call (each is gone, its blocks
        freed): the caller tells each one's client. An InvalidRequestError (its `request_id` set)
        is the client's to fix: its adapter was replaced or its files went bad while it waited."""
        failures, self._failures = self._failures, []
        return failures

    def _fail_request(self, request_id: str, stage: str, cause: Exception) -> None:
        request = self._requests.pop(request_id, None)
        if request is None:
            return
        self.compiling.discard(request_id)
        self.lora_waiting.pop(request_id, None)
        for state in request.seqs:
            seq = state.seq
            if state.finish_reason is None:
                state.finish_reason = "error"
                seq.status = RequestStatus.FINISHED_ABORTED
                self._release_lora(seq)
                self.scheduler.remove(seq)
                if self.speculator is not None:
                    self.speculator.release(seq)
            if seq.block_ids and not self.held_kv.holds(seq):
                self.block_manager.free(seq)
        request.waiting_children.clear()
        self.release_kv(request_id)
        if isinstance(cause, InvalidRequestError):  # the client's to change (a 400 naming the field)
            error = InvalidRequestError(cause.param, cause.message)  # its own: a cached compile error is shared
            error.request_id = request_id
            logger.warning("request %s ended in the engine's %s: %s", request_id, stage, cause)
            self._failures.append(error)
            return
        error = RequestFailedError.caused_by(request_id, stage, cause)
        logger.error("%s", error, exc_info=cause)
        self._failures.append(error)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests) or bool(self._pending_outputs)

    # ---- the step ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        outputs, self._pending_outputs = self._pending_outputs, []
        self.last_decode_rows = 0
        if self.compiling:
            self._queue_compiled()
        if self.lora_waiting:
            outputs += self._queue_lora_waiting()
        sched = self.scheduler.schedule()
        scheduled = sched.scheduled
        for seq in sched.timed_out:  # waited past max_queue_wait_s: refused, nothing generated
            outputs.append(self._end(self._requests[seq.request_id], RequestStatus.FINISHED_QUEUE_TIMEOUT))
        for seq in sched.kv_imports:
            try:
                self._write_import(seq)
            except Exception as exc:  # a payload that does not fit its blocks: its request alone
                self._fail_request(seq.request_id, "KV import", exc)
        if self._failures:
            scheduled = [(seq, n) for seq, n in scheduled if seq.request_id in self._requests]
        self.is_stalled = not scheduled and not sched.preempted and not sched.timed_out
        if not scheduled:
            # Only possible while held exports pin the blocks a waiting request needs, or while
            # grammars compile: nothing changes until one is exported, released or aborted, or
            # a grammar is ready (compiling.on_ready).
            return outputs
        num_prefill_tokens = sum(
            n for seq, n in scheduled if seq.num_computed_tokens < seq.num_prompt_tokens
        )
        self.last_decode_rows = 0 if num_prefill_tokens else len(scheduled)
        started = time.perf_counter()
        step = self.runner.prepare(scheduled)
        logits = self.runner.execute(step)
        if num_prefill_tokens >= _MIN_RATE_TOKENS:
            self.prefill_rate.add(num_prefill_tokens, max(time.perf_counter() - started, 1e-6))
        for seq, n in scheduled:
            # Proposed tokens' KV counts once they are accepted (_append_verified).
            seq.num_computed_tokens += min(n, seq.num_tokens - seq.num_computed_tokens)
            self.num_computed_tokens += n
            self.block_manager.commit(seq)
        sampling_seqs, num_rows = step.sampling_seqs, step.num_sample_rows
        if step.prompt_spans:
            num_sampling = sum(num_rows)
            self._score_prompts(logits[num_sampling:], step.prompt_spans)
            logits = logits[:num_sampling]
            kept = [i for i, seq in enumerate(sampling_seqs) if seq.request_id in self._requests]
            if len(kept) < len(sampling_seqs):  # a request whose scoring failed samples nothing
                first_rows = [sum(num_rows[:i]) for i in range(len(num_rows))]
                rows = [r for i in kept for r in range(first_rows[i], first_rows[i] + num_rows[i])]
                logits = logits.index_select(0, torch.tensor(rows, dtype=torch.long, device=logits.device))
                sampling_seqs, num_rows = [sampling_seqs[i] for i in kept], [num_rows[i] for i in kept]
        for seq in step.scored_seqs:
            if seq.request_id in self._requests:  # not failed in this step
                outputs.append(self._finish_scored(self._requests.pop(seq.request_id)))
        if sampling_seqs:
            sampled = self._sample(logits, sampling_seqs, num_rows)
            now = time.monotonic()
            deltas: dict[str, list[CompletionOutput]] = {}
            to_propose: list[Sequence] = []  # proposed for together: a draft model runs once
            for seq, seq_rows in zip(sampling_seqs, sampled):
                if seq.request_id not in self._requests:
                    continue  # failed in this step
                try:
                    if seq.spec_token_ids:
                        delta = self._append_verified(seq, seq_rows, now)
                    else:
                        delta = self._append(seq, *seq_rows[0], now)
                    if self.speculator is not None and not seq.is_finished and self.speculator.speculates(seq.params):
                        to_propose.append(seq)
                except Exception as exc:  # its grammar, detokenizer or stop checker
                    self._fail_request(seq.request_id, "grammar / detokenize / stop check", exc)
                    continue
                deltas.setdefault(seq.request_id, []).append(delta)
            to_propose = [seq for seq in to_propose if seq.request_id in self._requests]
            if to_propose:
                # Every other running sequence has a row in the next step too (the knee counts them).
                self.speculator.propose(to_propose, num_other_rows=len(self.scheduler.running) - len(to_propose))
                self._trim_to_grammar(to_propose)
            for request_id, completion_outputs in deltas.items():
                request = self._requests.get(request_id)
                if request is None:
                    continue  # another of its choices failed after this one advanced
                outputs.append(self._request_output(request, completion_outputs))
                if request.finished:
                    del self._requests[request_id]
        return outputs

    def _trim_to_grammar(self, seqs: list[Sequence]) -> None:
        """Cut a structured output's proposals to the prefix its grammar allows: a token it
        forbids would be rejected anyway, and the rows after it wasted."""
        for seq in seqs:
            matcher = self._requests[seq.request_id].seqs[seq.index].matcher
            if matcher is not None and seq.spec_token_ids:
                try:
                    del seq.spec_token_ids[matcher.allowed_prefix(seq.spec_token_ids):]
                except Exception:  # noqa: BLE001 - the request decodes without proposals
                    logger.exception("grammar check of %s's proposals failed", seq.request_id)
                    seq.spec_token_ids.clear()

    def _score_prompts(self, logits: torch.Tensor, spans) -> None:
        """Extend each span's sequence's prompt logprobs from its rows of `logits`; a span that
        fails fails its request alone."""
        row = 0
        for span in spans:
            rows = logits[row : row + span.num_rows]
            row += span.num_rows
            try:
                span.seq.prompt_logprobs += score_span(rows, span)
            except Exception as exc:  # noqa: BLE001 - its request alone
                self._fail_request(span.seq.request_id, "prompt logprobs", exc)

    def _finish_scored(self, request: _Request) -> RequestOutput:
        """A max_tokens=0 request whose prompt is computed: every choice ends with "length" and
        no tokens (the choices waiting for choice 0 never start)."""
        first = request.seqs[0].seq
        first.first_token_time = time.monotonic()  # its answer is ready: what a client waits for
        outputs = []
        for state in request.seqs:
            state.finish_reason = RequestStatus.FINISHED_LENGTH.value
            if state.seq is first:
                self._finish(first, RequestStatus.FINISHED_LENGTH)
            else:
                state.seq.status = RequestStatus.FINISHED_LENGTH
            outputs.append(CompletionOutput(state.seq.index, "", [], None, state.finish_reason))
        request.waiting_children.clear()
        return self._request_output(request, outputs)

    def _sample(
        self, logits: torch.Tensor, seqs: list[Sequence], num_rows: list[int],
    ) -> list[list[tuple[int | None, TokenLogprob | None]]]:
        """Each sequence's (token, logprob) per row (1 + its proposed tokens); a row at fault fails
        its request alone (Sampler.sample_each)."""
        rows: list[SamplingRow] = []
        owners: list[int] = []
        for i, (seq, n) in enumerate(zip(seqs, num_rows)):
            rows += [self._sampling_row(seq, m) for m in range(n)]
            owners += [i] * n
        results, failures = self.sampler.sample_each(logits, rows)
        for failure in failures:
            self._fail_request(seqs[owners[failure.row]].request_id, "sampling", failure.error)
        per_seq: list[list[tuple[int | None, TokenLogprob | None]]] = [[] for _ in seqs]
        for owner, result in zip(owners, results):
            per_seq[owner].append(result)
        return per_seq

    def _sampling_row(self, seq: Sequence, num_proposed: int = 0) -> SamplingRow:
        """The row of `seq`'s next token after its first `num_proposed` proposed tokens."""
        params = seq.params
        request = self._requests[seq.request_id]
        output = seq.output_token_ids + seq.spec_token_ids[:num_proposed]
        matcher = request.seqs[seq.index].matcher  # row m: its grammar after the first m proposals
        return SamplingRow(
            params=params,
            prompt_token_ids=seq.prompt_token_ids,
            output_token_ids=output,
            eos_token_ids=self.eos_token_ids,
            seed_key=None if params.seed is None else (params.seed, seq.index, len(output)),
            logit_bias=request.logit_bias,
            grammar=matcher if matcher is None or not num_proposed else SpeculativeMask(matcher, seq.spec_token_ids[:num_proposed]),
        )

    def _append_verified(
        self, seq: Sequence, rows: list[tuple[int, TokenLogprob | None]], now: float,
    ) -> CompletionOutput:
        """Keep the proposed tokens the model agrees with and its own next token, appended one at a
        time (a stop ends it at the first that triggers); drop the rest and their KV. One delta."""
        proposed, seq.spec_token_ids = seq.spec_token_ids, []
        model_tokens = [token_id for token_id, _ in rows]
        num_kept = self.speculator.verify(seq, proposed, model_tokens) + 1
        delta: CompletionOutput | None = None
        for token_id, logprob in rows[:num_kept]:
            # Every token before this one is known and its KV computed (the proposals before it were kept).
            seq.num_computed_tokens = seq.num_tokens
            self.block_manager.commit(seq)
            one = self._append(seq, token_id, logprob, now)
            if delta is None:
                delta = one
            else:
                delta.text += one.text
                delta.token_ids += one.token_ids
                if one.logprobs:
                    delta.logprobs = (delta.logprobs or []) + one.logprobs
                delta.finish_reason, delta.stop_reason = one.finish_reason, one.stop_reason
            if one.finish_reason is not None:
                break
        if not seq.is_finished:
            self.block_manager.trim(seq)  # the blocks that held only rejected tokens' KV
        return delta

    def _append(self, seq: Sequence, token_id: int, logprob: TokenLogprob | None, now: float) -> CompletionOutput:
        request = self._requests[seq.request_id]
        state = request.seqs[seq.index]
        if seq.first_token_time is None:
            seq.first_token_time = now
        if state.matcher is not None and not state.matcher.accept(token_id):
            raise RuntimeError(f"the sampler chose token {token_id}, which the grammar does not allow")
        seq.append_token(token_id)
        self.num_generated_tokens += 1
        if seq.index == 0 and request.waiting_children:
            self._fork_children(seq, request)
        text = state.detokenizer.step([token_id]) if state.detokenizer is not None else ""
        result = state.stop_checker.check(token_id, text, seq.num_output_tokens)
        delta = CompletionOutput(seq.index, result.text, [token_id], [logprob] if logprob else None)
        if result.finish_reason is None and seq.num_tokens >= self.max_model_len:
            result.finish_reason = "length"
        if result.finish_reason is not None:
            if not isinstance(result.stop_reason, str) and state.detokenizer is not None:
                # Not cut by a stop string: release what was held back for a possible match.
                delta.text += state.stop_checker.flush() + state.detokenizer.flush()
            delta.finish_reason = result.finish_reason
            delta.stop_reason = result.stop_reason
            state.finish_reason = result.finish_reason
            self._finish(seq, RequestStatus(result.finish_reason))
        return delta

    def _fork_children(self, parent: Sequence, request: _Request) -> None:
        num_blocks = (request.num_prompt_tokens - 1) // self.block_manager.block_size
        parent.forks_pending = False
        for child in request.waiting_children:
            self.block_manager.fork(parent, child, num_blocks)
            child.num_cached_tokens = parent.num_cached_tokens
            self.scheduler.add(child)
        request.waiting_children = []

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

    def _release_lora(self, seq: Sequence) -> None:
        if seq.lora is not None:
            self.loras.release(seq.lora)
            seq.lora = None

    def _finish(self, seq: Sequence, status: RequestStatus) -> None:
        seq.status = status
        self._release_lora(seq)
        self.scheduler.remove(seq)
        if self.speculator is not None:
            self.speculator.release(seq)
        if seq.hold_kv:
            self.block_manager.trim(seq)  # held: not the blocks rejected proposed tokens were written to
            self.held_kv.hold(seq)
        else:
            self.block_manager.free(seq)

    def _request_output(self, request: _Request, outputs: list[CompletionOutput]) -> RequestOutput:
        first = request.seqs[0].seq
        finished = request.finished
        prompt_logprobs = None
        if first.prompt_logprobs is not None and not request.prompt_logprobs_sent and not first.needs_prompt_logprobs:
            prompt_logprobs = first.prompt_logprobs
            request.prompt_logprobs_sent = True
        return RequestOutput(
            request_id=request.request_id,
            outputs=outputs,
            finished=finished,
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=first.num_cached_tokens,
            metrics=RequestMetrics(
                arrival_time=request.arrival_time,
                first_scheduled_time=first.first_scheduled_time,
                first_token_time=first.first_token_time,
                finished_time=time.monotonic() if finished else None,
            ),
            prompt_logprobs=prompt_logprobs,
        )

    # ---- KV export / import (held_kv.py) ----------------------------------------------------
    def export_kv(self, request_id: str, *, release: bool = True, into: torch.Tensor | None = None) -> KVPayload:
        """The computed KV of a finished `hold_kv` request, as one contiguous payload (read out
        `into` a buffer when given: as add_request's export_into)."""
        return self.held_kv.export(request_id, release=release, into=into)

    def release_kv(self, request_id: str) -> bool:
        return self.held_kv.release(request_id)

    @property
    def kv_exports_to_host(self) -> bool:
        """Whether an export can be read out into host memory (the node's shared-memory arena)."""
        return self.kv_cache.data.device.type == "cpu"

    def kv_payload_bytes(self, num_tokens: int) -> int:
        """The size of the KV payload of `num_tokens` tokens (whole blocks), as export_kv makes it."""
        return -(-num_tokens // self.config.block_size) * self.config.block_size * self.bytes_per_token

    def _write_import(self, seq: Sequence) -> None:
        payload = seq.pending_import
        seq.pending_import = None
        full_ids, sliding_ids = self.block_manager.kv_tables(seq, payload.num_blocks)
        self.kv_cache.write_blocks(full_ids, payload.kv, sliding_ids)
        self.block_manager.commit(seq)

    # ---- observability -----------------------------------------------------------------------
    def take_kv_events(self) -> list[KVEvent]:
        return self.block_manager.take_events()

    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting) + len(self.compiling) + len(self.lora_waiting),
            num_blocks=bm.num_blocks,
            num_free_blocks=bm.num_free_blocks,
            kv_usage=bm.usage,
            num_preemptions=self.scheduler.num_preemptions,
            num_expired_imports=self.scheduler.num_expired_imports,
            num_queue_timeouts=self.scheduler.num_queue_timeouts,
            prefix_cache_query_tokens=bm.num_prefix_query_tokens,
            prefix_cache_hit_tokens=bm.num_prefix_hit_tokens,
            num_computed_tokens=self.num_computed_tokens,
            num_generated_tokens=self.num_generated_tokens,
            num_held_exports=len(self.held_kv),
            num_queued_prefill_tokens=sum(
                max(0, seq.num_prompt_tokens - max(seq.num_computed_tokens, seq.expected_cached_tokens))
                for seq in (*self.scheduler.waiting, *self.scheduler.running)
            ) + sum(self._requests[r].num_prompt_tokens for r in self.lora_waiting),
            prefill_tokens_per_s=self.prefill_rate.tokens_per_s,
            decode_steps=self.decode_steps.steps,
            decode_step_rows=self.decode_steps.rows,
            decode_step_s=self.decode_steps.seconds,
            dtype=self.dtype_choice.dtype,
            dtype_reason=self.dtype_choice.reason,
            kernel_path=self.kernels.path.value,
            kernel_reason=self.kernels.reason,
            linear_path=self.model.linear_choice.summary,
            deterministic=self.model.invariance_reason,
            lora_resident=tuple(self.loras.resident) if self.loras is not None else (),
            lora_load_s=self.loras.load_s if self.loras is not None else 0.0,
            lora_slots_free=self.loras.slots_free if self.loras is not None else -1,
            **(self.speculator.stats() if self.speculator is not None else {}),
        )

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
