"""The messages that cross Ray boundaries: errors as values with typed kinds, a WorkerRequest made
from the pipeline's request, enums that survive pickling."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from serving.api.backend import GenerateRequest
from serving.deployments.messages import Caller, ClaimMiss, WorkerError, WorkerErrorKind, WorkerRequest
from serving.engine.errors import ContextLengthError, EngineDeadError, InvalidRequestError, RequestFailedError
from serving.engine.params import SamplingParams


@pytest.mark.parametrize(("exc", "kind"), [
    (ContextLengthError("messages", "too long", num_tokens=9000, limit=8192), WorkerErrorKind.CONTEXT_LENGTH),
    (InvalidRequestError("max_tokens", "must exceed 3"), WorkerErrorKind.INVALID),
    (RequestFailedError("r: sampling failed"), WorkerErrorKind.FAILED),
    (EngineDeadError("the step loop stopped"), WorkerErrorKind.DEAD),
])
def test_an_error_crosses_as_a_value_and_is_raised_again_as_itself(exc, kind):
    error = pickle.loads(pickle.dumps(WorkerError.from_exception(exc)))
    assert error.kind is kind
    again = error.to_exception()
    assert type(again) is type(exc) and str(again) == str(exc)
    if isinstance(exc, ContextLengthError):
        assert (again.param, again.num_tokens, again.limit) == ("messages", 9000, 8192)


def test_an_unknown_error_is_internal_and_names_its_type():
    error = WorkerError.from_exception(KeyError("x"))
    assert error.kind is WorkerErrorKind.INTERNAL and error.message == "KeyError: 'x'"
    assert type(error.to_exception()) is RuntimeError


def test_a_worker_request_is_the_pipelines_request_plus_its_sender():
    request = GenerateRequest("r1", [1, 2, 3], SamplingParams(max_tokens=4), priority=2, cache_salt="s",
                              block_hashes=[7, 8], block_size=16, session="u", trace_context={"traceparent": "x"})
    sent = WorkerRequest.sent_by(request, Caller("SERVE_REPLICA::app#OpenAIIngress#a", "serve"))
    assert all(getattr(sent, f.name) == getattr(request, f.name) for f in dataclasses.fields(GenerateRequest))
    assert sent.caller == ("SERVE_REPLICA::app#OpenAIIngress#a", "serve")
    assert WorkerRequest.sent_by(request, None).caller is None


def test_a_claim_miss_is_the_same_member_after_pickling():
    for miss in ClaimMiss:
        assert pickle.loads(pickle.dumps(miss)) is miss
