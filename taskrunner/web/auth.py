"""Who may use the dashboard: where it listens, its password, and the token that makes
every action a same-site request (CSRF).

The password is HTTP Basic (any user name), configured as a PBKDF2 hash (passwords.py) in
``[dashboard] password_hash`` or read from the environment variable ``[dashboard]
password_env`` names.
Verifying a PBKDF2 hash costs ~0.1 s, so a header once verified is remembered (by its
SHA-256) for the life of the process.
"""
import base64
import hashlib
import hmac
import ipaddress
import os
import secrets
import threading
from typing import Optional, Tuple

from ..errors import ConfigError, InputError
from ..passwords import check_hash, is_hash


def parse_bind(text: str) -> Tuple[str, int]:
    """'HOST:PORT' or '[v6]:PORT' -> (host, port); InputError naming what is wrong."""
    host, sep, port = text.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise InputError("invalid dashboard bind %r: expected HOST:PORT, e.g. 127.0.0.1:8411"
                         % text)
    return host, int(port)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Guard:
    """The dashboard's password (if any) and its CSRF token."""

    def __init__(self, dashboard_config, environ=None):
        environ = os.environ if environ is None else environ
        self.password_hash = dashboard_config.password_hash or None
        self.password = None
        if dashboard_config.password_env:
            self.password = environ.get(dashboard_config.password_env) or None
            if self.password is None:
                raise ConfigError("[dashboard] password_env: the environment variable %s is "
                                  "not set" % dashboard_config.password_env)
        if self.password_hash and not is_hash(self.password_hash):
            raise ConfigError("[dashboard] password_hash: expected the output of "
                              "`taskrunner dashboard --hash-password`")
        self.csrf_token = secrets.token_urlsafe(32)
        self._verified = set()
        self._lock = threading.Lock()

    @property
    def required(self) -> bool:
        return bool(self.password_hash or self.password)

    def check_bind(self, host: str) -> None:
        """A non-loopback address without a password is refused."""
        if not is_loopback(host) and not self.required:
            raise InputError("refusing to serve the dashboard on %s without authentication: "
                             "set [dashboard] password_hash or password_env" % host)

    def allows(self, authorization: Optional[str]) -> bool:
        """Whether a request with this Authorization header may proceed."""
        if not self.required:
            return True
        if not authorization or not authorization.startswith("Basic "):
            return False
        key = hashlib.sha256(authorization.encode()).digest()
        with self._lock:
            if key in self._verified:
                return True
        try:
            decoded = base64.b64decode(authorization[6:], validate=True).decode()
        except (ValueError, UnicodeDecodeError):
            return False
        password = decoded.partition(":")[2]
        if self.password is not None:
            good = hmac.compare_digest(password.encode(), self.password.encode())
        else:
            good = check_hash(password, self.password_hash)
        if good:
            with self._lock:
                self._verified.add(key)
        return good

    def csrf_ok(self, token: Optional[str]) -> bool:
        return bool(token) and hmac.compare_digest(token.encode(), self.csrf_token.encode())
