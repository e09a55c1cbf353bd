"""vLLM as a second engine behind the same workers (`backend: vllm`): VLLMEngine runs vLLM's
AsyncLLM in the worker's replica and implements the engine contract (serving/engine/contract.py),
so the ingress, the routers, the autoscaler, metrics and tracing do not know which engine they
talk to.

    EngineWorker ── EngineClient ─┬─ AsyncEngine  (kvrelay's engine, a step thread)
                                  └─ VLLMEngine   (vllm.v1 AsyncLLM, its EngineCore process)

What maps onto what:

    EngineConfig            model (a GGUF goes through kvrelay's safetensors conversion: vLLM on a
                            CPU cannot read one), dtype, block_size (rounded up to vLLM's CPU
                            attention's multiple of 32), max_model_len, max_num_seqs,
                            max_num_batched_tokens, enable_prefix_caching, seed, kv_cache_bytes
                            (kv_cache_memory_bytes), lora (enable_lora); `vllm:` vLLM's own (args.py)
    SamplingParams          vllm.SamplingParams with deltas out (output_kind DELTA); `guided` ->
                            StructuredOutputsParams; top_k 0 -> vLLM's 0 (off) (convert.py)
    RequestOutput           vLLM's deltas: text, token ids, logprobs (the sampled token and the
                            top alternatives), finish and stop reasons, cached prompt tokens
    EngineStats             a stat logger of ours on vLLM's SchedulerStats and IterationStats: running
                            and waiting requests, KV usage, prefix-cache queries and hits, tokens
                            (stats.py); queued prefill and max_queue_wait_s, this replica's (queue.py)

    KV events               relayed into kvrelay's hashes (events.py): the router's index and
                            the ingress's prompt hashes stay in one hash space, whichever engine a
                            pool runs

    P/D hand-off            with `kv_handoff` (a prefill or decode pool's replica), vLLM runs
                            kvrelay's KV connector (connector.py, the EngineCore's side;
                            handoff.py, this replica's): a prefill request (hold_kv) saves its
                            prompt's blocks into the range the worker reserved in the node's KV
                            arena (export_into, a ShmRange), export_kv hands it on; a decode request
                            (kv_payload) loads it before its first step, or vLLM recomputes it
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

from serving.engine.config import EngineConfig, VLLMOptions
from serving.engine.contract import EngineRequest, KVExportTarget
from serving.engine.errors import EngineDeadError, InvalidRequestError, ModelLoadError, RequestFailedError
from serving.engine.kv.payload import KVLayout, KVPayload
from serving.engine.outputs import CompletionOutput, EngineStats, RequestMetrics, RequestOutput
from serving.engine.params import SamplingParams
from serving.engine.validation import ModelInfo
from serving.engine.vllm.args import engine_args
from serving.engine.vllm.convert import is_greedy, logprobs, prompt_logprobs, vllm_sampling_params
from serving.engine.vllm.events import KVEventRelay
from serving.engine.vllm.handoff import Handoffs, payload_bytes
from serving.engine.vllm.queue import QueueWatch
from serving.engine.vllm.stats import VLLMStats

__all__ = ["VLLMEngine"]

logger = logging.getLogger(__name__)


class VLLMEngine:
    """AsyncEngine's surface over vLLM's AsyncLLM (module docstring). Built in the replica; the
    first generate starts vLLM's output loop on the caller's event loop."""

    # vLLM's connector copies between its cache (CPU or GPU) and host shared memory itself, in its
    # EngineCore process: export_into is a range of the node's arena, by name (a ShmRange)
    kv_export_target = KVExportTarget.SHM_RANGE

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
        self._stats = VLLMStats()
        # KV events on an ipc socket of this engine's own (no port to collide with another replica)
        self._events_dir = tempfile.mkdtemp(prefix="kvrelay-vllm-")
        self._events_endpoint = f"ipc://{self._events_dir}/kv-events"
        args = engine_args(config, model_dir, self._events_endpoint, kv_handoff, spec)
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
        self._model_info = ModelInfo(vocab_size=spec.vocab_size, max_model_len=max_model_len,
                                     eos_token_ids=tuple(spec.eos_token_ids), block_size=block_size)
        self.kv_layout = layout
        self._handoffs = Handoffs(layout, self._events_dir) if kv_handoff else None
        self._queue = QueueWatch(self._llm, self._stats)  # queued prefill, max_queue_wait_s (queue.py)
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

    def model_info(self) -> ModelInfo:
        return self._model_info

    def kv_payload_bytes(self, num_tokens: int) -> int:
        return payload_bytes(self.kv_layout, num_tokens)

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
            num_queued_prefill_tokens=sum(self._queue.prefilling.values()), prefill_tokens_per_s=self._queue.prefill_rate.tokens_per_s,
            kernel_path="vllm", kernel_reason=f"vLLM {self.version}", num_queue_timeouts=self._queue.num_queue_timeouts,
            decode_steps=s.decode_steps, decode_step_rows=s.decode_rows, decode_step_s=s.decode_s,
        )

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """As AsyncEngine.generate (contract.py). Tokens generated elsewhere (`prior_output_token_ids`:
        a stream resumed on this replica after another died, or a hand-off's first token) continue
        as part of the prompt, counted against max_tokens (a structured output cannot resume here).
        A prompt only scored (max_tokens 0, which vLLM refuses) asks vLLM for one token and returns
        none. A hand-off (module docstring): `hold_kv` saves the prompt's KV into `export_into` (a
        range of the node's arena, written only before `export_until_mono_s`) or a staging range of
        this replica's, for export_kv; `kv_payload` is loaded before the first step."""
        from vllm.exceptions import VLLMClientError

        run = _Run.of(request)
        if run.asked.max_tokens == 0:  # the tokens before used it all
            yield run.ended("length")
            return
        run.handoff = self._begin_handoff(request, run.prior)
        deadline = self._track(run)
        try:
            stream = self._llm.generate(
                run.vllm_prompt(), vllm_sampling_params(run.asked, run.handoff.params() if run.handoff else None),
                request.request_id, priority=request.priority, lora_request=self._lora(request.lora_name, request.lora_path),
            )
            async for out in self._queue.until_started(stream, request.request_id, deadline):
                if out is None:  # waited past max_queue_wait_s without starting: vLLM dropped it
                    run.finished = True
                    self._queue.num_queue_timeouts += 1
                    run.metrics.finished_mono_s = time.monotonic()
                    yield run.ended("queue_timeout")
                    return
                output = self._on_output(run, out)
                if output is not None:
                    yield output
        except InvalidRequestError:
            raise
        except (ValueError, VLLMClientError) as exc:
            if run.yielded:  # mid-stream: vLLM's own failure, not the request's fields
                raise RequestFailedError.caused_by(request.request_id, "vllm", exc) from exc
            raise InvalidRequestError(getattr(exc, "parameter", None) or "request", str(exc)) from exc  # its checks
        except RequestFailedError:
            raise
        except Exception as exc:
            if self._llm.errored:
                self._dead = exc
                raise EngineDeadError(f"the vLLM engine stopped: {type(exc).__name__}: {exc}") from exc
            raise RequestFailedError.caused_by(request.request_id, "vllm", exc) from exc  # EngineGenerateError, ...
        finally:
            await self._untrack(run)

    def _begin_handoff(self, request: EngineRequest, prior: list[int]):
        """The request's hand-off (vllm/handoff.py), or None; InvalidRequestError where none can be."""
        if request.hold_kv or request.kv_payload is not None:
            if self._handoffs is None:
                raise InvalidRequestError("hold_kv" if request.hold_kv else "kv_payload", "this vLLM engine hands no KV "
                                          "over: only a prefill or decode pool's (mode: disaggregated) does")
            return self._handoffs.begin(request.prompt_token_ids, prior, request.hold_kv, request.kv_payload,
                                        request.export_into, request.export_until_mono_s)
        if request.export_into is not None:
            raise InvalidRequestError("export_into", "needs hold_kv")
        return None

    def _track(self, run: _Run) -> float | None:
        """Count the request in until its first output (queued prefill, vLLM's queue order);
        its max_queue_wait_s deadline (monotonic), or None."""
        request, num_prompt = run.request, len(run.request.prompt_token_ids)
        # queued until its first output: the prefill tokens this replica owes, less what the worker
        # expects cached (vLLM says what it found only with that output; counting the cached part
        # too showed a prefix's holder busy with work it never had, LLMEngine.stats)
        expected = min(max(0, request.expected_cached_tokens), num_prompt - 1) if not run.prior else 0
        self._queue.add(request.request_id, request.priority, num_prompt + len(run.prior) - expected)
        # max_queue_wait_s, as kvrelay's scheduler has it: a request still waiting for its first
        # step then ends with queue_timeout; one continued from tokens generated elsewhere waits on
        limit = self.config.max_queue_wait_s
        if limit is None or run.prior or request.kv_payload is not None:
            return None
        return run.metrics.arrival_mono_s + limit

    async def _untrack(self, run: _Run) -> None:
        request_id = run.request.request_id
        if not run.finished and not self._llm.errored:  # its caller went (cancelled, or closed this stream)
            try:
                await self._llm.abort(request_id)  # vLLM stops it now (a request it never took: nothing)
            except Exception:  # noqa: BLE001 - the request is gone either way
                logger.warning("aborting %s in vLLM failed", request_id, exc_info=True)
        self._queue.remove(request_id)
        if run.handoff is not None:  # ended early (its caller went, or a failure): nothing is held
            self._handoffs.done(request_id, run.handoff, run.request.prompt_token_ids, finished=False)

    def _on_output(self, run: _Run, out) -> RequestOutput | None:
        """One of vLLM's outputs as kvrelay's (None: nothing to hand on yet)."""
        request, params = run.request, run.request.params
        prompt = request.prompt_token_ids
        if not run.seen:
            run.seen = True
            self._queue.first_output(request.request_id, out, run.metrics, len(prompt) + len(run.prior))
        run.finished = out.finished
        now = time.monotonic()
        if run.metrics.first_token_mono_s is None and any(c.token_ids for c in out.outputs):
            run.metrics.first_token_mono_s = now
        if out.finished:
            run.metrics.finished_mono_s = now
        if any(c.finish_reason == "error" for c in out.outputs):
            raise RequestFailedError(f"request {request.request_id} failed in vLLM (finish_reason error); no other "
                                     "request was affected", request_id=request.request_id, stage="vllm")
        if run.handoff is not None and (run.handoff.spec.op == "load" or out.finished):
            self._handoffs.done(request.request_id, run.handoff, prompt, finished=out.finished)
            run.handoff = None
        if run.scores_only and not out.finished:
            return None  # its one token is not wanted: the final output says length, with none
        scores_only, copies = run.scores_only, params.n if is_greedy(params) else 1  # greedy: every choice is the first
        choices = [
            CompletionOutput(c.index + copy, "" if scores_only else c.text, [] if scores_only else list(c.token_ids),
                             None if scores_only else logprobs(c.token_ids, c.logprobs, params.logprobs or 0),
                             "length" if scores_only else c.finish_reason, None if scores_only else c.stop_reason)
            for c in out.outputs for copy in range(copies)
        ]
        run.yielded = True
        return RequestOutput(request.request_id, choices, out.finished, len(prompt), out.num_cached_tokens or 0,
                             run.metrics, prompt_logprobs(prompt, out.prompt_logprobs, params.prompt_logprobs))

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


@dataclass
class _Run:
    """One request's way through vLLM (VLLMEngine.generate): what is asked of vLLM, and how far it got."""

    request: EngineRequest
    prior: list[int]  # tokens generated elsewhere: part of the prompt to vLLM
    asked: SamplingParams  # the request's params less what the prior tokens used; one token to score a prompt
    scores_only: bool  # max_tokens 0: one token asked of vLLM, none returned
    metrics: RequestMetrics
    handoff: object = None  # its hand-off (vllm/handoff.py) until done
    finished: bool = False
    yielded: bool = False
    seen: bool = False  # its first output came

    @classmethod
    def of(cls, request: EngineRequest) -> _Run:
        """InvalidRequestError for what vLLM cannot run."""
        params = request.params
        if not request.prompt_token_ids:
            raise InvalidRequestError("prompt", "must not be empty")
        prior = list(request.prior_output_token_ids)
        if prior and params.guided is not None:
            raise InvalidRequestError("prior_output_token_ids", "a structured output cannot resume on the vLLM engine")
        scores_only = params.max_tokens == 0
        asked = params
        if prior or scores_only:
            max_tokens = None if params.max_tokens is None else max(params.max_tokens - len(prior), 0)
            asked = dataclasses.replace(params, max_tokens=1 if scores_only else max_tokens,
                                        min_tokens=max(params.min_tokens - len(prior), 0),
                                        prompt_logprobs=None if prior else params.prompt_logprobs)
        arrival = request.arrival_mono_s if request.arrival_mono_s is not None else time.monotonic()
        return cls(request, prior, asked, scores_only, RequestMetrics(arrival))

    def ended(self, finish_reason: str) -> RequestOutput:
        """Its last output, with no tokens, every choice ending with `finish_reason`."""
        request = self.request
        return RequestOutput(request.request_id, [CompletionOutput(i, "", [], None, finish_reason) for i in range(request.params.n)],
                             True, len(request.prompt_token_ids), 0, self.metrics)

    def vllm_prompt(self):
        from vllm.inputs import TokensPrompt

        prompt = TokensPrompt(prompt_token_ids=list(self.request.prompt_token_ids) + self.prior)
        if self.request.cache_salt:
            prompt["cache_salt"] = self.request.cache_salt
        return prompt
