"""The console's static files and the headers they are served with.

Only the names in ``ASSETS`` are ever served: a request path is looked up in that table, never
joined to a directory, so no path can reach another file.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources

#: Request path -> (file in ``static/``, Content-Type).
ASSETS: dict[str, tuple[str, str]] = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/index.html": ("index.html", "text/html; charset=utf-8"),
    "/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/app.css": ("app.css", "text/css; charset=utf-8"),
    "/charts.js": ("charts.js", "text/javascript; charset=utf-8"),
    "/view-queues.js": ("view-queues.js", "text/javascript; charset=utf-8"),
    "/view-task.js": ("view-task.js", "text/javascript; charset=utf-8"),
    "/view-actions.js": ("view-actions.js", "text/javascript; charset=utf-8"),
    "/favicon.svg": ("favicon.svg", "image/svg+xml"),
    # uPlot (MIT), the charts: vendored from its npm package, unchanged (vendor/uplot/VERSION).
    "/vendor/uplot/uPlot.iife.min.js": ("vendor/uplot/uPlot.iife.min.js", "text/javascript; charset=utf-8"),
    "/vendor/uplot/uPlot.min.css": ("vendor/uplot/uPlot.min.css", "text/css; charset=utf-8"),
    "/vendor/uplot/LICENSE": ("vendor/uplot/LICENSE", "text/plain; charset=utf-8"),
}

#: Everything the console loads comes from its own origin; no inline script or style, no frames.
CONTENT_SECURITY_POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
    "object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
)

#: Sent with every static file.
ASSET_HEADERS: dict[str, str] = {
    "Cache-Control": "no-cache",
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
}


@dataclass(frozen=True)
class Asset:
    body: bytes
    content_type: str

    def headers(self) -> dict[str, str]:
        return {"Content-Type": self.content_type, **ASSET_HEADERS}


def asset_for(path: str) -> Asset | None:
    """The static file a GET of ``path`` (query string already removed) serves, or ``None``."""
    entry = ASSETS.get(path)
    if entry is None:
        return None
    name, content_type = entry
    body = resources.files(__package__).joinpath("static", *name.split("/")).read_bytes()
    return Asset(body, content_type)
