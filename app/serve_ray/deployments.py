"""The Ray Serve application: an ingress in front of N gateway replicas.

    app = build_application(settings)       # Ingress -> GatewayReplica x settings.ray_replicas
    serve.run(app, name="hypic", route_prefix="/")

A request's life: Ray's HTTP proxy -> `Ingress` (reads the body, up to `max_body_bytes`; names
the chunks the prompt will hold, running the retrieval of /query and `rag` requests itself on
the shared index: app/serve_ray/keys.py) -> the gateway deployment's handle, whose
`ChunkAffinityRouter` (app/serve_ray/router.py) picks the replica holding most of those chunks
within the load bound -> `GatewayReplica.forward` runs the request through the replica's gateway
app (the app `hypic serve` serves, from `create_app`) and streams the response back part by part
(SSE included) -> the ingress writes it to the client. Every response carries `X-Hypic-Replica`,
the id of the replica that served it; a request with that header goes to that replica (operations:
one replica's /metrics or /ready), unless no such replica is running.

Why an ingress that retrieves: a request's chunks are only known after retrieval, and a Ray
request router sees a request's arguments, not an HTTP body; the ingress turns the body into
routing keys on the argument the router reads (docs/deploy-ray.md weighs the alternatives).
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from pathlib import Path

import anyio
from ray import serve
from ray.serve.config import RequestRouterConfig

from ..http.errors import APIError
from ..service.runtime import corpus_to_seed
from ..service.settings import Settings
from .asgi import REPLICA_HEADER, ForwardedRequest, serve_asgi
from .keys import routing_keys, tenant_of_headers
from .router import ChunkAffinityRouter

log = logging.getLogger("hypic.serve_ray")
APP_NAME = "hypic"


class GatewayReplica:
    """One gateway: the app of `create_app(settings)`, with its lifespan (loading on start, the
    engine thread stopped on shutdown). Serves the requests the ingress forwards (`forward`). Not an
    HTTP ingress itself: a Serve application has one, the `Ingress`."""

    async def __init__(self, settings: Settings) -> None:
        from ..http.server import create_app
        from ..service import logs

        logs.configure(settings.log_level)
        self.settings = settings
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.gateway = create_app(settings)
        self._lifespan = self.gateway.router.lifespan_context(self.gateway)
        await self._lifespan.__aenter__()

    def check_health(self) -> None:
        """Serve calls this every `ray_health_check_s`; raising marks the replica unhealthy, and
        Serve stops it and starts another. So a replica whose model or index failed to load (with
        `exit_on_load_failure`, the default: `hypic serve` would exit) or whose engine thread has
        died is replaced instead of answering 503 for good. One still loading is healthy."""
        runtime = self.gateway.state.runtime
        if runtime.load_error is not None and self.settings.exit_on_load_failure:
            raise RuntimeError(f"this replica cannot serve: {runtime.load_error}")
        if not runtime.engine_thread.alive:
            raise RuntimeError("this replica's engine thread has stopped")

    async def __del__(self) -> None:
        lifespan, self._lifespan = getattr(self, "_lifespan", None), None
        if lifespan is not None:
            await lifespan.__aexit__(None, None, None)

    async def forward(self, request: ForwardedRequest):
        """The response to `request`, streamed: its start, then body parts (app/serve_ray/asgi.py)."""
        async for part in serve_asgi(self.gateway, request, ((REPLICA_HEADER, self.replica_id.encode()),)):
            yield part


@serve.ingress()
class Ingress:
    """Routes every HTTP request to a gateway replica through `gateway` (a handle)."""

    def __init__(self, gateway, settings: Settings) -> None:
        self.gateway = gateway.options(stream=True)
        self.settings = settings
        self._index = None
        self._index_lock = threading.Lock()
        self._index_failed = False
        # Keys by digest, to tell the default tenant's requests (the only ones whose chunks the ingress can name).
        self._tenants = {hashlib.sha256(k.encode()).digest(): t for k, t in settings.tenant_keys.items()}

    def __serve_build_asgi_app__(self):
        async def app(scope, receive, send) -> None:  # a function: uvicorn takes a bound method for ASGI2
            await self.asgi(scope, receive, send)

        return app

    async def asgi(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            while (message := await receive())["type"] != "lifespan.shutdown":
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["type"] != "http":
            return
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            if len(body) > self.settings.max_body_bytes:
                error = APIError(413, f"body: request body exceeds the limit of {self.settings.max_body_bytes} bytes",
                                 param="body", code="body_too_large")
                return await _send_json(send, error.status, error.body())
            if not message.get("more_body", False):
                break
        search = self._search if tenant_of_headers(scope["headers"], self._tenants) == "default" else None
        keys = await anyio.to_thread.run_sync(lambda: routing_keys(scope["method"], scope["path"], scope.get("query_string", b""),
                                                                   bytes(body), search, self.settings.default_top_k))
        request = ForwardedRequest.from_scope(scope, bytes(body), keys)
        parts = self.gateway.forward.remote(request)
        started = finished = False
        try:
            async for part in parts:
                if "status" in part:
                    started = True
                    await send({"type": "http.response.start", "status": part["status"], "headers": part["headers"]})
                else:
                    await send({"type": "http.response.body", "body": part["body"], "more_body": True})
            finished = True
        except Exception as exc:
            log.warning("forwarding failed", extra={"error": repr(exc), "path": scope["path"]})
            if not started:
                error = APIError(503, "no gateway replica could serve the request; retry", type="unavailable_error",
                                 code="replica_unavailable")
                return await _send_json(send, error.status, error.body())
        finally:
            if not finished:
                try:
                    parts.cancel()  # the client went away (or the replica failed): stop the generation
                except Exception:  # noqa: BLE001 - a call that never reached a replica re-raises its failure here
                    pass
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    def _search(self, query: str, top_k: int, document_ids) -> list[str]:
        """Chunk ids of the `top_k` chunks closest to `query` in the shared index (opened read-only
        on first use; if it cannot be opened, routing goes without retrieved chunks)."""
        index = self._open_index()
        if index is None:
            return []
        return [hit.chunk.chunk_id for hit in index.search(query, min(top_k, self.settings.max_top_k), document_ids)]

    def _open_index(self):
        with self._index_lock:
            if self._index is None and not self._index_failed:
                try:
                    from ..service.runtime import load_index

                    if self.settings.torch_threads:
                        import torch

                        torch.set_num_threads(self.settings.torch_threads)
                    self._index = load_index(self.settings)
                except Exception as exc:
                    self._index_failed = True
                    log.warning("cannot open the index for routing; routing without retrieved chunks",
                                extra={"index_dir": str(self.settings.index_dir), "error": repr(exc)})
            return self._index


async def _send_json(send, status: int, payload: dict) -> None:
    body = json.dumps(payload).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def absolute(settings: Settings) -> Settings:
    """`settings` with its relative paths made absolute here, so replicas started in other
    working directories (other nodes: a shared file system) read the same files."""
    update = {}
    for name in ("index_dir", "cache_dir", "corpus_path", "models_dir"):
        value = getattr(settings, name)
        if isinstance(value, Path) and not value.is_absolute():
            update[name] = value.resolve()
    if Path(settings.model).exists() and not Path(settings.model).is_absolute():
        update["model"] = str(Path(settings.model).resolve())
    # `corpus_to_seed` tells the demo corpus apart by the default (relative) index_dir: keep its answer.
    fields = (set(settings.model_fields_set) | set(update)) - {"corpus_path"}
    if corpus_to_seed(settings) is not None:
        fields.add("corpus_path")
    copy = settings.model_copy(update=update)
    copy.__pydantic_fields_set__ = fields
    return copy


def build_application(settings: Settings):
    """The Serve application of `settings`: `ray_replicas` gateway replicas behind one ingress,
    routed by `ray_router` (chunk or pow2) with `ray_load_bound` and `ray_directory_keys`."""
    settings = absolute(settings)
    gpus = settings.ray_replica_gpus if settings.ray_replica_gpus is not None else (1.0 if settings.device.startswith("cuda") else 0.0)
    max_ongoing = settings.ray_max_ongoing_requests or settings.max_running + settings.max_queue
    router = RequestRouterConfig(request_router_class=ChunkAffinityRouter,
                                 request_router_kwargs={"policy": settings.ray_router, "load_bound": settings.ray_load_bound,
                                                        "max_keys": settings.ray_directory_keys})
    # Serve's own access log line per call (ingress and replica) only when debugging; the gateway logs its own.
    logging = {"enable_access_log": settings.log_level == "debug"}
    gateway = serve.deployment(GatewayReplica, name="gateway").options(
        num_replicas=settings.ray_replicas, max_ongoing_requests=max_ongoing, request_router_config=router,
        ray_actor_options={"num_cpus": settings.ray_replica_cpus, "num_gpus": gpus},
        health_check_period_s=settings.ray_health_check_s, health_check_timeout_s=max(30.0, settings.ray_health_check_s),
        graceful_shutdown_timeout_s=10, logging_config=logging)
    ingress = serve.deployment(Ingress, name="ingress").options(
        num_replicas=settings.ray_ingress_replicas, max_ongoing_requests=10_000, ray_actor_options={"num_cpus": 0},
        logging_config=logging)
    return ingress.bind(gateway.bind(settings), settings)


def run(settings: Settings, ready: "threading.Event | None" = None, stop: "threading.Event | None" = None) -> None:
    """Join (or start) Ray, serve the application on `settings.host`:`settings.port` until
    SIGINT/SIGTERM (or `stop`), then delete it. `ready` is set once every replica is up."""
    import signal

    import ray

    stop = stop or threading.Event()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
    ray.init(address=settings.ray_address, include_dashboard=False, ignore_reinit_error=True,
             log_to_driver=settings.log_level == "debug")
    serve.start(http_options={"host": settings.host, "port": settings.port})
    try:
        serve.run(build_application(settings), name=APP_NAME, route_prefix="/")
        log.info("serving", extra={"url": f"http://{settings.host}:{settings.port}", "replicas": settings.ray_replicas,
                                   "router": settings.ray_router})
        if ready is not None:
            ready.set()
        stop.wait()
    finally:
        try:
            serve.delete(APP_NAME)
            serve.shutdown()
        finally:
            ray.shutdown()
