"""The dashboard as a WSGI application on the standard library's HTTP server: a
small router, the checks of who asks (Host, the connection's owner, the password: auth.py),
CSRF-checked actions, and ``/metrics``.

Requests are served by a fixed set of worker threads, each keeping its own database
connection (closed after an error, opened again by the next request). Actions are POSTs
carrying the page's CSRF token (and, when the browser sends one, an Origin of this host);
bulk actions show a confirmation page first.
"""
import base64
import json
import logging
import re
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple
from urllib.parse import parse_qsl, quote, unquote
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from ..runs import control, queues, rotation
from ..periodic import scheduler as periodic
from ..reads import summaries, workflows
from ..reads.workflows import WorkflowNotFound
from ..errors import InputError, StateError, TaskNotFound
from . import pages
from .assets import CSS, JS
from .auth import Guard, parse_bind, peer_uid
from .html import H, page, query

log = logging.getLogger("taskrunner.dashboard")

BULK_LIMIT = 1000
SLOW_COUNT = 0.02   # seconds
MAX_BODY = 65536
HEADERS = [("Content-Security-Policy", "default-src 'self'; img-src 'self' data:; "
            "frame-ancestors 'none'; form-action 'self'"),
           ("X-Content-Type-Options", "nosniff"), ("X-Frame-Options", "DENY"),
           ("Referrer-Policy", "same-origin"), ("Cache-Control", "no-store")]
PAGES: Dict[str, Tuple[str, Callable[..., str], Optional[str]]] = {
    "/": ("Overview", pages.overview, "overview"),
    "/runners": ("Runners", pages.runners, "runners"),
    "/tasks": ("Tasks", pages.tasks, None),
    "/workflows": ("Workflows", pages.workflows_list, None),
    "/failures": ("Failures", pages.failures, None),
    "/periodic": ("Periodic tasks", pages.periodic, None),
}
TASK_PATH = re.compile(r"^/tasks/([0-9]{1,18})$")
WORKFLOW_PATH = re.compile(r"^/workflows/([0-9]{1,18})$")
WORKFLOW_CANCEL = re.compile(r"^/workflows/([0-9]{1,18})/cancel$")
TASK_ACTION = re.compile(r"^/tasks/([0-9]{1,18})/(retry|rerun|cancel|delete)$")

Response = Tuple[str, List[Tuple[str, str]], bytes]
# What an action did travels to the next page in a cookie, not in the URL: a link cannot
# forge it, a bookmark or a reload does not repeat it. Short-lived, and cleared by the page
# that shows it.
NOTICE_COOKIE = "taskrunner_notice"
NOTICE_SECONDS = 60
NOTICE_LENGTH = 500
# The uid of the socket at the other end of the request's connection (auth.peer_uid), set by
# this module's server; a request without it comes from nobody known.
PEER_UID = "taskrunner.peer_uid"


def _html(text: str, code: str = "200 OK") -> Response:
    return code, [("Content-Type", "text/html; charset=utf-8")], text.encode()


def _notice_cookie(environ: Dict[str, Any], value: str, seconds: int) -> Tuple[str, str]:
    # Scoped to the dashboard: its mount point when mounted in an application.
    path = environ.get("SCRIPT_NAME", "").rstrip("/") or "/"
    return "Set-Cookie", "%s=%s; Max-Age=%d; Path=%s; HttpOnly; SameSite=Strict" % (
        NOTICE_COOKIE, value, seconds, path)


def _requester(environ: Dict[str, Any]) -> str:
    """Who asked, for the records of an operator's action on the dashboard: the HTTP Basic
    user name when one was given, and the address the request came from."""
    user = ""
    authorization = environ.get("HTTP_AUTHORIZATION") or ""
    if authorization.startswith("Basic "):
        try:
            user = base64.b64decode(authorization[6:], validate=True).decode().split(":", 1)[0]
        except (ValueError, UnicodeDecodeError):
            user = ""
    return "dashboard%s@%s" % (" " + user if user else "", environ.get("REMOTE_ADDR", "?"))


def _redirect(environ: Dict[str, Any], location: str, notice: str) -> Response:
    """303 to `location`, whose page shows `notice` once."""
    return "303 See Other", [("Location", location), _notice_cookie(
        environ, quote(notice[:NOTICE_LENGTH], safe=""), NOTICE_SECONDS)], b""


def _notice_of(environ: Dict[str, Any]) -> Optional[str]:
    """The notice an action left for this page, if any."""
    for pair in environ.get("HTTP_COOKIE", "").split(";"):
        name, _, value = pair.strip().partition("=")
        if name == NOTICE_COOKIE and value:
            return unquote(value)
    return None


def _refused(text: str) -> Response:
    return "403 Forbidden", [("Content-Type", "text/plain; charset=utf-8")], text.encode()


class Dashboard:
    """The WSGI application on one store."""

    def __init__(self, store: Any, guard: Guard, read_only: bool = False):
        self.store, self.guard, self.read_only = store, guard, read_only
        self.totals = summaries.RunTotals()
        self.succeeded: Optional[int] = None      # kept by `keep_counts`
        self.view = pages.View(store, guard.csrf_token, read_only, lambda: self.succeeded)

    def __call__(self, environ: Dict[str, Any], start_response: Callable) -> Iterable[bytes]:
        try:
            code, headers, body = self.respond(environ)
        except BaseException:
            # This worker's connection may be broken (a server restart): the worker's next
            # request opens a new one. Otherwise each worker keeps its connection.
            self.store.close()
            raise
        start_response(code, headers + HEADERS + [("Content-Length", str(len(body)))])
        return [b""] if environ.get("REQUEST_METHOD") == "HEAD" else [body]

    def respond(self, environ: Dict[str, Any]) -> Response:
        host = environ.get("HTTP_HOST")
        if not self.guard.host_allowed(host):
            return _refused("unknown Host %r: this dashboard answers IP addresses, localhost "
                            "names, its own host's name and [dashboard] allowed_hosts only\n"
                            % (host or "")[:200])
        method = environ.get("REQUEST_METHOD", "GET")
        path = environ.get("PATH_INFO", "/")
        authorization = environ.get("HTTP_AUTHORIZATION")
        if path == "/metrics" and method in ("GET", "HEAD") \
                and self.guard.allows_metrics(authorization):
            return self.get(path, {}, None)
        if not self.guard.peer_allowed(environ.get(PEER_UID)):
            return _refused("this dashboard answers its owner only (the user running it, "
                            "on this host); set [dashboard] password_hash or password_env "
                            "to let others in, metrics_password_hash or metrics_password_env "
                            "for /metrics alone\n")
        if not self.guard.allows(authorization):
            return ("401 Unauthorized", [("WWW-Authenticate", 'Basic realm="taskrunner"'),
                                         ("Content-Type", "text/plain")], b"password required\n")
        params = dict(parse_qsl(environ.get("QUERY_STRING", ""), keep_blank_values=True))
        try:
            if method == "POST":
                return self.post(environ, path)
            if method not in ("GET", "HEAD"):
                return "405 Method Not Allowed", [("Allow", "GET, POST")], b""
            notice = _notice_of(environ)
            code, headers, body = self.get(path, params, notice)
            if notice is not None and dict(headers).get("Content-Type", "").startswith(
                    "text/html"):
                headers = headers + [_notice_cookie(environ, "", 0)]    # shown once
            return code, headers, body
        except (TaskNotFound, WorkflowNotFound) as exc:
            return self.error(path, str(exc), "404 Not Found")
        except InputError as exc:
            return self.error(path, str(exc), "400 Bad Request")

    def error(self, path: str, message: str, code: str) -> Response:
        return _html(page(code.split(" ", 1)[1], path, H('<p class="notice">%s</p>') % message,
                          read_only=self.read_only), code)

    # -- GET ----------------------------------------------------------------------------------

    def get(self, path: str, params: Dict[str, str], notice: Optional[str]) -> Response:
        if path == "/static/app.css":
            return "200 OK", [("Content-Type", "text/css; charset=utf-8")], CSS.encode()
        if path == "/static/app.js":
            return "200 OK", [("Content-Type", "text/javascript; charset=utf-8")], JS.encode()
        if path == "/metrics":
            from .metrics import exposition
            return "200 OK", [("Content-Type", "text/plain; version=0.0.4; charset=utf-8")], \
                exposition(self.store, self.totals, self.succeeded)
        if path == "/api/parts":
            return "200 OK", [("Content-Type", "application/json")], json.dumps(
                pages.live_parts(self.view, params)).encode()
        match = TASK_PATH.match(path)
        if match:
            task_id = int(match.group(1))
            body = pages.task(self.view, params, task_id)
            return _html(page("Task %d" % task_id, path, body, notice,
                              "/api/parts?page=task&id=%d" % task_id, self.read_only))
        match = WORKFLOW_PATH.match(path)
        if match:
            workflow_id = int(match.group(1))
            body = pages.workflow(self.view, params, workflow_id)
            return _html(page("Workflow %d" % workflow_id, path, body, notice,
                              "/api/parts?page=workflow&id=%d" % workflow_id, self.read_only))
        if path not in PAGES:
            return self.error(path, "no page at %s" % path, "404 Not Found")
        title, render, live = PAGES[path]
        return _html(page(title, path, render(self.view, params), notice,
                          "/api/parts?page=%s" % live if live else None, self.read_only))

    # -- POST ---------------------------------------------------------------------------------

    def post(self, environ: Dict[str, Any], path: str) -> Response:
        if self.read_only:
            return self.error(path, "the dashboard is read-only", "403 Forbidden")
        origin = environ.get("HTTP_ORIGIN")
        host = environ.get("HTTP_HOST", "")
        if origin and origin.split("://", 1)[-1] != host:
            return self.error(path, "cross-site request refused", "403 Forbidden")
        try:
            length = int(environ.get("CONTENT_LENGTH") or 0)
        except ValueError:
            length = 0
        if length > MAX_BODY:
            return self.error(path, "request too large", "413 Payload Too Large")
        form = dict(parse_qsl(environ["wsgi.input"].read(length).decode("utf-8", "replace")))
        if not self.guard.csrf_ok(form.get("csrf")):
            return self.error(path, "missing or wrong CSRF token: reload the page and try "
                              "again", "403 Forbidden")
        match = TASK_ACTION.match(path)
        if match:
            task_id, verb = int(match.group(1)), match.group(2)
            if verb == "delete":
                if form.get("confirm") != "yes":
                    return _html(page("Confirm: delete task %d" % task_id, path,
                                      pages.confirm_delete(self.view, task_id),
                                      read_only=self.read_only))
                refused = rotation.delete_finished(self.store, [task_id])[task_id]
                if refused is None:
                    return _redirect(environ, "/tasks", "task %d deleted" % task_id)
                return _redirect(environ, "/tasks/%d" % task_id, str(refused))
            try:
                if verb == "retry":
                    control.retry(self.store, task_id)
                    notice = "task %d re-armed" % task_id
                elif verb == "rerun":
                    run_id = control.rerun_from(
                        self.store, task_id, form.get("step", ""),
                        reason=form.get("reason") or None, requested_by=_requester(environ))
                    notice = "task %d runs again from step %s (run %d)" % (
                        task_id, form.get("step"), run_id)
                else:
                    stopping = control.cancel(self.store, task_id)
                    notice = ("task %d: its running run %d is asked to stop; it ends cancelled"
                              % (task_id, stopping)) if stopping is not None \
                        else "task %d cancelled" % task_id
            except (StateError, TaskNotFound, InputError) as exc:
                notice = str(exc)
            return _redirect(environ, "/tasks/%d" % task_id, notice)
        match = WORKFLOW_CANCEL.match(path)
        if match:
            return _redirect(environ, "/workflows", self.cancel_workflow(int(match.group(1))))
        if path == "/periodic/run":
            name = form.get("name", "")
            try:
                notice = "periodic task %r: task %d submitted" % (
                    name, periodic.run_now(self.store, name))
            except StateError as exc:
                notice = str(exc)
            return _redirect(environ, "/periodic", notice)
        if path == "/periodic/alter":
            name = form.get("name", "")
            try:
                periodic.alter_periodic(self.store, name, **pages.alter_changes(form))
                notice = "periodic task %r altered" % name
            except InputError as exc:
                notice = "nothing changed: %s" % exc
            return _redirect(environ, "/periodic", notice)
        if path == "/periodic/backfill":
            name = form.get("name", "")
            try:
                outcome = periodic.backfill(self.store, name, *pages.backfill_range(form))
                notice = "periodic task %r: %d created, %d existing, %d upcoming" % (
                    name, len(outcome["created"]), len(outcome["existing"]),
                    len(outcome["upcoming"]))
            except InputError as exc:
                notice = "nothing created: %s" % exc
            return _redirect(environ, "/periodic", notice)
        if path in ("/periodic/enable", "/periodic/disable"):
            enable = path == "/periodic/enable"
            periodic.set_enabled(self.store, form.get("name", ""), enable)
            return _redirect(environ, "/periodic", "periodic task %r %s" % (
                form.get("name", ""), "enabled" if enable else "disabled"))
        if path in ("/queues/pause", "/queues/resume"):
            name, pause = form.get("name", ""), path == "/queues/pause"
            changed = queues.set_paused(self.store, name, pause)
            notice = "queue %r %s" % (name, (
                "paused: runners on every host stop claiming from it; runs in flight finish"
                if pause else "resumed") if changed else (
                "was paused already" if pause else "was not paused"))
            return _redirect(environ, "/", notice)
        if path == "/queues/limit":
            return _redirect(environ, "/", self.set_queue_limit(form))
        if path == "/tasks/bulk":
            return self.bulk(environ, path, form)
        return self.error(path, "no action at %s" % path, "404 Not Found")

    def set_queue_limit(self, form: Dict[str, str]) -> str:
        """What `taskrunner queue limit NAME N` (or ``--reset``) does; the notice to show."""
        name, text = form.get("name", ""), form.get("limit", "").strip()
        try:
            if form.get("reset"):
                limit = None
            elif text.isdigit():
                limit = int(text)
            else:
                raise InputError("a queue's limit must be a whole number >= 1, not %r" % text)
            in_force, _ = queues.set_host_limit(self.store, name, limit)
        except InputError as exc:
            return "nothing changed: %s" % exc
        return "queue %r: limit %d runners per host, %s" % (
            name, in_force, "from the config" if limit is None
            else "stored: on every host from now on (runs in flight finish)")

    def cancel_workflow(self, workflow_id: int) -> str:
        """What `taskrunner workflow cancel ID` does: every unfinished task cancelled, the
        running ones asked to stop; WorkflowNotFound (404) for an unknown id."""
        workflows.workflow_info(self.store, workflow_id, graph=False)
        ids = workflows.workflow_task_ids(self.store, workflow_id, unfinished=True)
        # The last first: each is cancelled by the operator, not by its parent's cancel.
        cancelled, stopping = control.cancel_workflow(self.store, reversed(ids))
        return "workflow %d: %d task(s) cancelled, %d running one(s) asked to stop" % (
            workflow_id, cancelled, stopping)

    def bulk(self, environ: Dict[str, Any], path: str, form: Dict[str, str]) -> Response:
        action = form.get("action")
        if action not in ("retry", "cancel", "delete"):
            raise InputError("unknown bulk action %r" % action)
        ids = summaries.matching_task_ids(self.store, pages.task_filter(self.store, form),
                                                BULK_LIMIT)
        if form.get("confirm") != "yes":
            return _html(page("Confirm: %s tasks" % action, path,
                              pages.confirm_bulk(self.view, form, len(ids), BULK_LIMIT),
                              read_only=self.read_only))
        done = refused = stopping = 0
        if action in ("retry", "delete"):   # in batches: a transaction per batch, not per task
            verb = control.retry_many if action == "retry" else rotation.delete_finished
            refusals = sum(1 for exc in verb(self.store, ids).values() if exc)
            done, refused, ids = len(ids) - refusals, refusals, []
        for task_id in ids:
            try:
                if control.cancel(self.store, task_id) is not None:
                    stopping += 1
                done += 1
            except (StateError, TaskNotFound):
                refused += 1
        notice = "%s: %d task(s) done%s, %d left as they were (wrong state)" % (
            action, done, " (%d running: asked to stop)" % stopping if stopping else "", refused)
        return _redirect(environ, "/tasks" + query(**pages.filter_params(form)), notice)


def keep_counts(app: "Dashboard", stop: threading.Event, interval: float = 5.0) -> None:
    """The slow counts, kept by a thread of their own so that no request waits for them:
    the succeeded tasks (every `interval` seconds, when counting them takes longer than
    `SLOW_COUNT`) and, once at start, the run totals of /metrics (the first look reads
    every run)."""
    first = True
    while not stop.is_set():
        try:
            started = time.monotonic()
            succeeded = summaries.succeeded_count(app.store)
            # Kept only when counting is slow; a small history is counted per request.
            app.succeeded = succeeded if time.monotonic() - started > SLOW_COUNT else None
            if first:
                app.totals.refresh(app.store)
                first = False
        except Exception:  # noqa: BLE001 - the pages count by themselves meanwhile
            log.exception("counting the succeeded tasks failed")
            app.succeeded = None
            app.store.close()
        stop.wait(interval)
    app.store.close()


class _Server(WSGIServer):
    """Requests handled by a fixed set of worker threads, each with its own database
    connection kept from one request to the next (connecting to PostgreSQL costs more than
    most pages)."""
    allow_reuse_address = True
    workers = 8

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Before the bind, which may fail (a port in use) and then closes the server: the
        # pool starts its threads only when the first request is submitted.
        self.pool = ThreadPoolExecutor(self.workers, thread_name_prefix="dashboard")
        super().__init__(*args, **kwargs)

    def process_request(self, request: Any, client_address: Any) -> None:
        self.pool.submit(self._handle, request, client_address)

    def _handle(self, request: Any, client_address: Any) -> None:
        try:
            self.finish_request(request, client_address)
        except Exception:
            self.handle_error(request, client_address)
        finally:
            self.shutdown_request(request)

    def server_close(self) -> None:
        super().server_close()
        self.pool.shutdown(wait=False)


class _Handler(WSGIRequestHandler):
    def get_environ(self) -> Dict[str, Any]:
        environ = super().get_environ()
        environ[PEER_UID] = peer_uid(self.connection)
        return environ

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s %s", self.address_string(), format % args)


def serve(store: Any, dashboard_config: Any, bind: Optional[str] = None,
          read_only: Optional[bool] = None, ready: Optional[Callable[[Any], None]] = None) -> int:
    """Serve the dashboard until interrupted. A non-loopback bind without a password is an
    InputError (exit 2), raised before anything listens."""
    host, port = parse_bind(bind or dashboard_config.bind)
    guard = Guard(dashboard_config, bind_host=host)
    guard.check_bind(host)
    only_read = dashboard_config.read_only if read_only is None else read_only
    app = Dashboard(store, guard, only_read)
    try:
        server = make_server(host, port, app, server_class=_Server, handler_class=_Handler)
    except OSError as exc:
        raise InputError("cannot listen on %s:%d: %s" % (host, port, exc.strerror)) from None
    shown = "[%s]" % host if ":" in host else host
    print("taskrunner dashboard on http://%s:%d/ (%s%s)" % (
        shown, server.server_port, "password required" if guard.required else
        "no password: its owner only", ", read-only" if only_read else ""), flush=True)
    stop = threading.Event()
    threading.Thread(target=keep_counts, args=(app, stop), name="dashboard-counts",
                     daemon=True).start()
    if ready is not None:
        ready(server)
    try:
        server.serve_forever(poll_interval=0.2)
    finally:
        stop.set()
        server.server_close()
        sys.stdout.flush()
    return 0
