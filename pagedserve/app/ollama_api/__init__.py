"""Ollama's API (``/api/chat``, ``/api/generate``, ``/api/embed``, ``/api/tags``, ...) on the chat route's path."""
