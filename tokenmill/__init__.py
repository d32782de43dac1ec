"""tokenmill: an OpenAI-compatible Text Completions server with its own inference engine."""

__version__ = "0.1.0"
