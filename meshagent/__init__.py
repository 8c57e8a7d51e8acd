"""meshagent: a peer-to-peer mesh that serves large language models."""

__version__ = "0.1.0"
