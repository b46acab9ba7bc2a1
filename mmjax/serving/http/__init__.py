"""OpenAI-compatible HTTP server over the serving engine (`python -m mmjax.serve`); needs the `serve` extra."""
