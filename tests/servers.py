"""Servers the tests (and bench/) start for themselves: a free port to put one on, and
`PgBouncer`, Debian's ``pgbouncer`` in transaction pooling mode on a free port in front of
one PostgreSQL server for every database name (``* = host=... port=...``), trust
authentication; `PostgresCluster` and `MariaDBInstance`, throwaway servers a test may restart
or kill. Importable without pytest: bench/pgbouncer.py, bench/herd.py and bench/idle_cost.py
use it too (a tool missing raises `ServerMissing`; the tests turn that into a skip, or a
failure in CI).
"""
import glob
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
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


# -- throwaway servers --------------------------------------------------------------------

START_TIMEOUT = 60


class ServerMissing(Exception):
    """The tools to create a throwaway server are not installed (or need root)."""


def _run(*cmd):
    result = subprocess.run(list(cmd), capture_output=True, text=True, timeout=120, check=False)
    if result.returncode != 0:
        raise AssertionError("%s exited %d: %s%s" % (" ".join(cmd), result.returncode,
                                                      result.stdout, result.stderr))
    return result


class PostgresCluster:
    """A cluster of its own (pg_createcluster), trusted on 127.0.0.1, dropped at the end."""

    def __init__(self):
        versions = sorted(glob.glob("/usr/lib/postgresql/*/bin/postgres"))
        if not shutil.which("pg_createcluster") or not versions:
            raise ServerMissing("pg_createcluster / a PostgreSQL server is not installed")
        if os.geteuid() != 0:
            raise ServerMissing("creating a PostgreSQL cluster takes root (pg_createcluster)")
        self.version = versions[-1].split("/")[-3]
        self.name = "trrestart_%s" % uuid.uuid4().hex[:8]
        self.port = free_port()
        _run("pg_createcluster", self.version, self.name, "--port", str(self.port),
             "--start-conf", "manual")
        try:
            conf = "/etc/postgresql/%s/%s/conf.d/taskrunner-test.conf" % (self.version, self.name)
            with open(conf, "w") as fh:
                fh.write("shared_buffers = 16MB\nfsync = off\n")
            hba = "/etc/postgresql/%s/%s/pg_hba.conf" % (self.version, self.name)
            with open(hba) as fh:
                rest = fh.read()
            with open(hba, "w") as fh:       # first match wins: trust before the shipped lines
                fh.write("local all all trust\nhost all all 127.0.0.1/32 trust\n" + rest)
            self.ctl("start")
        except BaseException:
            self.drop()
            raise

    def ctl(self, *args):
        return _run("pg_ctlcluster", "--skip-systemctl-redirect", self.version, self.name,
                    *args)

    def ctl_in_background(self, *args):
        return subprocess.Popen(["pg_ctlcluster", "--skip-systemctl-redirect", self.version,
                                 self.name] + list(args), stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)

    def accepts(self):
        import psycopg
        try:
            psycopg.connect(host="127.0.0.1", port=self.port, user="postgres",
                            dbname="postgres", connect_timeout=2).close()
            return True
        except psycopg.Error:
            return False

    def new_database(self):
        import psycopg
        name = "trrestart_%s" % uuid.uuid4().hex[:8]
        with psycopg.connect(host="127.0.0.1", port=self.port, user="postgres",
                             dbname="postgres", autocommit=True) as conn:
            conn.execute("CREATE DATABASE %s" % name)
        return "postgresql://postgres@127.0.0.1:%d/%s" % (self.port, name)

    def drop(self):
        subprocess.run(["pg_dropcluster", "--stop", self.version, self.name],
                       capture_output=True, timeout=120, check=False)
        # pg_dropcluster leaves the configuration directory behind when it holds a file of
        # its own making (conf.d/taskrunner-test.conf).
        shutil.rmtree("/etc/postgresql/%s/%s" % (self.version, self.name), ignore_errors=True)


class MariaDBInstance:
    """A mariadbd of its own on a data directory of its own, removed at the end."""

    def __init__(self, directory):
        path = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/usr/local/sbin"])
        self.server = shutil.which("mariadbd", path=path)
        install = shutil.which("mariadb-install-db", path=path)
        if not self.server or not install:
            raise ServerMissing("mariadbd / mariadb-install-db is not installed")
        self.directory = str(directory)
        self.datadir = os.path.join(self.directory, "data")
        self.port = free_port()
        self.proc = None
        _run(install, "--no-defaults", "--datadir=" + self.datadir, "--user=%s" % _user(),
             "--auth-root-authentication-method=normal", "--skip-test-db")
        self.start()
        deadline = time.monotonic() + START_TIMEOUT
        while not self.accepts():
            if time.monotonic() > deadline:
                raise AssertionError("mariadbd did not start within %ss" % START_TIMEOUT)
            time.sleep(0.05)

    def start(self):
        with open(os.path.join(self.directory, "error.log"), "ab") as log:
            self.proc = subprocess.Popen(
                [self.server, "--no-defaults", "--datadir=" + self.datadir,
                 "--port=%d" % self.port, "--bind-address=127.0.0.1",
                 "--socket=" + os.path.join(self.directory, "sock"),
                 "--pid-file=" + os.path.join(self.directory, "pid"), "--user=%s" % _user(),
                 "--skip-grant-tables", "--innodb-buffer-pool-size=32M", "--skip-log-bin",
                 "--log-error=" + os.path.join(self.directory, "error.log")],
                stdout=log, stderr=log, start_new_session=True)

    def kill9(self):
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def accepts(self):
        import pymysql
        try:
            pymysql.connect(host="127.0.0.1", port=self.port, user="root",
                            connect_timeout=2).close()
            return True
        except pymysql.MySQLError:
            return False

    def new_database(self):
        import pymysql
        name = "trrestart_%s" % uuid.uuid4().hex[:8]
        conn = pymysql.connect(host="127.0.0.1", port=self.port, user="root", autocommit=True)
        try:
            with conn.cursor() as cur:
                cur.execute("CREATE DATABASE %s" % name)
        finally:
            conn.close()
        return "mysql://root@127.0.0.1:%d/%s" % (self.port, name)

    def remove(self):
        if self.proc is not None and self.proc.poll() is None:
            self.kill9()
        shutil.rmtree(self.directory, ignore_errors=True)


def _user():
    import pwd
    return pwd.getpwuid(os.geteuid()).pw_name
