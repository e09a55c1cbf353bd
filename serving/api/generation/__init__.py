"""From a request's messages or prompt to text deltas, without HTTP or Ray: the Frontend
(pipeline.py) that renders, validates and detokenizes around a Backend (serving/api/backend.py),
the chat template's limits (chat_template.py), fitting the context window (context_budget.py),
tool calling before and after generation (tool_calls.py, tool_parsing.py), and coalescing a busy
stream (coalescing.py)."""

__all__: list[str] = []
