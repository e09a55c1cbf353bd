"""Admission: an EngineRequest checked, made into its choices' sequences, and queued when it has
what it needs to run.

    add(request) ── check ──▶ its choices (SeqState) ──▶ adapter slot? ── no ──▶ lora_waiting
                                                            │ yes               (first come first served)
                                                            ▼
                                                   grammar compiled? ── no ──▶ compiling
                                                            │ yes
                                                            ▼
                                              scheduler (choice 0; choices 1.. wait for its prompt)

A LoRA request whose adapter has no slot (every slot held by running requests) waits strictly
first come first served (one arriving while any waits goes behind it, so slots drain to it), and
queues once one frees, or leaves after max_queue_wait_s as the scheduler's queue does (lora.py).
A structured output's grammar compiles outside the scheduler (grammar.py) while the batch goes
on; a spec that fails to compile ends its request with the InvalidRequestError naming `guided`.
"""

from __future__ import annotations

import logging
import time

from serving.engine.contract import EngineRequest
from serving.engine.errors import InvalidRequestError, ModelLoadError
from serving.engine.kv.block_hash import block_extra_keys
from serving.engine.outputs import RequestOutput
from serving.engine.request import RequestStatus, Sequence
from serving.engine.request_table import RequestTable, SeqState, TrackedRequest
from serving.engine.sampling.detokenizer import IncrementalDetokenizer
from serving.engine.sampling.grammar import GrammarCompiler, compiler_for
from serving.engine.sampling.sampler import LogitBias
from serving.engine.sampling.stop_checker import StopChecker
from serving.engine.validation import check_request

__all__ = ["Intake"]

logger = logging.getLogger(__name__)


class Intake:
    """Takes requests in (module docstring); `engine` is the LLMEngine it admits to (its limits,
    tokenizer, adapters, block manager and scheduler)."""

    def __init__(self, engine, table: RequestTable):
        self.engine = engine
        self.table = table
        self._grammars: GrammarCompiler | None = None  # built on the first structured output

    @property
    def grammars(self) -> GrammarCompiler:
        """This process's compiler for the engine's tokenizer (shared with an in-process ingress)."""
        if self._grammars is None:
            engine = self.engine
            self._grammars = compiler_for(engine.tokenizer, engine.vocab_size, tuple(engine.eos_token_ids))
        return self._grammars

    def add(self, request: EngineRequest) -> int:
        """Check `request` and take it in: queued, compiling or waiting for its adapter. Returns its prompt length."""
        engine, params = self.engine, request.params
        if request.request_id in self.table or request.request_id in engine.held_kv:
            raise InvalidRequestError("request_id", f"{request.request_id!r} is already in use")
        prompt, prior = list(request.prompt_token_ids), list(request.prior_output_token_ids)
        check_request(
            prompt, prior, params, hold_kv=request.hold_kv, kv_payload=request.kv_payload,
            vocab_size=engine.vocab_size, max_model_len=engine.max_model_len, kv_layout=engine.kv_layout,
        )
        if request.export_into is not None:
            engine.kv.check_export_into(request.export_into, request.hold_kv, len(prompt))
        adapters = self._acquire_adapters(request)
        tracked = self._track(request, prompt, prior, adapters)
        if request.lora_name is not None and not adapters:
            if params.guided is not None:
                self.grammars.submit(params.guided)  # compiles while it waits (cached for admit)
            self.table.requests[request.request_id] = tracked
            self.table.lora_waiting[request.request_id] = (request.lora_name, engine.loras.paths[request.lora_name])
            return len(prompt)
        self.admit(tracked)
        return len(prompt)

    def _acquire_adapters(self, request: EngineRequest) -> list:
        """The adapter for each choice, or [] (the base model, or no slot now: it waits)."""
        name, loras, n = request.lora_name, self.engine.loras, request.params.n
        if name is None:
            return []
        if loras is None:
            raise InvalidRequestError("model", f"adapter {name!r}: this engine serves no LoRA adapters (EngineConfig.lora)")
        if request.lora_path is not None:
            loras.register(name, request.lora_path)
        try:
            # one use per choice; None: no slot now (or others wait for one first)
            adapter = None if self.table.lora_waiting else loras.try_acquire(name, n)
            if self.table.lora_waiting:
                loras.check_known(name)
        except ModelLoadError as exc:  # LoRAError: its files, named with the field at fault
            raise InvalidRequestError("model", f"adapter {name!r} cannot be loaded here: {exc}") from exc
        return [adapter] * n if adapter is not None else []

    def _track(self, request: EngineRequest, prompt: list[int], prior: list[int], adapters: list) -> TrackedRequest:
        """Its choices' sequences, each with its detokenizer and stop checker."""
        engine, params = self.engine, request.params
        max_tokens = params.max_tokens if params.max_tokens is not None else engine.max_model_len - len(prompt)
        lora_name = request.lora_name
        # an adapter's blocks hash apart from the base model's and every other adapter's
        extra_keys = block_extra_keys(request.cache_salt, lora_name,
                                      engine.loras.paths[lora_name] if lora_name is not None else None)
        arrival = request.arrival_mono_s if request.arrival_mono_s is not None else time.monotonic()
        states: list[SeqState] = []
        for index in range(params.n):
            seq = Sequence(
                request_id=request.request_id, index=index, prompt_token_ids=prompt,
                params=params, max_tokens=max_tokens, priority=request.priority, arrival_mono_s=arrival,
                extra_keys=extra_keys, hold_kv=request.hold_kv, keep_cached=request.keep_cached,
                lora=adapters[index] if adapters else None,
            )
            for token_id in prior:
                seq.append_token(token_id)
            detokenizer = IncrementalDetokenizer(
                engine.tokenizer, skip_special_tokens=params.skip_special_tokens,
            ) if params.detokenize else None
            states.append(SeqState(seq, detokenizer, StopChecker.for_params(params, engine.eos_token_ids, max_tokens)))
        tracked = TrackedRequest(request.request_id, states, len(prompt), arrival,
                                 logit_bias=LogitBias.of(params.logit_bias, engine.device))
        first = states[0].seq
        if params.prompt_logprobs is not None and not prior and request.kv_payload is None:
            first.prompt_logprobs = []  # else they came from the engine that computed the prompt
        first.pending_import = request.kv_payload
        first.expected_cached_tokens = max(0, request.expected_cached_tokens)
        first.export_into = request.export_into
        first.export_until_mono_s = request.export_until_mono_s
        return tracked

    def admit(self, request: TrackedRequest) -> None:
        """A request with what it needs to run (its adapter's slot): queued, or compiling its grammar."""
        request_id, states, params = request.request_id, request.seqs, request.seqs[0].seq.params
        if params.guided is not None:
            grammar = self.grammars.submit(params.guided)
            if not grammar.done():
                self.table.requests[request_id] = request
                self.table.compiling.add(request_id, grammar)
                return
            try:
                self._start_grammar(request, grammar.result())  # raises for a spec that did not compile
            except Exception:
                for state in states:
                    self.table.release_lora(state.seq)
                raise
        self._queue(request)
        self.table.requests[request_id] = request

    def queue_lora_waiting(self) -> list[RequestOutput]:
        """Requests whose adapter now has a slot go on, in arrival order, up to the first that has
        none; those that waited past max_queue_wait_s end (their outputs returned)."""
        ended = []
        limit = self.engine.config.max_queue_wait_s
        table, loras = self.table, self.engine.loras
        for request_id, (name, path) in list(table.lora_waiting.items()):
            request = table[request_id]
            if limit is not None and time.monotonic() - request.arrival_mono_s > limit:
                ended.append(table.end(request, RequestStatus.FINISHED_QUEUE_TIMEOUT))
                self.engine.scheduler.num_queue_timeouts += 1
                continue
            try:
                if loras.paths.get(name) != path:
                    raise InvalidRequestError("model", f"adapter {name!r} was unloaded or replaced (now "
                                              f"{loras.paths.get(name)}, was {path}) while the request waited")
                adapter = loras.try_acquire(name, len(request.seqs))
            except Exception as exc:  # its files went bad meanwhile: this request alone ends
                del table.lora_waiting[request_id]
                if isinstance(exc, ModelLoadError):  # LoRAError, naming the file and field: a 400 as at once
                    exc = InvalidRequestError("model", f"adapter {name!r} cannot be loaded here: {exc}")
                table.fail(request_id, "lora", exc)
                continue
            if adapter is None:
                break
            del table.lora_waiting[request_id]
            for state in request.seqs:
                state.seq.lora = adapter
            try:
                self.admit(request)
            except Exception as exc:  # a grammar that did not compile: this request alone ends
                table.requests[request_id] = request
                table.fail(request_id, "grammar", exc)
        return ended

    def queue_compiled(self) -> None:
        """Queue the requests whose grammar is ready; end those whose spec did not compile."""
        for request_id, grammar in self.table.compiling.take_ready():
            try:
                self._start_grammar(self.table[request_id], grammar.result())
            except Exception as exc:
                self.table.fail(request_id, "grammar", exc)
                continue
            self._queue(self.table[request_id])

    def _start_grammar(self, request: TrackedRequest, compiled) -> None:
        """A matcher per choice, past the tokens generated elsewhere."""
        for state in request.seqs:
            state.matcher = self.grammars.matcher(compiled, replay=state.seq.output_token_ids)

    def _queue(self, request: TrackedRequest) -> None:
        states = request.seqs
        first = states[0].seq
        first.forks_pending = len(states) > 1
        block_manager = self.engine.block_manager
        # What its prompt will find cached, for the queued prefill tokens the routers read: a
        # prefix hit queued behind a step is its uncached tail, as the router counted it. With
        # the whole prompt, a stats snapshot taken between its arrival and its step showed the
        # cached part as queued work, which the router kept on the replica until the next
        # snapshot (on a loaded machine, 256 phantom tokens on a prefix's holder sent the next
        # request of the prefix to compute it elsewhere).
        first.expected_cached_tokens = max(first.expected_cached_tokens,
                                           len(block_manager.lookup_prefix(first)) * block_manager.block_size)
        self.engine.scheduler.add(first)
        for state in states[1:]:
            state.seq.status = RequestStatus.WAITING_FOR_PARENT
            request.waiting_children.append(state.seq)
