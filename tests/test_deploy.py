"""The shipped deployment examples, as shipped.

`supervisord.conf` is run by real supervisord (the `supervisor` package) and driven with
supervisorctl: status, stop, restart and `signal HUP` while a run is in flight. The test
copies the file into tmp_path and changes only the lines that name paths of a real
deployment (the command, the program's directory and PYTHONPATH, the socket and the pid
file), so every other setting — stopsignal, stopasgroup/killasgroup, stopwaitsecs,
startsecs — is the shipped one.

Whatever stops the program, the run in flight must end with its real outcome: supervisord
signals the whole process group (stopasgroup), so each runner gets TERM from supervisord and
again from its overseer, and a runner must finish its run however many stop signals arrive
(DESIGN.md, "Processes and signals").

`contrib/taskrunner.service` cannot be started here (no systemd as PID 1); its sandbox is
checked with `systemd-analyze security --offline=true` when systemd-analyze is installed.
"""
import configparser
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile

import psutil
import pytest

from conftest import REPO_DIR, START_TIMEOUT, TESTS_DIR, wait_for
from sample_handlers import read_records
from taskrunner.config import Config
from taskrunner.store.models import RUN_FINAL, RUNNING, SUCCESS, Run, Runner

pytest.importorskip("supervisor", reason="supervisord is in the test extra: pip install '.[test]'")

SHIPPED_CONF = os.path.join(REPO_DIR, "supervisord.conf")
SHIPPED_UNIT = os.path.join(REPO_DIR, "contrib", "taskrunner.service")
PROGRAM = "taskrunner"
GRACEFUL_TIMEOUT = 20      # below the shipped stopwaitsecs, as the file's comment requires
RUN_SECONDS = 4.0          # the run in flight
STOP_AT_PERCENT = 35       # ... is stopped about 1.4 s into it

# A handler of the deployed "application": imported from tmp_path, which reaches the runners
# only through the program's `environment = PYTHONPATH=...` line.
APP_HANDLERS = '''\
import os
import time

from taskrunner import TaskHandler


class Steady(TaskHandler):
    """Works data["seconds"] in small steps, reporting progress, then stores its results."""

    def handle(self, run):
        seconds = run.data["seconds"]
        started = reported = time.monotonic()
        while time.monotonic() - started < seconds:
            time.sleep(0.02)
            if time.monotonic() - reported >= 0.2:
                reported = time.monotonic()
                run.progress(100 * (reported - started) / seconds)
        run.results = {"seconds": seconds, "pid": os.getpid()}
'''


# -- the deployed supervisord.conf --------------------------------------------------------

def with_values(text, **values):
    """`text` with the value of each uncommented `key = value` line named in `values`
    replaced. Each key must occur exactly once, so a renamed or duplicated setting fails
    here instead of leaving a /srv/app path in the test's copy."""
    for key, value in values.items():
        pattern = re.compile(r"^%s[ \t]*=.*$" % re.escape(key), re.M)
        found = len(pattern.findall(text))
        assert found == 1, "supervisord.conf: %d uncommented %r lines, expected 1" % (found, key)
        line = "%s = %s" % (key, value)
        text = pattern.sub(lambda match, line=line: line, text)
    return text


def socket_dir(tmp_path):
    """tmp_path, unless the socket's path would pass the 107 bytes a Unix socket allows."""
    if len(str(tmp_path / "supervisor.sock")) < 100:
        return str(tmp_path), None
    short = tempfile.mkdtemp(prefix="trsv-")
    return short, short


class Supervisord:
    """Real supervisord on a copy of the shipped supervisord.conf, and supervisorctl."""

    def __init__(self, database, tmp_path, **overrides):
        """`overrides`: settings of the program section changed for one test."""
        self.queue = database.queue()       # binds Run & co. to the database, for reading
        self.tmp_path = tmp_path
        self.proc = None
        self.overseer_pids = set()
        self.config = database.write_config(tmp_path / "taskrunner.toml", (
            "[runner]\nlimit = 2\npoll_interval = 0.2\n"
            "[overseer]\ncheck_interval = 0.2\ngraceful_timeout = %d\n" % GRACEFUL_TIMEOUT))
        (tmp_path / "deploy_handlers.py").write_text(APP_HANDLERS)
        sock_dir, self._short_dir = socket_dir(tmp_path)
        with open(SHIPPED_CONF) as fh:
            shipped = fh.read()
        command = "%s -m taskrunner --config %s overseer" % (sys.executable, self.config)
        pythonpath = os.pathsep.join([str(tmp_path), TESTS_DIR, REPO_DIR])
        self.conf = str(tmp_path / "supervisord.conf")
        with open(self.conf, "w") as fh:
            fh.write(with_values(
                shipped,
                pidfile=str(tmp_path / "supervisord.pid"),
                file=os.path.join(sock_dir, "supervisor.sock"),
                serverurl="unix://" + os.path.join(sock_dir, "supervisor.sock"),
                command=command,
                directory=str(tmp_path),
                environment='PYTHONPATH="%s"' % pythonpath, **overrides))
        self.log_path = tmp_path / "supervisord.log"

    def start(self):
        """supervisord in the foreground (the shipped nodaemon = true), in a process group of
        its own; its stdout gets the program's output (stdout_logfile = /dev/stdout)."""
        env = dict(os.environ)
        for name in ("PYTHONPATH", "TASKRUNNER_CONFIG", "TASKRUNNER_DATABASE_URL"):
            env.pop(name, None)     # the program's environment comes from the file alone
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "supervisor.supervisord", "-c", self.conf],
                stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        return self.wait_running()

    def ctl(self, *args, timeout=90):
        result = subprocess.run([sys.executable, "-m", "supervisor.supervisorctl", "-c", self.conf]
                                + list(args), capture_output=True, text=True, timeout=timeout)
        result.output = (result.stdout + result.stderr).strip()
        return result

    def ok(self, *args, timeout=90):
        result = self.ctl(*args, timeout=timeout)
        assert result.returncode == 0, "supervisorctl %s exited %d: %s\n%s" % (
            " ".join(args), result.returncode, result.output, self.log())
        return result.output

    def state(self):
        """(state, pid or None) of the program, as supervisorctl status shows it."""
        result = self.ctl("status", PROGRAM)
        fields = result.stdout.split()
        if len(fields) < 2 or fields[0] != PROGRAM:
            return None, None
        match = re.search(r"\bpid (\d+)", result.stdout)
        pid = int(match.group(1)) if match else None
        if pid:
            self.overseer_pids.add(pid)
        return fields[1], pid

    def wait_for(self, predicate, message, timeout=START_TIMEOUT, interval=0.05):
        """conftest's wait_for, failing with supervisord's and the program's output."""
        try:
            return wait_for(predicate, timeout=timeout, interval=interval, message=message)
        except AssertionError as exc:
            raise AssertionError("%s\n%s" % (exc, self.log())) from None

    def wait_running(self):
        """The overseer's pid once supervisord shows the program RUNNING (startsecs passed)."""
        def running():
            state, pid = self.state()
            return pid if state == "RUNNING" else None
        return self.wait_for(running, "supervisorctl status to show %s RUNNING" % PROGRAM,
                             interval=0.2)

    def runners(self, overseer_pid):
        try:
            return {child.pid for child in psutil.Process(overseer_pid).children()
                    if child.status() != psutil.STATUS_ZOMBIE
                    and child.name() not in ("tr-hub", "tr-maintainer")}
        except psutil.NoSuchProcess:
            return set()

    def leftovers(self, but=None):
        """Live processes started from this test's taskrunner config (the overseer and its
        forked runners share its command line), except the overseer `but` and its runners."""
        found = []
        for proc in psutil.process_iter(["cmdline", "status", "ppid"]):
            if proc.info["status"] != psutil.STATUS_ZOMBIE and \
                    self.config in (proc.info["cmdline"] or []) and \
                    but not in (proc.pid, proc.info["ppid"]):
                found.append(proc)
        return found

    def log(self):
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "--- supervisord and program output:\n%s" % text[-6000:]

    def close(self):
        """supervisorctl shutdown; then KILL supervisord's group, every overseer's group (its
        runners are in it) and anything else left from this config."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                self.ctl("shutdown", timeout=30)
                self.proc.wait(timeout=GRACEFUL_TIMEOUT + 10)
            except subprocess.TimeoutExpired:
                pass
            if self.proc.poll() is None:
                _killpg(self.proc.pid)
                self.proc.wait(timeout=10)
        for pid in self.overseer_pids:
            _killpg(pid)
        for proc in self.leftovers():
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        if self._short_dir:
            shutil.rmtree(self._short_dir, ignore_errors=True)
        self.queue.close()


def _killpg(pgid):
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


class SupervisordRunners(Supervisord):
    """Real supervisord running the shipped file's alternative program, uncommented: plain
    runners (`run-event task-runner:OnProcess`) with its `numprocs`, in place of the
    overseer. Only the paths are changed, as for the overseer's program."""

    RUNNER_PROGRAM = "taskrunner-runner"

    def __init__(self, database, tmp_path):
        super().__init__(database, tmp_path)
        with open(self.conf) as fh:
            text = fh.read()
        head, _, rest = text.partition("[program:%s]" % PROGRAM)
        block = rest[rest.index(";[program:%s]" % self.RUNNER_PROGRAM):]
        lines = [line[1:] for line in block.splitlines()
                 if re.match(r"^;(\[program:|[a-z_]+ = )", line)]
        program = "\n".join(lines) + "\n"
        shipped_command = re.search(r"^command = (.*)$", program, re.M).group(1)
        head_command = "/srv/app/.venv/bin/taskrunner --config /etc/taskrunner.toml "
        assert shipped_command.startswith(head_command), shipped_command
        command = "%s -m taskrunner --config %s %s" % (
            sys.executable, self.config, shipped_command[len(head_command):])
        pythonpath = os.pathsep.join([str(tmp_path), TESTS_DIR, REPO_DIR])
        program = with_values(program, command=command, directory=str(tmp_path),
                              environment='PYTHONPATH="%s"' % pythonpath)
        self.numprocs = int(re.search(r"^numprocs = (\d+)$", program, re.M).group(1))
        with open(self.conf, "w") as fh:
            fh.write(head + program)

    def start(self):
        env = dict(os.environ)
        for name in ("PYTHONPATH", "TASKRUNNER_CONFIG", "TASKRUNNER_DATABASE_URL"):
            env.pop(name, None)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "supervisor.supervisord", "-c", self.conf],
                stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def processes(self):
        """{process name: (state, pid or None)} of the runner program's processes."""
        found = {}
        for line in self.ctl("status").stdout.splitlines():
            fields = line.split()
            if len(fields) >= 2 and fields[0].startswith(self.RUNNER_PROGRAM + ":"):
                match = re.search(r"\bpid (\d+)", line)
                found[fields[0]] = (fields[1], int(match.group(1)) if match else None)
        return found

    def spawns(self):
        return self.log_path.read_text(errors="replace").count(
            "spawned: '%s_" % self.RUNNER_PROGRAM)


@pytest.fixture
def make_supervisord(tmp_path, monkeypatch):
    # add_task checks here, in the test, that the handler imports; the runners import it
    # through the program's PYTHONPATH.
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "deploy_handlers", raising=False)
    started = []

    def make(database, **overrides):
        supervisor = Supervisord(database, tmp_path, **overrides)
        started.append(supervisor)
        return supervisor
    yield make
    for supervisor in started:
        supervisor.close()


# -- runs -----------------------------------------------------------------------------------

def run_in_flight(supervisor):
    """Adds a RUN_SECONDS task; returns its run once it is STOP_AT_PERCENT of the way through."""
    task_id = supervisor.queue.add_task("deploy_handlers.Steady", {"seconds": RUN_SECONDS})

    def in_flight():
        run = Run.select().where(Run.task_id == task_id).order_by(Run.id.desc()).first()
        return run if run is not None and run.status == RUNNING and \
            run.percent_completed >= STOP_AT_PERCENT else None
    return supervisor.wait_for(in_flight, "task %d's run to be %d%% done"
                               % (task_id, STOP_AT_PERCENT), interval=0.02)


def wait_ended(run, supervisor):
    def ended():
        row = Run.get_by_id(run.id)
        return row if row.status in RUN_FINAL else None
    return supervisor.wait_for(ended, "run %d to end" % run.id, timeout=GRACEFUL_TIMEOUT + 10)


def assert_ran_to_its_end(run, what, supervisor):
    """The run in flight ended with its real outcome: success and its results, not an
    error made by the stop."""
    results = json.loads(run.results) if run.results else None
    assert run.status == SUCCESS and results and results["seconds"] == RUN_SECONDS, (
        "run %d, in flight when %s, ended %s %s: %s (results %r); expected success with "
        "its results: the runner must finish its run however many stop signals arrive\n%s"
        % (run.id, what, run.status, run.error_code, run.error_message, results,
           supervisor.log()))


def assert_new_work_is_served(supervisor):
    """A task added now succeeds; returns the pid of the runner that executed it."""
    log = str(supervisor.tmp_path / "after.log")
    task_id = supervisor.queue.add_task("sample_handlers.Record", {"log": log})
    supervisor.wait_for(lambda: supervisor.queue.get_task(task_id).status == SUCCESS,
                        "task %d, added after the signal, to succeed" % task_id)
    return read_records(log)[0][2]


# -- supervisord.conf, as shipped -----------------------------------------------------------

def test_shipped_supervisord_conf_stops_the_whole_group_after_the_graceful_timeout():
    """The settings the stop depends on: TERM to the group, KILL only after the overseer's
    graceful_timeout has passed, and supervisorctl able to reach supervisord."""
    parser = configparser.RawConfigParser(inline_comment_prefixes=(";",))
    parser.read(SHIPPED_CONF)
    program = parser["program:%s" % PROGRAM]
    assert program["stopsignal"] == "TERM"
    assert program.getboolean("stopasgroup") and program.getboolean("killasgroup")
    assert int(program["stopwaitsecs"]) > Config.from_dict({}).overseer.graceful_timeout
    assert parser["unix_http_server"]["chmod"] == "0700"
    assert parser["supervisorctl"]["serverurl"] == "unix://" + parser["unix_http_server"]["file"]
    assert "supervisor.rpcinterface_factory" in parser["rpcinterface:supervisor"]


@pytest.mark.timeout(120)
def test_supervisorctl_shows_the_overseer_running(sqlite_db, make_supervisord):
    supervisor = make_supervisord(sqlite_db)
    pid = supervisor.start()

    output = supervisor.ok("status")
    assert re.match(r"%s\s+RUNNING\s+pid %d," % (PROGRAM, pid), output), output
    assert psutil.Process(pid).cmdline()[-1] == "overseer"
    supervisor.wait_for(lambda: len(supervisor.runners(pid)) == 2,
                        "the overseer's [runner] limit = 2 runners")


@pytest.mark.timeout(120)
def test_supervisorctl_stop_lets_the_run_in_flight_finish(database_sp, make_supervisord):
    supervisor = make_supervisord(database_sp)
    supervisor.start()
    run = run_in_flight(supervisor)

    output = supervisor.ok("stop", PROGRAM)       # returns once the program has exited

    assert "stopped" in output, output
    assert supervisor.state()[0] == "STOPPED"
    assert supervisor.leftovers() == [], "taskrunner processes left after stop"
    assert_ran_to_its_end(wait_ended(run, supervisor), "supervisorctl stop", supervisor)


@pytest.mark.timeout(120)
def test_supervisorctl_restart_lets_the_run_in_flight_finish_and_work_continues(
        database_sp, make_supervisord):
    supervisor = make_supervisord(database_sp)
    old_overseer = supervisor.start()
    run = run_in_flight(supervisor)

    output = supervisor.ok("restart", PROGRAM)    # stop, then start and wait startsecs

    assert "stopped" in output and "started" in output, output
    new_overseer = supervisor.wait_running()
    assert new_overseer != old_overseer
    assert supervisor.leftovers(but=new_overseer) == [], "processes left from before restart"
    runner_pid = assert_new_work_is_served(supervisor)
    assert psutil.Process(runner_pid).ppid() == new_overseer
    assert_ran_to_its_end(wait_ended(run, supervisor), "supervisorctl restart", supervisor)


@pytest.mark.timeout(120)
def test_signal_hup_replaces_the_runners_without_cutting_the_run_in_flight(
        database_sp, make_supervisord):
    supervisor = make_supervisord(database_sp)
    overseer = supervisor.start()
    run = run_in_flight(supervisor)
    old_runners = supervisor.runners(overseer)

    supervisor.ok("signal", "HUP", PROGRAM)       # to the overseer only: reload, new runners

    assert_ran_to_its_end(wait_ended(run, supervisor), "supervisorctl signal HUP", supervisor)
    assert supervisor.state() == ("RUNNING", overseer), "the overseer must stay up"
    runner_pid = assert_new_work_is_served(supervisor)
    assert runner_pid not in old_runners, "a runner from before the HUP served new work"
    assert psutil.Process(runner_pid).ppid() == overseer
    supervisor.wait_for(lambda: not (old_runners & supervisor.runners(overseer)),
                        "the runners from before the HUP to exit")


@pytest.mark.timeout(120)
def test_a_kill_after_stopwaitsecs_takes_the_overseer_alone_and_its_runner_finishes_its_run(
        sqlite_db, make_supervisord):
    """What the shipped file's comment says happens when supervisord must KILL: its KILL to
    the overseer's process group reaches the overseer alone; the runner, leading a group of
    its own, hears of its parent's death (TERM from the kernel), finishes its run and exits.
    stopwaitsecs = 1 makes supervisord KILL mid-run (the shipped 45 s is above
    graceful_timeout, so a KILL is the exception)."""
    supervisor = make_supervisord(sqlite_db, stopwaitsecs=1)
    overseer = supervisor.start()
    run = run_in_flight(supervisor)
    runner = Runner.get_by_id(run.runner_id)
    assert os.getpgid(runner.pid) == runner.pid != os.getpgid(overseer)

    supervisor.ok("stop", PROGRAM)                # returns once the overseer is gone

    assert "terminated by SIGKILL" in supervisor.log(), supervisor.log()
    assert not psutil.pid_exists(overseer) or \
        psutil.Process(overseer).status() == psutil.STATUS_ZOMBIE
    # supervisorctl returns some time after the KILL (2.6 s of the run are left, less on a
    # loaded machine), so the runner may have finished its run and exited by now: a dead
    # runner is wrong only while its run is still in flight (the PID is read first).
    runner_alive = psutil.pid_exists(runner.pid)
    status = Run.get_by_id(run.id).status
    assert status in (RUNNING, SUCCESS), "the KILL must not end the run in flight: %s" % status
    assert runner_alive or status == SUCCESS, "the runner must outlive the overseer's KILL"
    assert_ran_to_its_end(wait_ended(run, supervisor), "supervisord's KILL", supervisor)
    supervisor.wait_for(lambda: not supervisor.leftovers(), "the runners to exit")
    ended = Runner.get_by_id(runner.id)
    assert ended.status == SUCCESS, (ended.status, ended.exit_reason)


@pytest.mark.timeout(180)
def test_numprocs_above_the_limit_wait_for_a_slot_instead_of_respawning(sqlite_db, tmp_path,
                                                                      monkeypatch):
    """The shipped alternative program (plain runners, `numprocs` of them) on a host whose
    [runner] limit is below numprocs: the runners refused a slot do not exit (supervisord
    would start them again at once, in a loop: 17 spawns in 25 s for 4 processes and a limit
    of 2) but wait for one; when a runner stops, one of them takes its slot, and supervisord
    never starts a process again."""
    supervisor = SupervisordRunners(sqlite_db, tmp_path)
    try:
        limit = Config.load(supervisor.config, environ={}).runner.limit
        assert supervisor.numprocs > limit
        supervisor.start()
        try:
            supervisor.wait_for(lambda: supervisor.log().count("waiting for a free slot")
                                == supervisor.numprocs - limit,
                                "%d runners to wait for a slot" % (supervisor.numprocs - limit),
                                timeout=90)
        except AssertionError as exc:
            raise AssertionError("%d spawns of %d processes; %s" % (
                supervisor.spawns(), supervisor.numprocs, exc)) from None
        processes = supervisor.wait_for(
            lambda: (lambda found: found if len(found) == supervisor.numprocs and all(
                state == "RUNNING" for state, _ in found.values()) else None)(
                supervisor.processes()), "every process RUNNING")
        running = list(Runner.select().where(Runner.status == RUNNING))
        assert len(running) == limit
        assert supervisor.spawns() == supervisor.numprocs, supervisor.log()

        # A runner stops: a waiting process takes its slot; supervisord starts nothing.
        stopped = running[0]
        name = next(n for n, (_, pid) in processes.items() if pid == stopped.pid)
        supervisor.ok("stop", name)
        waiting = {pid for _, pid in processes.values()} - {r.pid for r in running}

        def took_over():
            rows = list(Runner.select().where(Runner.status == RUNNING))
            return len(rows) == limit and {r.pid for r in rows} & waiting
        supervisor.wait_for(took_over, "a waiting runner to take the freed slot", timeout=60)
        assert Runner.get_by_id(stopped.id).status == SUCCESS
        assert supervisor.spawns() == supervisor.numprocs, supervisor.log()

        # A waiting runner stops at once when told to.
        output = supervisor.ok("stop", "all", timeout=60)
        assert "ERROR" not in output, output
        assert all(state == "STOPPED" for state, _ in supervisor.processes().values()), \
            supervisor.processes()
        assert Runner.select().where(Runner.status == RUNNING).count() == 0
    finally:
        supervisor.close()


# -- contrib/taskrunner.service -------------------------------------------------------------

def test_systemd_unit_sandbox_is_rated_ok():
    """`systemd-analyze security` rates the shipped unit's sandbox (9.2 UNSAFE before it had
    one; 1.2 OK with it). --threshold=20 makes it exit non-zero above 2.0 (the threshold is in
    tenths of the exposure it prints)."""
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed")
    help_text = subprocess.run([analyze, "security", "--help"], capture_output=True,
                               text=True).stdout
    if "--offline" not in help_text:
        pytest.skip("systemd-analyze is older than 252 (no security --offline)")
    result = subprocess.run([analyze, "security", "--offline=true", "--threshold=20",
                             SHIPPED_UNIT], capture_output=True, text=True, timeout=60)
    summary = (result.stdout + result.stderr).strip().splitlines()[-1:]
    assert result.returncode == 0, "exit %d: %s" % (result.returncode, summary)
    with open(SHIPPED_UNIT) as fh:
        unit = fh.read()
    for setting in ("KillMode=mixed", "ProtectSystem=strict", "NoNewPrivileges=true",
                    "Environment=XDG_RUNTIME_DIR=/run/taskrunner"):
        assert re.search(r"^%s$" % re.escape(setting), unit, re.M), setting
