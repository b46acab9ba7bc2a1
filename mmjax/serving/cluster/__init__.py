"""Serving past one process: engine replicas on Ray Serve behind a prefix-aware router (the `cluster` extra).

`spec` names what every replica serves, `replica` is one engine (the single server's app, driven in-process),
`router` the routing rule and `ray_router` its Ray Serve request router, `ingress` the OpenAI-compatible front
that forwards and retries, `app` builds the Ray Serve application (also a `serve run` import path) and `launch`
runs it for `python -m mmjax.serve --replicas N`. Nothing outside this package imports Ray.
"""
