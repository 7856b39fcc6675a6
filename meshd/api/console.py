"""The web console on the API port: `GET /` and its static files, and `GET /v1/mesh/status`.

The page (`console/index.html`, `console.js`, `console.css`: plain files inside the package, no
CDN, no build step) polls `/v1/mesh/status` once a second and streams chat answers from
`/v1/chat/completions`. The static files hold no data, so they are served without the API key
(a browser cannot send one when it opens a URL); everything with data, the status included,
sits behind the key like the rest of the API, and the page asks for the key when a request
is refused. Like every route, the page is served only under the API's own names, and its
requests are accepted from its own origin only (`origin_policy.py`): the page's `fetch`es
are same-origin and send JSON.
"""

from __future__ import annotations

import functools
import importlib.resources
from collections.abc import Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from meshd.api.metrics import ApiMetrics

# Paths served without the API key: the page and its assets (no mesh data in them).
PUBLIC_PATHS = frozenset({"/", "/console/console.js", "/console/console.css"})
_TYPES = {
    "index.html": "text/html; charset=utf-8",
    "console.js": "text/javascript; charset=utf-8",
    "console.css": "text/css; charset=utf-8",
}

# What the node reports (`meshctl status --json`'s object), or None where there is no mesh.
StatusSource = Callable[[], dict[str, Any]]


@functools.cache
def _asset(name: str) -> bytes:
    return importlib.resources.files("meshd.api").joinpath("console", name).read_bytes()


def console_routes(
    metrics: ApiMetrics, status: StatusSource | None, model_names: Callable[[], list[str]]
) -> list[Route]:
    """The console's routes for an app whose counters are `metrics`."""

    def static(name: str) -> Callable[[Request], Any]:
        async def endpoint(request: Request) -> Response:
            # The page changes with the package; a browser must not keep an old copy.
            return Response(_asset(name), media_type=_TYPES[name],
                            headers={"Cache-Control": "no-cache"})  # fmt: skip

        return endpoint

    async def mesh_status(request: Request) -> Response:
        import msgspec

        body = {
            "node": status() if status is not None else None,
            "models": model_names(),
            "traffic": metrics.totals(),
        }
        return Response(msgspec.json.encode(body), media_type="application/json")

    return [
        Route("/", static("index.html"), methods=["GET"]),
        Route("/console/console.js", static("console.js"), methods=["GET"]),
        Route("/console/console.css", static("console.css"), methods=["GET"]),
        Route("/v1/mesh/status", mesh_status, methods=["GET"]),
    ]
