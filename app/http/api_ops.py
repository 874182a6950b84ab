"""Operations: GET /health (liveness), GET /ready (readiness), GET /metrics (Prometheus)."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from hypic_core.native.decode_matmul import kernel_status

from ..service.metrics import CONTENT_TYPE
from ..service.runtime import Runtime
from . import schemas

router = APIRouter()


@router.get("/health", response_model=schemas.Health)
async def health(request: Request) -> dict:
    """200 while the process serves HTTP, loaded or not; `guard`: the accuracy guard's state
    (app/service/guard.py), null until the model is loaded; `kernels`: the native decode kernels'
    state (hypic_core/native/decode_matmul.kernel_status: which variant runs, or why torch's ops do)."""
    guard = request.app.state.runtime.guard
    return {"status": "ok", "guard": guard.health() if guard is not None else None, "kernels": kernel_status()}


@router.get("/ready", response_model=schemas.Ready, responses=schemas.NOT_READY)
async def ready(request: Request) -> JSONResponse:
    """200 once the model and the index are loaded; 503 (with Retry-After) before, or if loading failed."""
    rt: Runtime = request.app.state.runtime
    if rt.ready:
        return JSONResponse({"status": "ready", "model": rt.model_name, "chunks": len(rt.index)})
    status = {"status": "failed", "error": rt.load_error} if rt.load_error else {"status": "loading"}
    return JSONResponse(status, status_code=503, headers={"Retry-After": str(rt.settings.retry_after_s)})


@router.get("/metrics", response_class=Response, responses=schemas.METRICS)
async def metrics(request: Request) -> Response:
    rt: Runtime = request.app.state.runtime
    return Response(rt.metrics.render(), media_type=CONTENT_TYPE)
