"""Serving: greedy generation over the KV cache (`generate`), and the host side of a paged serving engine:
requests (`request`), the KV page pool with prefix caching (`kv_manager`) and the continuous-batching
scheduler (`scheduler`). The host-side modules import no JAX."""
