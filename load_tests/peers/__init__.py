"""The peers kvrelay is measured against: their configurations (configs.py) and the scripts each
peer runs in its own venv (`*_peer.py`, run by path: their names must not shadow the libraries
they import, such as vllm and transformers)."""

__all__: list[str] = []
