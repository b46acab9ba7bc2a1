"""Serving: a paged, continuous-batching engine (`engine`: `Engine`, `LLM`) over a model runner (`runner`); its
host side, requests (`request`), the KV page pool with prefix caching (`kv_manager`) and the scheduler
(`scheduler`), imports no JAX. Training-time evaluation generates through the same engine."""
