"""The OpenAI wire: request models (wire.py) and their structured-output fields (structured.py),
which fields kvrelay implements per endpoint (field_support.py), the OpenAPI document built from
the models (openapi.py), and a prompt's logprobs in the shapes clients read (prompt_scores.py)."""

__all__: list[str] = []
