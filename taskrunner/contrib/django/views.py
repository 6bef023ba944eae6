"""The dashboard and ``/metrics`` as Django views, behind Django's authentication::

    urlpatterns = [path("admin/taskrunner/", include("taskrunner.contrib.django.urls")), ...]

Staff users only (``is_active`` and ``is_staff``); anyone else gets 403. The dashboard keeps
its own CSRF token (derived from SECRET_KEY, so every worker process accepts it) and its
same-origin check; Django's CSRF middleware is not asked, since the dashboard's forms carry
the dashboard's token, not Django's.
"""
import io
from typing import Any, Dict, Optional

from django.conf import settings
from django.http import HttpRequest, HttpResponse
from django.views.decorators.csrf import csrf_exempt

from ..dashboard import MountedDashboard, MountedMetrics
from .compat import tasks

_mounted: Dict[str, Any] = {}


def is_staff(request: HttpRequest) -> bool:
    user = getattr(request, "user", None)
    return bool(user is not None and user.is_active and user.is_staff)


def _environ(request: HttpRequest, path: str) -> Dict[str, Any]:
    """A WSGI environ of the request with the view's URL as SCRIPT_NAME (ASGI requests have
    no wsgi.input: the body Django read is given instead)."""
    script_name = request.path[:len(request.path) - len(path)] if path else request.path
    return dict(request.META, SCRIPT_NAME=script_name.rstrip("/"), PATH_INFO="/" + path,
                **{"wsgi.input": io.BytesIO(request.body),
                   "CONTENT_LENGTH": str(len(request.body))})


def _app(kind: str, backend: str) -> Any:
    key = "%s:%s" % (kind, backend)
    if key not in _mounted:
        queue = tasks.package.task_backends[backend].queue()
        _mounted[key] = MountedDashboard(queue, allow=lambda environ: True,
                                         csrf_secret=settings.SECRET_KEY) \
            if kind == "dashboard" else MountedMetrics(queue, allow=lambda environ: True)
    return _mounted[key]


def _response(app: Any, request: HttpRequest, path: str) -> HttpResponse:
    status, headers, body = app.respond(_environ(request, path))
    response = HttpResponse(body, status=int(status.split(" ", 1)[0]))
    for name, value in headers:
        response[name] = value
    return response


@csrf_exempt
def dashboard(request: HttpRequest, path: str = "", backend: str = "default") -> HttpResponse:
    if not is_staff(request):
        return HttpResponse("forbidden\n", status=403, content_type="text/plain")
    return _response(_app("dashboard", backend), request, path)


@csrf_exempt
def metrics(request: HttpRequest, backend: str = "default",
            allow: Optional[Any] = None) -> HttpResponse:
    """``/metrics``; staff only unless the URLconf passes another check as `allow`
    (``path("metrics", metrics, {"allow": lambda request: ...})``)."""
    if not (allow or is_staff)(request):
        return HttpResponse("forbidden\n", status=403, content_type="text/plain")
    return _response(_app("metrics", backend), request, "")
