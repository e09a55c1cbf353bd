"""One API request at the ingress, from its admission to its response: who pays for it, its
trace, its metrics record, its hold on its key's limits, its priority and deadline, and the
headers its response will carry. serving/api/endpoints/routes.py makes one per completion request and
hands it to the endpoint (serving/api/endpoints/chat.py, completions.py, responses.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from serving.api.admission.deadlines import Deadline
from serving.api.admission.keys import ANONYMOUS
from serving.api.admission.rate_limits import Ticket
from serving.api.errors import RequestTimeoutError
from serving.api.usage import RequestAccount
from serving.config.access import APIKey
from serving.observability import tracing
from serving.observability.ingress_metrics import RequestRecord

__all__ = ["Call", "with_partial"]


@dataclass
class Call:
    """One API request at the ingress: who pays for it, and its trace."""

    request_id: str  # its response's `id`; a 5xx names it, and the log has the exception under it
    account: RequestAccount
    trace: tracing.RequestTrace | None
    record: RequestRecord  # its metrics: recorded when its response or stream ends
    key: APIKey = ANONYMOUS
    ticket: Ticket | None = None  # its hold on its key's limits, from admission to its end
    priority: int = 0  # as its key's tier allows (serving/config/access.py)
    received_at: float = 0.0  # when the ingress received it (OpenAIServer.clock): its deadline counts from here
    deadline: Deadline | None = None
    headers: dict[str, str] = field(default_factory=dict)  # of its response: ignored fields, what fitting dropped

    def finish(self, status_code: int = 200, error: str | None = None) -> None:
        """Its response is complete (built, or its stream ended): bill it, end its trace."""
        self.account.settle()
        self.release()
        if self.trace is not None:
            usage = self.account.usage
            if usage is not None:
                self.trace.set({"gen_ai.usage.input_tokens": usage.prompt_tokens, "gen_ai.usage.output_tokens": usage.completion_tokens})
            self.trace.end(status_code, error)

    def release(self) -> None:
        """Give its key's limits back what it did not use (once; a no-op before admission)."""
        if self.ticket is not None:
            usage = self.account.usage
            self.ticket.release(usage.prompt_tokens + usage.completion_tokens if usage is not None else None)


def with_partial(exc: RequestTimeoutError, account: RequestAccount, response) -> None:
    """A non-streamed request out of time: bill what it got and hand it back in the 408's
    `partial` (the response it would have been); nothing if it got no token."""
    usage = account.settle_if_generated()
    if usage is not None:
        exc.partial = response(usage)
