"""The HTTP server: address, logging, connections and browsers (docs/api.md, "Limits and browsers"), startup failures."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from .base import AreaSettings


class ServerSettings(AreaSettings):
    """Where the gateway listens and how it treats connections."""

    host: str = Field("127.0.0.1", description="Address the gateway listens on; 0.0.0.0: every interface.")
    port: int = Field(8000, ge=0, le=65535, description="Port the gateway listens on.")
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="Least severe log records written.")
    cors_origins: list[str] = Field([], description='Browser origins allowed to call the API, e.g. ["http://localhost:3000"].')
    allowed_hosts: list[str] | None = Field(None, description='Host header names served, e.g. ["api.example.com", "*.example.com"]; '
                                            '["*"]: any. Unset: localhost names when bound to a loopback address, also the bound '
                                            'name when bound to one, any when bound to all interfaces (0.0.0.0, ::). localhost, '
                                            '127.0.0.1 and [::1] are always allowed, and the probes answer any host.')
    keep_alive_timeout_s: float = Field(5.0, gt=0, description="An idle connection is closed this long after its last response.")
    header_timeout_s: float = Field(10.0, gt=0, description="A request's head must arrive within this long of the connection's "
                                    "start or the previous response's end, else 408 and the connection is closed.")
    body_timeout_s: float = Field(30.0, gt=0, description="A request body that stops arriving for this long gets a 408.")
    body_deadline_s: float = Field(120.0, gt=0, description="A request body not complete this long after its head arrived "
                                   "gets a 408 (a body trickling in a byte now and then never trips body_timeout_s).")
    max_headers: int = Field(100, ge=1, description="Header fields per request; beyond: 431.")
    max_header_bytes: int = Field(16 << 10, ge=1024, description="Bytes of header fields per request; beyond: 431 (or 400 "
                                  "from uvicorn for a head arriving in pieces).")
    sse_keepalive_s: float = Field(15.0, gt=0, description="A stream that has nothing to send for this long sends a "
                                   "': keep-alive' comment, so proxies do not close it.")
    exit_on_load_failure: bool = Field(True, description="When loading the model or index fails, `hypic serve` exits non-zero "
                                       "with the reason, so a supervisor (Compose's restart policy) sees it; false: stay up, "
                                       "/ready answering 503 with the reason.")

    @property
    def trusted_hosts(self) -> list[str]:
        """The Host names served (`allowed_hosts` resolved): ["*"] or a list with the loopback names."""
        loopback = ["localhost", "127.0.0.1", "[::1]"]
        if self.allowed_hosts is not None:
            return ["*"] if "*" in self.allowed_hosts else [*self.allowed_hosts, *loopback]
        if self.host in ("0.0.0.0", "::", ""):  # all interfaces: a compose service name, a LAN address, ...
            return ["*"]
        bound = f"[{self.host}]" if ":" in self.host and not self.host.startswith("[") else self.host
        return list(dict.fromkeys([*loopback, bound]))
