"""Whether, when and how a request is let in: its API key (keys.py), what one request may ask for
(limits.py), its key's rate limits (rate_limits.py), its deadline (deadlines.py), and graceful
degradation to a fallback app when the pools refuse it (degradation.py, forwarding.py)."""

__all__: list[str] = []
