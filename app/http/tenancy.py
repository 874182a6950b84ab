"""The tenant of a request on the HTTP side (app/service/tenants.py has the rest).

`middleware.ApiKey` puts the tenant its key opens in `scope["state"]["tenant"]`; without keys every
request is the tenant 'default'. `tenant_of(request)` reads it; a route never takes a tenant, a
collection owner or a cache salt from the request itself.

`TenantLimit` (inside `ApiKey`) counts each tenant's requests in flight, refuses one past
`tenant_max_requests` with a 429 and Retry-After, and counts requests by tenant and status on
/metrics (`hypic_tenant_*`, label values bounded by `TenantLabels`). The probes pass untouched.
"""

from __future__ import annotations

from fastapi import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..service.errors import QuotaExceededError
from ..service.runtime import Runtime
from ..service.tenants import DEFAULT_TENANT
from .errors import from_quota
from .middleware import OPEN_PATHS


def tenant_of(request: Request) -> str:
    """The tenant `request` acts for (set by `ApiKey` from its key; 'default' without keys)."""
    return scope_tenant(request.scope)


def scope_tenant(scope: Scope) -> str:
    return scope.get("state", {}).get("tenant", DEFAULT_TENANT)


class TenantLimit:
    def __init__(self, app: ASGIApp, runtime: Runtime) -> None:
        self.app = app
        self.runtime = runtime

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        rt, tenant = self.runtime, scope_tenant(scope)
        label = rt.tenant_labels(tenant)
        try:
            rt.quotas.enter(tenant)
        except QuotaExceededError as exc:
            rt.metrics.tenant_refused.labels(label, exc.limit).inc()
            rt.metrics.tenant_requests.labels(label, "429").inc()
            return await from_quota(exc, rt.settings.retry_after_s).response()(scope, receive, send)
        status = None

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        rt.metrics.tenant_in_flight.labels(label).inc()
        try:
            await self.app(scope, receive, send_status)
        finally:
            rt.quotas.leave(tenant)
            rt.metrics.tenant_in_flight.labels(label).dec()
            rt.metrics.tenant_requests.labels(label, str(status or 500)).inc()
