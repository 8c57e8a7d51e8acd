"""The HTTP side: the OpenAI-compatible API and the control endpoints."""
