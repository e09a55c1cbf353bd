"""Chat templates at the ingress: what a request may pass to the template, and rendering it off the
event loop with a time limit.

    chat_template_kwargs ──template_kwargs(kwargs, api)──▶ the allowed variables, or a 400 naming the key
    messages + variables ──render_off_loop(encode, limit_s)──▶ prompt ids, or a 400 after limit_s

A chat template is a Jinja program. The model's own is trusted; one a request sends
(`chat_template_kwargs.chat_template`) is not: `{{ 'x' * 10**10 }}` or a few nested loops run for
minutes, and Jinja's sandbox bounds neither CPU nor memory. So a request's template is refused
unless the operator sets `api.allow_request_chat_template`, and the other keys are template
variables only from an allow-list (`api.chat_template_kwargs`: enable_thinking, ...), each a
scalar of bounded length: apply_chat_template's own arguments (tokenize, return_tensors, ...)
never come from a request.

Whatever template renders, it renders in a thread of its own (with the tokenizer, which for a long
prompt takes a while too), so the event loop goes on serving every other stream and the health
checks. After `limit_s` the request gets a 400 `render_timeout`, and the render is interrupted:
an exception is raised in its thread at its next Python instruction, which stops a template's
loops. A single C call (a string repeated 10**10 times, the Rust tokenizer) is not interrupted and
runs to its end in the background; that is why request templates are off by default. The thread
is a daemon, so a render that never ends cannot hold up the process's exit.
"""

from __future__ import annotations

import asyncio
import ctypes
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from serving.api.errors import APIError
from serving.config import APIConfig
from serving.engine.errors import InvalidRequestError

__all__ = ["template_kwargs", "render_off_loop", "RenderInterrupted"]

T = TypeVar("T")


def template_kwargs(kwargs: dict[str, Any] | None, api: APIConfig) -> dict[str, Any]:
    """The request's `chat_template_kwargs` that may reach the template; InvalidRequestError (400)
    naming the first key that may not."""
    allowed = set(api.chat_template_kwargs)
    for key, value in (kwargs or {}).items():
        param = f"chat_template_kwargs.{key}"
        if key == "chat_template":
            if not api.allow_request_chat_template:
                raise InvalidRequestError(param, "this server does not render chat templates sent in requests; it uses the model's own")
            if not isinstance(value, str):
                raise InvalidRequestError(param, f"must be a string, got {type(value).__name__}")
            continue
        if key not in allowed:
            names = ", ".join(sorted(allowed)) or "none"
            raise InvalidRequestError(param, f"is not a template variable this server accepts (accepted: {names})")
        if value is not None and not isinstance(value, (str, bool, int, float)):
            raise InvalidRequestError(param, f"must be a string, number, boolean or null, got {type(value).__name__}")
        if isinstance(value, str) and len(value) > api.max_chat_template_kwarg_chars:
            raise InvalidRequestError(param, f"at most {api.max_chat_template_kwarg_chars} characters, got {len(value)}")
    return dict(kwargs or {})


class RenderInterrupted(BaseException):
    """Raised in a render's thread when its time is up. A BaseException, so the template's and the
    tokenizer's `except Exception` handlers let it through."""


async def render_off_loop(render: Callable[[], T], limit_s: float, *, param: str) -> T:
    """`render()` in a thread of its own; an APIError 400 (`param`: the field the prompt came
    from) if it has not returned within `limit_s`, and the thread is interrupted."""
    loop = asyncio.get_running_loop()
    result: asyncio.Future[T] = loop.create_future()
    lock = threading.Lock()
    done = False

    def deliver(value=None, error: BaseException | None = None) -> None:
        if result.done():  # timed out, or the client left, meanwhile
            return
        if error is not None:
            result.set_exception(error)
        else:
            result.set_result(value)

    def run() -> None:
        nonlocal done
        try:
            try:
                value = render()
            finally:
                with lock:
                    done = True
        except RenderInterrupted:
            return  # its caller has gone on already
        except BaseException as exc:  # noqa: BLE001 - handed to the caller, raised there
            loop.call_soon_threadsafe(deliver, None, exc)
        else:
            loop.call_soon_threadsafe(deliver, value)

    thread = threading.Thread(target=run, name="kvrelay-render", daemon=True)
    thread.start()
    try:
        return await asyncio.wait_for(result, limit_s)
    except TimeoutError:
        raise APIError(
            400, f"{param}: rendering the prompt took longer than the server's limit of {limit_s:g} s; shorten it",
            param=param, code="render_timeout",
        ) from None
    finally:
        with lock:  # `done` under the lock: a render that has returned is never interrupted
            if not done:  # timed out, or the client left
                _interrupt(thread)


def _interrupt(thread: threading.Thread) -> None:
    """Raise RenderInterrupted in `thread` at its next Python instruction (CPython's
    PyThreadState_SetAsyncExc: the only way to stop a thread that runs a template's loops)."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(RenderInterrupted))
