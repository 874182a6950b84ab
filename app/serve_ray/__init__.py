"""Several gateway replicas on Ray Serve, with a chunk-aware router (`hypic serve-ray`; docs/deploy-ray.md).

- directory.py: which replica holds which chunk; the routing policy (no Ray).
- keys.py: a request's routing keys, from its body and the shared index (no Ray).
- asgi.py: an HTTP request carried between deployments; serving it with an ASGI app.
- router.py: `ChunkAffinityRouter`, the Ray Serve request router.
- deployments.py: the ingress and gateway deployments, `build_application`, `run`.
"""
