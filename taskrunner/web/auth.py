"""Who may use the dashboard: the Host its requests name, who sends them, its password, and
the token that makes every action a same-site request (CSRF).

Host: a request is served only when its Host header names an IP address, a localhost name
(``localhost``, ``*.localhost``), the name it was bound to, this host's name, or one of
``[dashboard] allowed_hosts``. A page of another site whose name was made to resolve to this
address (DNS rebinding) sends its own name, and gets nothing.

Without a password (the default, on loopback only) the dashboard serves its owner: a
request is served only when the other end of its TCP connection is a socket of the user
running the dashboard, which Linux says in ``/proc/net/tcp`` (the uid of each socket, as
identd reads it). Another local user — who cannot read the 0600 database — cannot read
the dashboard's pages nor act through it; to let others in, set a password. A proxy
between the browser and the dashboard (an SSH tunnel is fine: its end is the user's own)
makes the proxy's user the one that counts.

The password is HTTP Basic (any user name), configured as a PBKDF2 hash
(passwords.py) in ``[dashboard]
password_hash`` or read from the environment variable ``[dashboard] password_env`` names.
``metrics_password_hash`` / ``metrics_password_env`` set one that opens ``/metrics`` alone,
for a scraper that may not see the pages (from another user, or another host). Verifying a
PBKDF2 hash costs ~0.1 s, so a header once verified is remembered (by its SHA-256) for the
life of the process.
"""
import base64
import hashlib
import hmac
import ipaddress
import os
import secrets
import socket
import struct
import threading
from typing import Any, Iterable, Optional, Tuple

from ..errors import ConfigError, InputError
from ..passwords import check_hash, is_hash

# Each TCP socket of this network namespace, with its uid (see the module's docstring).
SOCKET_TABLES = {socket.AF_INET: "/proc/net/tcp", socket.AF_INET6: "/proc/net/tcp6"}


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


def host_name(header: str) -> str:
    """The name (or address) of a Host header, lower case, without its port, brackets or
    final dot; "" when there is none."""
    text = header.strip().lower()
    if text.startswith("["):
        text = text[1:text.find("]")] if "]" in text else ""
    elif text.count(":") == 1:
        text = text.partition(":")[0]
    return text.rstrip(".")


def _is_address(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return False


def _table_address(family: int, address: str, port: int) -> str:
    """An endpoint as /proc/net/tcp{,6} prints it: the address's 32-bit words in the host's
    byte order, then the port, in hex."""
    if family == socket.AF_INET:
        words = struct.unpack("=I", socket.inet_pton(socket.AF_INET, address))
    else:
        words = struct.unpack("=4I", socket.inet_pton(socket.AF_INET6, address))
    return "%s:%04X" % ("".join("%08X" % word for word in words), port)


def peer_uid(connection: Any) -> Optional[int]:
    """The uid of the socket at the other end of `connection`, a TCP connection from this
    host (None when it is not one, or the kernel does not say)."""
    try:
        ours, theirs = connection.getsockname(), connection.getpeername()
    except OSError:
        return None
    family = connection.family
    ends = [(family, theirs[0], ours[0])]
    if family == socket.AF_INET6 and theirs[0].startswith("::ffff:"):
        # An IPv4 client of a dual-stack socket: its own socket is an IPv4 one.
        ends.append((socket.AF_INET, theirs[0][7:], ours[0].replace("::ffff:", "")))
    for table_family, client, server in ends:
        try:
            needle = " %s %s " % (_table_address(table_family, client, theirs[1]),
                                  _table_address(table_family, server, ours[1]))
            with open(SOCKET_TABLES[table_family]) as fh:
                table = fh.read()
        except (OSError, ValueError):
            continue
        at = table.find(needle)
        if at >= 0:
            fields = table[at:table.find("\n", at)].split()
            return int(fields[6])        # local, remote, st, queues, timer, retransmits, uid
    return None


class Password:
    """One HTTP Basic password (any user name): a PBKDF2 hash (``<prefix>password_hash``) or
    the value of an environment variable (``<prefix>password_env``), or none. A header once
    verified is remembered by its SHA-256."""

    def __init__(self, dashboard_config, prefix: str, environ) -> None:
        self.hash = getattr(dashboard_config, prefix + "password_hash") or None
        self.plain = None
        variable = getattr(dashboard_config, prefix + "password_env")
        if variable:
            self.plain = environ.get(variable) or None
            if self.plain is None:
                raise ConfigError("[dashboard] %spassword_env: the environment variable %s is "
                                  "not set" % (prefix, variable))
        if self.hash and not is_hash(self.hash):
            raise ConfigError("[dashboard] %spassword_hash: expected the output of "
                              "`taskrunner dashboard --hash-password`" % prefix)
        self._verified: set = set()
        self._lock = threading.Lock()

    @property
    def set(self) -> bool:
        return bool(self.hash or self.plain)

    def matches(self, authorization: Optional[str]) -> bool:
        """Whether this Authorization header carries the password (False when none is set)."""
        if not self.set or not authorization or not authorization.startswith("Basic "):
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
        if self.plain is not None:
            good = hmac.compare_digest(password.encode(), self.plain.encode())
        else:
            good = check_hash(password, self.hash or "")
        if good:
            with self._lock:
                self._verified.add(key)
        return good


class Guard:
    """The dashboard's password (if any), the one of /metrics alone (if any), the Host names
    it answers and its CSRF token."""

    def __init__(self, dashboard_config, environ=None, bind_host: str = ""):
        environ = os.environ if environ is None else environ
        self.password = Password(dashboard_config, "", environ)
        self.metrics_password = Password(dashboard_config, "metrics_", environ)
        self.hosts = _host_names([bind_host, socket.gethostname()]
                                 + list(dashboard_config.allowed_hosts))
        self.owner = os.geteuid()
        self.csrf_token = secrets.token_urlsafe(32)

    def host_allowed(self, header: Optional[str]) -> bool:
        """Whether a request whose Host header is `header` may be answered."""
        name = host_name(header or "")
        return bool(name) and (name in self.hosts or name == "localhost"
                               or name.endswith(".localhost") or _is_address(name))

    def peer_allowed(self, uid: Optional[int]) -> bool:
        """Whether a request from a socket of the user `uid` (None: unknown) may proceed to
        the password check: anyone when a password is set, else only the owner."""
        return self.required or uid == self.owner

    @property
    def required(self) -> bool:
        return self.password.set

    def check_bind(self, host: str) -> None:
        """A non-loopback address without a password is refused, and so is a dashboard
        without a password where the owner of a connection cannot be told (no /proc)."""
        if not is_loopback(host) and not self.required:
            raise InputError("refusing to serve the dashboard on %s without authentication: "
                             "set [dashboard] password_hash or password_env" % host)
        if not self.required and not os.path.exists(SOCKET_TABLES[socket.AF_INET]):
            raise InputError("cannot tell this host's users apart (no %s): set [dashboard] "
                             "password_hash or password_env" % SOCKET_TABLES[socket.AF_INET])

    def allows(self, authorization: Optional[str]) -> bool:
        """Whether a request with this Authorization header may proceed."""
        return not self.required or self.password.matches(authorization)

    def allows_metrics(self, authorization: Optional[str]) -> bool:
        """Whether this Authorization header carries the password of /metrics alone."""
        return self.metrics_password.matches(authorization)

    def csrf_ok(self, token: Optional[str]) -> bool:
        return bool(token) and hmac.compare_digest(token.encode(), self.csrf_token.encode())


def _host_names(names: Iterable[str]) -> frozenset:
    return frozenset(name for name in (host_name(n) for n in names if n) if name)
