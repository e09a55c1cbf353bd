"""What a completion endpoint reads of its server: a narrow context, not the server.

    OpenAIServer ──EndpointContext──▶ ChatEndpoint, CompletionsEndpoint (chat.py, completions.py),
                                      the tokenize routes (tokenize.py)

The server (serving/api/endpoints/routes.py) owns the app's state: its keys, rate limiter, usage
ledger, degrader. An endpoint needs only the served model and its catalogue, the config, the
Frontend that generates, the metrics that track a stream, the admission of a request's tokens to
its key's limits, and the clock its deadline counts on. The server builds the context when it
builds its app, so a clock set on the server before (a test's virtual clock) is the one used.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass

from serving.api.admission.deadlines import bounded, deadline_for
from serving.api.endpoints.calls import Call
from serving.api.endpoints.models import ModelCatalog
from serving.api.errors import error_status
from serving.api.generation.pipeline import ChoiceDelta, Frontend
from serving.config import ServeConfig
from serving.engine.params import SamplingParams
from serving.observability.ingress_metrics import IngressMetrics

__all__ = ["EndpointContext"]


@dataclass(frozen=True)
class EndpointContext:
    model_name: str
    config: ServeConfig
    frontend: Frontend
    models: ModelCatalog
    metrics: IngressMetrics
    # takes a request's tokens (its prompts and all it may generate) from its key's limits
    admit: Callable[[Call, list[list[int]], list[SamplingParams]], None]
    clock: Callable[[], float]  # of request deadlines (serving/api/admission/deadlines.py)

    def set_deadline(self, call: Call, timeout_s: float | None) -> None:
        """The request's deadline, from its body's `timeout` and its key's tier."""
        call.deadline = deadline_for(timeout_s, self.config, call.key.tier, call.received_at, self.clock)

    def traced(self, call: Call) -> None:
        """Name the request and its model on its trace, once it is admitted."""
        if call.trace is not None:
            call.trace.set({"kvrelay.request_id": call.request_id, "gen_ai.request.model": self.model_name})

    def watched(self, call: Call, deltas: AsyncGenerator[ChoiceDelta, None], *, prompt_tokens: int) -> AsyncGenerator[ChoiceDelta, None]:
        """The request's deltas bounded by its deadline and timed into its metrics record."""
        return self.metrics.track(call.record, bounded(deltas, call.deadline), prompt_tokens=prompt_tokens, status_of=error_status)
