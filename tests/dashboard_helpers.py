"""A dashboard served from a thread of the test process, on a free port, for the dashboard
tests (HTTP and real browser)."""
import base64
import threading
import urllib.error
import urllib.request

from taskrunner.config import Config
from taskrunner.web.app import serve


class Served:
    """`serve()` on a thread; ``url``; stopped by `stop()`."""

    def __init__(self, store, bind="127.0.0.1:0", **dashboard):
        self.config = Config.from_dict({"dashboard": dict(dashboard, bind=bind)}).dashboard
        ready = threading.Event()
        self.server = None
        self.error = None

        def started(server):
            self.server = server
            ready.set()

        def run():
            try:
                serve(store, self.config, ready=started)
            except BaseException as exc:  # reported to the test by start()
                self.error = exc
                ready.set()

        self.thread = threading.Thread(target=run, name="dashboard", daemon=True)
        self.thread.start()
        ready.wait(30)
        if self.error is not None:
            raise self.error
        host, port = self.server.server_address[:2]
        self.url = "http://%s:%d" % (host, port)

    def stop(self):
        if self.server is not None:
            self.server.shutdown()
            self.thread.join(10)


def fetch(url, data=None, password=None, headers=None):
    """(status, body text, headers) of a GET, or of a POST of the form `data`."""
    request = urllib.request.Request(url, data=data.encode() if data is not None else None,
                                     headers=dict(headers or {}))
    if password is not None:
        request.add_header("Authorization", "Basic " + base64.b64encode(
            ("admin:" + password).encode()).decode())
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}), _NoRedirect())
    try:
        with opener.open(request, timeout=30) as response:
            return response.status, response.read().decode(), response.headers
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(), exc.headers


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):
        return None
