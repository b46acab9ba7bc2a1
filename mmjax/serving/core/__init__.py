"""The engine core in its own process: the API process (HTTP, text, images) and the device loop never share a lock.

`protocol` holds the messages (typed structs, msgpack over ZeroMQ), `process` the core's busy loop (it owns the
`Engine`: scheduler, KV manager, device), `client` the API process's side (requests in, per-step token ids
out, detokenized and streamed there). See docs/serving.md, "Engine-core process".
"""
