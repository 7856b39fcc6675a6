"""meshd: pool the machines of a home or lab into one LLM server."""

__version__ = "0.1.0"
