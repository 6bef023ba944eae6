"""Servers the tests (and bench/) start for themselves: a free port to put one on, and
`PgBouncer`, Debian's ``pgbouncer`` in transaction pooling mode on a free port in front of
one PostgreSQL server for every database name (``* = host=... port=...``), trust
authentication. Importable without pytest (bench/pgbouncer.py uses it too).
"""
import os
import shutil
import socket
import subprocess
import tempfile
import time
from urllib.parse import urlsplit

PGBOUNCER = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def pgbouncer_available():
    return os.access(PGBOUNCER, os.X_OK)


class PgBouncer:
    """Runs until `stop()`; its log is `log_path`. PgBouncer refuses to run as root: then it
    is started with ``-u postgres``, in a directory that user can read and write."""

    def __init__(self, server_url, pool_size=10, max_db_connections=0, max_user_connections=0,
                 max_client_conn=1000):
        parts = urlsplit(server_url)
        self.user = parts.username or "postgres"
        self.port = free_port()
        self.directory = tempfile.mkdtemp(prefix="taskrunner-pgbouncer-")
        os.chmod(self.directory, 0o755)
        self.log_path = os.path.join(self.directory, "pgbouncer.log")
        ini = os.path.join(self.directory, "pgbouncer.ini")
        users = os.path.join(self.directory, "users.txt")
        with open(users, "w") as fh:
            fh.write('"%s" ""\n' % self.user)          # trust: the user must still be listed
        with open(ini, "w") as fh:
            fh.write("\n".join([
                "[databases]",
                "* = host=%s port=%d" % (parts.hostname or "127.0.0.1", parts.port or 5432),
                "[pgbouncer]",
                "listen_addr = 127.0.0.1",
                "listen_port = %d" % self.port,
                "unix_socket_dir =",
                "auth_type = trust",
                "auth_file = %s" % users,
                "admin_users = %s" % self.user,
                "pool_mode = transaction",
                "max_client_conn = %d" % max_client_conn,
                "default_pool_size = %d" % pool_size,
                "max_db_connections = %d" % max_db_connections,
                "max_user_connections = %d" % max_user_connections,
                # The tests' databases come and go: give their server connections back soon.
                "server_idle_timeout = 10",
                "autodb_idle_timeout = 10",
                "logfile = %s" % self.log_path,
                "",
            ]))
        command = [PGBOUNCER, ini]
        if os.geteuid() == 0:
            command[1:1] = ["-u", "postgres"]
            shutil.chown(self.directory, "postgres")
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL, start_new_session=True)
        self._wait_accepting()

    def _wait_accepting(self, timeout=30.0):
        import psycopg
        deadline = time.monotonic() + timeout
        while True:
            try:
                psycopg.connect(self.url("postgres"), connect_timeout=2).close()
                return
            except psycopg.OperationalError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError("pgbouncer did not start: %s" % self.log()[-2000:])
                time.sleep(0.05)

    def url(self, database):
        return "postgresql://%s@127.0.0.1:%d/%s" % (self.user, self.port, database)

    def log(self):
        try:
            with open(self.log_path, errors="replace") as fh:
                return fh.read()
        except OSError:
            return ""

    def stop(self):
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        shutil.rmtree(self.directory, ignore_errors=True)
