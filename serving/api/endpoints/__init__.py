"""The HTTP API: the server and its routes (routes.py), what an endpoint reads of it
(context.py), the completion endpoints (chat.py, completions.py, responses.py) and the others
(tokenize.py, models.py, adapters.py), one request's state (calls.py), collecting a non-streamed
answer (collect.py), and bodies and server-sent events (http_io.py)."""

__all__: list[str] = []
