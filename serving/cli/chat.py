"""`kvrelay chat "..."`: a small streaming client for any OpenAI-compatible server."""

from __future__ import annotations

import json
import os
import sys

import httpx

__all__ = ["chat"]


def chat(
    message: str, *, url: str, model: str | None, max_tokens: int | None, temperature: float | None,
    system: str | None, api_key: str | None, out=sys.stdout,
) -> int:
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": message}]
    body: dict = {"messages": messages, "stream": True, "stream_options": {"include_usage": True}}
    if model:
        body["model"] = model
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    if temperature is not None:
        body["temperature"] = temperature
    headers = {}
    key = api_key or os.environ.get("OPENAI_API_KEY")
    if key:
        headers["Authorization"] = f"Bearer {key}"
    usage = None
    try:
        with httpx.Client(base_url=url.rstrip("/"), timeout=httpx.Timeout(600, connect=10)) as client:
            with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as response:
                if response.status_code != 200:
                    response.read()
                    print(f"error {response.status_code}: {_error_message(response.text)}", file=sys.stderr)
                    return 1
                for line in response.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[len("data: "):]
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        print(f"\nerror: {chunk['error'].get('message')}", file=sys.stderr)
                        return 1
                    for choice in chunk.get("choices", []):
                        out.write(choice.get("delta", {}).get("content") or "")
                        out.flush()
                    usage = chunk.get("usage") or usage
    except httpx.HTTPError as exc:
        print(f"error: cannot reach {url} ({exc}); is `make serve` running?", file=sys.stderr)
        return 1
    out.write("\n")
    if usage:
        print(f"[{usage['prompt_tokens']} prompt + {usage['completion_tokens']} completion tokens]", file=sys.stderr)
    return 0


def _error_message(text: str) -> str:
    try:
        return json.loads(text)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return text
