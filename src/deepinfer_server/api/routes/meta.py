"""GET /, /health, /metrics and /version."""

from __future__ import annotations

import time
from functools import cache
from importlib.metadata import PackageNotFoundError, version

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from deepinfer_server import __version__
from deepinfer_server.api.state import AppState
from deepinfer_server.disaggregation.handoff.peers import PrefillPeers
from deepinfer_server.metrics import CONTENT_TYPE

#: What GET / answers: the server and where to start. Open, as /health is: it tells no more than
#: /version, and Claude Code probes its base URL with `HEAD /` before any request.
_ROOT = {
    "name": "deepinfer-server",
    "version": __version__,
    "links": {"openapi": "/openapi.json", "models": "/v1/models", "health": "/health"},
}


async def root(request: Request) -> Response:
    """GET / (and HEAD /, which Starlette answers with the same status and headers)."""
    return JSONResponse(_ROOT)


async def health(request: Request) -> Response:
    state: AppState = request.app.state.server
    failure = state.coordinator.failure
    if failure is not None:
        return JSONResponse({"status": "failed", "reason": failure}, status_code=503)
    if state.coordinator.draining:
        return JSONResponse(
            {"status": "draining", "reason": "the server is shutting down"}, status_code=503
        )
    if state.warmup.warming:
        return JSONResponse(
            {
                "status": "starting",
                "reason": "structured output is warming up (the grammar compile workers and the "
                "ranks' grammar builders); --no-grammar-warmup serves before",
            },
            status_code=503,
        )
    if state.peers is not None and not state.peers.all_serving:
        return JSONResponse(
            {"status": "starting", "reason": "not every API server process serves yet"},
            status_code=503,
        )
    if state.peers is not None and not state.peers.all_warm:
        return JSONResponse(
            {
                "status": "starting",
                "reason": "structured output is warming up in another API server process",
            },
            status_code=503,
        )
    if state.prefill_peers is not None:
        degraded = await _prefill_peers_health(state.prefill_peers)
        if degraded is not None:
            return degraded
    store_failure = None if state.store is None else state.store.failure
    if store_failure is not None:
        # Still a 200: the engine serves every request that does not need the store, and a
        # load balancer that took the server out would fail those too.
        return JSONResponse(
            {"status": "degraded", "reason": f"the Responses store fails: {store_failure}"}
        )
    return JSONResponse({"status": "ok"})


async def _prefill_peers_health(peers: PrefillPeers) -> Response | None:
    """A decode server's answer when its prefill peers do not all serve it (None: they do)."""
    now = time.monotonic()
    unreachable = await peers.unreachable(now)
    if unreachable:
        return JSONResponse(
            {
                "status": "degraded",
                "reason": "no answer from the prefill server(s) this decode server pulls "
                f"KV from: {', '.join(unreachable)}",
            },
            status_code=503,
        )
    refused = peers.refused(now)
    if not refused:
        return None
    # 503 only when no recent prefill peer pairs: the others' requests still succeed.
    return JSONResponse(
        {
            "status": "degraded",
            "reason": "prefill server(s) refused: their KV layout differs from this decode "
            "server's: " + "; ".join(f"{peer}: {what}" for peer, what in refused.items()),
        },
        status_code=503 if peers.all_refused(now) else 200,
    )


async def metrics(request: Request) -> Response:
    state: AppState = request.app.state.server
    return Response(await state.metrics_exposition(), media_type=CONTENT_TYPE)


@cache
def _versions() -> dict[str, str | None]:
    def installed(distribution: str) -> str | None:
        try:
            return version(distribution)
        except PackageNotFoundError:
            return None

    # Distribution metadata only: the API process never imports the engine.
    return {
        "version": __version__,
        "deepseek_recipe": installed("deepseek-recipe"),
        "deepinfer": installed("deepinfer"),
    }


async def server_version(request: Request) -> Response:
    return JSONResponse(_versions())
