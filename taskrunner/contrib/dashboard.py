"""The dashboard and ``/metrics`` inside another application: mounted under a URL prefix of
a Django, Flask or any WSGI / ASGI application, behind that application's authentication.

`MountedDashboard` is a WSGI application. It honours ``SCRIPT_NAME`` (the prefix it is
mounted under, as every WSGI mount sets it): the dashboard's pages link to absolute paths,
so the links, form actions, redirects and the live-refresh URL of its answers get the prefix.
Before anything else it asks `allow(environ)` — the application's own check (a logged-in
staff user, a proxy's REMOTE_USER) — and answers 403 when it says no. The dashboard's own
CSRF token and same-origin check stay in force for every action: exempt its URLs from the
application's CSRF middleware, not from the dashboard's.
"""
import hashlib
import hmac
import re
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

from ..web.app import Dashboard
from ..web.auth import Guard

Environ = Dict[str, Any]
# URLs of the dashboard's HTML (and of the HTML inside /api/parts' JSON, quotes escaped).
LINKS = re.compile(rb'((?:href|src|action|data-parts)=\\?")/')


class _ApplicationGuard(Guard):
    """The application answers for the Host (its own allowed hosts) and for the user
    (`allow`): the dashboard's own Host and owner checks, made for the dashboard on a port
    of its own, step aside. Its password (if one is set) and its CSRF checks stay."""

    def host_allowed(self, header: Optional[str]) -> bool:
        return True

    def peer_allowed(self, uid: Optional[int]) -> bool:
        return True


def _forbidden(start_response: Callable[..., Any]) -> Iterable[bytes]:
    start_response("403 Forbidden", [("Content-Type", "text/plain; charset=utf-8")])
    return [b"forbidden\n"]


class _Mounted:
    """A WSGI application that asks the application's `allow(environ)` first, then answers
    with `respond(environ)`: (status, headers, body)."""
    allow: Callable[[Environ], bool]

    def respond(self, environ: Environ) -> Tuple[str, List[Tuple[str, str]], bytes]:
        raise NotImplementedError

    def __call__(self, environ: Environ, start_response: Callable[..., Any]) -> Iterable[bytes]:
        if not self.allow(environ):
            return _forbidden(start_response)
        status, headers, body = self.respond(environ)
        start_response(status, headers)
        return [body]


class MountedDashboard(_Mounted):
    """``MountedDashboard(queue, allow=...)``: the dashboard of a `TaskQueue` as a WSGI
    application to mount. `allow` is required: a dashboard mounted without a check would be
    open to whoever reaches the application (``allow=lambda environ: True`` only when the
    mount point is protected otherwise). `read_only`: None for ``[dashboard] read_only``.
    A ``[dashboard]`` password, if configured, is asked for as well.

    `csrf_secret`: the application's secret (Django's SECRET_KEY, Flask's secret_key). The
    dashboard's CSRF token is derived from it, so that every worker process of the
    application accepts the token of a page another one served; without it each process
    has a random token of its own (right for one process only)."""

    def __init__(self, queue: Any, *, allow: Callable[[Environ], bool],
                 read_only: Optional[bool] = None,
                 csrf_secret: Optional[str] = None) -> None:
        config = queue.config.dashboard
        self.allow = allow
        guard = _ApplicationGuard(config)
        if csrf_secret:
            guard.csrf_token = hmac.new(csrf_secret.encode(), b"taskrunner dashboard csrf",
                                        hashlib.sha256).hexdigest()
        self.app = Dashboard(queue.store, guard,
                             config.read_only if read_only is None else read_only)

    def respond(self, environ: Environ) -> Tuple[str, List[Tuple[str, str]], bytes]:
        """(status, headers, body) of the dashboard's answer, its URLs under SCRIPT_NAME."""
        answer: Dict[str, Any] = {}

        def start_response(status: str, headers: List[Tuple[str, str]],
                           exc_info: Any = None) -> None:
            answer.update(status=status, headers=headers)

        body = b"".join(self.app(dict(environ, PATH_INFO=environ.get("PATH_INFO") or "/"),
                                 start_response))
        prefix = environ.get("SCRIPT_NAME", "").rstrip("/")
        headers = [(name, prefix + value if name.lower() == "location" and
                    value.startswith("/") else value)
                   for name, value in answer["headers"] if name.lower() != "content-length"]
        if prefix:
            body = LINKS.sub(lambda match: match.group(1) + prefix.encode() + b"/", body)
        return answer["status"], headers + [("Content-Length", str(len(body)))], body


class MountedMetrics(_Mounted):
    """``/metrics`` of a `TaskQueue` (Prometheus text) as a WSGI application of its own, to
    mount apart from the dashboard (a scraper needs no dashboard access); `allow` as for
    `MountedDashboard`."""

    def __init__(self, queue: Any, *, allow: Callable[[Environ], bool]) -> None:
        self.store, self.allow = queue.store, allow

    def respond(self, environ: Environ) -> Tuple[str, List[Tuple[str, str]], bytes]:
        from ..errors import InputError
        from ..web import require_prometheus_client
        try:
            require_prometheus_client()
        except InputError as exc:
            # An application installed without the extra: say so to whoever asked (a
            # scraper logs the body), not a 500 and a traceback in the application's log.
            body = ("%s\n" % exc).encode()
            return "501 Not Implemented", [("Content-Type", "text/plain; charset=utf-8"),
                                           ("Content-Length", str(len(body)))], body
        from ..web.metrics import exposition
        body = exposition(self.store)
        return "200 OK", [("Content-Type", "text/plain; version=0.0.4; charset=utf-8"),
                          ("Content-Length", str(len(body)))], body
