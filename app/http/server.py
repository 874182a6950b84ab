"""The app factory.

    app = create_app(Settings())                        # loads settings.model and index_dir
    app = create_app(settings, engine=eng, index=idx)   # or given objects / zero-arg factories

A request's life: `RequestContext` tags it with a request id -> `HeaderLimit` counts its headers
-> `HostCheck` checks its Host -> CORS (when origins are set) -> `ApiKey` checks the key (or,
without a key, `OriginCheck` refuses cross-site writes) ->
`TenantLimit` counts the key's tenant's requests in flight (or 429) -> `BodyLimit` caps the body and its pace -> the route validates the body (pydantic; errors become 400s naming
the field) -> `pipeline` retrieves on a thread, builds segments (`Prompter`) and checks them
against the engine -> the `EngineThread` admits it (or 429) and runs prefill + decode on an engine
thread -> the route reads the `TokenStream` on the event loop and answers with JSON or SSE.
Loading starts when the app starts (lifespan) and runs in the background: /ready is 503 until
it finishes. The engine thread is stopped when the app shuts down.
"""

from __future__ import annotations

from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from ..service.runtime import EngineSource, IndexSource, Runtime
from ..service.settings import Settings
from . import api_documents, api_openai, api_ops, api_query, errors, page, schemas
from .middleware import OPEN_PATHS, ApiKey, BodyLimit, HeaderLimit, HostCheck, OriginCheck, RequestContext
from .tenancy import TenantLimit


def create_app(settings: Settings | None = None, engine: EngineSource = None, index: IndexSource = None) -> FastAPI:
    """A gateway app; nothing is loaded until the app starts."""
    settings = settings or Settings()
    runtime = Runtime(settings, engine, index)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        runtime.start_loading()
        yield
        runtime.close()

    app = FastAPI(title="hypic-gateway", version="0.1.0", lifespan=lifespan)
    app.state.runtime = runtime
    app.openapi = lambda: schemas.openapi(app, secured=bool(settings.tenant_keys), open_paths=OPEN_PATHS)
    errors.install(app)
    for module in (api_query, api_openai, api_documents, api_ops, page):  # page: the static page at / (page.py)
        app.include_router(module.router)
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes, idle_timeout=settings.body_timeout_s,
                       deadline=settings.body_deadline_s)
    app.add_middleware(TenantLimit, runtime=runtime)  # inside ApiKey: it knows the tenant
    if settings.tenant_keys:
        app.add_middleware(ApiKey, keys=settings.tenant_keys, open_files=page.PATHS)
    else:
        app.add_middleware(OriginCheck, allowed_origins=settings.cors_origins)
    if settings.cors_origins:  # outside ApiKey: browsers send preflight requests without credentials
        app.add_middleware(CORSMiddleware, allow_origins=settings.cors_origins, allow_methods=["GET", "POST", "DELETE"],
                           allow_headers=["Authorization", "Content-Type", "X-Request-ID", "X-Requested-With"],
                           expose_headers=["X-Request-ID"])
    app.add_middleware(HostCheck, allowed=settings.trusted_hosts)
    app.add_middleware(HeaderLimit, max_headers=settings.max_headers, max_bytes=settings.max_header_bytes)
    app.add_middleware(RequestContext, metrics=runtime.metrics)  # added last: outermost
    return app

