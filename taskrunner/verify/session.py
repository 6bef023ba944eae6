"""One verify session: refuse a deployment that gives up the promise up front (`preflight`),
fork `workers` runners of its own against the database (the product's runner, serving the
workload's queues only, under a host id of their own, so they take none of the host's runner
slots), enqueue the workload for `duration` seconds while the faults asked for are injected,
let the tasks drain, stop the runners, read back what the database recorded (each run's
claim and end, each task's final state, the application rows) into the history, and check
it (`checker.check`).

The session is its runners' overseer (a row of kind overseer on its host id): it replaces a
runner that died and makes the queue pass for its own queues only (this host id's dead
runners by PID, its overdue runs timed out, its due runs created), so it never touches
another queue's task nor another host's runner, and neither it nor its runners take part in
the fleet's maintenance lease. Its tasks stay under its own queues, for rotation to delete as
it deletes any other.

Its periodic tasks are scheduled by SCHEDULERS processes of its own at once, each making the
periodic scheduler's own pass (`PeriodicScheduler.run_pending`, the one the fleet's lease
holder makes) for the session's periodic queue only, waking at each due time as the lease
holder does: rule 9 says a due time yields one task however many schedulers run. They never
schedule another periodic task, and the session's periodic tasks are removed at its end."""
import json
import logging
import os
import signal
import time
import uuid

from ..config import Config
from ..errors import InputError
from ..fleet import liveness
from ..periodic.scheduler import PeriodicScheduler
from ..runs import lifecycle
from ..store.db import backend_of, open_database
from ..store.models import OVERSEER, RUNNER, RUNNING, utcnow
from . import checker, history, workload
from .faults import Faults

QUEUES = (workload.QUEUE, workload.RATE_QUEUE, workload.PERIODIC_QUEUE)
SCHEDULERS = 2
RUN_TIMEOUT = 2.0        # of the workload's runs: a runner stopped for longer loses its run
PASS_INTERVAL = 0.25
SCHEDULER_LOOK = 0.2     # longest sleep of a scheduler process between two looks
WAVE_INTERVAL = 1.0
STOP_GRACE = 15.0        # seconds the runners have to finish their runs at the end
# Filesystems on which SQLite's locks do not hold between hosts (sqlite.org/lockingv3.html,
# "How To Corrupt An SQLite Database File").
NETWORK_FILESYSTEMS = ("nfs", "nfs4", "cifs", "smb", "smb3", "smbfs", "fuse.sshfs", "9p",
                       "afs", "ceph", "glusterfs", "fuse.glusterfs")


def mount_of(path, mounts):
    """(mount point, filesystem type) of the mount holding `path`, from the text of
    /proc/mounts (`mounts`); None when no line matches."""
    best = None
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) > len(best[0])):
            best = (point, fields[2])
    return best


def preflight(database_config, mounts_path="/proc/mounts", db=None):
    """Refuse (InputError, one line naming the setting) a SQLite deployment whose settings
    give up a promise before anything runs: a database file on a network filesystem (its
    locks do not hold between hosts), an exclusive locking mode (other processes cannot take
    turns), synchronous off or a journal that is off or in memory (a commit acknowledged is
    lost on a crash). PostgreSQL and MySQL keep their promises in the server: their
    settings are for the run itself to find out. Before the schema is touched: a refused
    deployment is left as it was. `db`: the connection to ask (default: one opened as the
    runners open theirs, with the config's settings)."""
    if backend_of(database_config.url) != "sqlite":
        return
    db = db or open_database(database_config)
    path = os.path.realpath(db.database)
    try:
        with open(mounts_path) as fh:
            mount = mount_of(path, fh.read())
    except OSError:
        mount = None
    if mount is not None and mount[1] in NETWORK_FILESYSTEMS:
        raise InputError("%s is on a %s filesystem (%s): SQLite's locks do not hold there; "
                         "put the database on a local disk or use PostgreSQL" % (
                             path, mount[1], mount[0]))
    pragmas = {name: str(db.execute_sql("PRAGMA %s" % name).fetchone()[0]).lower()
               for name in ("locking_mode", "synchronous", "journal_mode")}
    db.close()
    if pragmas["locking_mode"] == "exclusive":
        raise InputError("SQLite locking_mode is exclusive: one process holds the database "
                         "and the runners cannot take turns; use the default (normal)")
    if pragmas["synchronous"] == "0":
        raise InputError("[database] sqlite_synchronous = off: a commit acknowledged can be "
                         "lost on a crash; use full (or normal)")
    if pragmas["journal_mode"] in ("off", "memory"):
        raise InputError("SQLite journal_mode is %s: a crash can lose or corrupt a commit; "
                         "use wal" % pragmas["journal_mode"])


def _toml(value):
    return json.dumps(value) if isinstance(value, str) else repr(value).lower() \
        if isinstance(value, bool) else repr(value)


def runner_config(config, workers, host_id):
    """The TOML of the session's runners: the user's [database] settings and batching (what
    the promises rest on), a host id and limits of their own, short heartbeats, the
    workload's queues."""
    d, r = config.database, config.runner
    database = {"sqlite_synchronous": d.sqlite_synchronous, "busy_timeout": d.busy_timeout,
                "pooler": d.pooler, "listen_url": d.listen_url}
    lines = ["[database]"] + ["%s = %s" % (k, _toml(v)) for k, v in database.items()]
    lines += ["[runner]", "limit = %d" % (len(QUEUES) * workers + 1),
              "host_id = %s" % _toml(host_id),
              "poll_interval = 0.1", "heartbeat_interval = 0.5",
              "batch = %d" % r.batch, "flush_interval = %s" % _toml(r.flush_interval),
              "[overseer]", "kill_grace = 6", "heartbeat_timeout = 30",
              "[task]", "retry_backoff = 0", "run_timeout = %s" % RUN_TIMEOUT,
              "[log]", 'level = "warning"',
              '[queues."%s"]' % workload.QUEUE, "limit = %d" % workers,
              '[queues."%s"]' % workload.RATE_QUEUE, "limit = %d" % workers,
              'rate = "%d/s"' % workload.RATE, "burst = %d" % workload.BURST,
              # Claimed first: a periodic task waiting behind the workload is unfinished at
              # its next due times, which rule 9 then skips.
              '[queues."%s"]' % workload.PERIODIC_QUEUE, "limit = %d" % workers,
              "priority = 1"]
    return "\n".join(lines) + "\n"


class Session:
    """A verify session in `directory` (its history, its runners' config and logs)."""

    def __init__(self, config, directory, duration=10.0, workers=4, faults=("kill",),
                 restart_db_command=None, drain=None, mounts_path="/proc/mounts"):
        self.directory, self.duration, self.workers = directory, duration, workers
        self.drain = drain if drain is not None else max(60.0, 3 * duration)
        self.session = uuid.uuid4().hex[:12]
        self.host_id = "%s/verify-%s" % (liveness.default_host_id(), self.session)
        self.config_path = os.path.join(directory, "runners.toml")
        # Owner-only: listen_url may hold a password.
        with os.fdopen(os.open(self.config_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
                               0o600), "w") as fh:
            fh.write(runner_config(config, workers, self.host_id))
        self.url = config.database.url
        self.config = Config.load(self.config_path, self.url)
        preflight(self.config.database, mounts_path)
        from ..api import TaskQueue
        self.queue = TaskQueue(self.config, migrate=True)
        self.store = self.queue.store
        self.faults = Faults(faults, restart_db_command)
        self.pids, self.parent_pid, self.row_id = set(), os.getpid(), None
        self.scheduler_pids = set()
        self.started_runners = 0

    # -- the runners ---------------------------------------------------------------------
    # Forked as an overseer forks its runners, under the session's own overseer row: a
    # runner with a parent takes no part in the fleet's maintenance lease (a standalone
    # `taskrunner runner` would, and would then sweep other hosts and time out other queues'
    # runs with this session's settings), and it stops when the session's process is gone.

    def register(self):
        self.row_id = liveness.register(self.store, kind=OVERSEER).id

    def spawn_runner(self):
        """Fork one runner of the workload's queues."""
        self.pids.add(self._fork(self.work, "runners.log"))
        self.started_runners += 1

    def work(self):
        from ..api import TaskQueue
        from ..runner.loop import Runner
        from ..store.bound import Store
        Runner(Store(self.config), parent_pid=self.parent_pid, parent_id=self.row_id,
               serving=QUEUES, facade=TaskQueue).work()

    def _fork(self, body, log_name):
        """A child of the session in a process group of its own, its output to `log_name`,
        running `body()`; its PID. No connection crosses the fork."""
        self.store.close()
        pid = os.fork()
        if pid:
            return pid
        code = 1
        try:
            liveness.die_with_parent(signal.SIGKILL)
            os.setpgid(0, 0)
            log = os.open(os.path.join(self.directory, log_name),
                          os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            os.dup2(log, 1)
            os.dup2(log, 2)
            body()
            code = 0
        except BaseException:
            logging.getLogger("taskrunner.verify").exception("%s crashed", log_name)
        finally:
            logging.shutdown()
        os._exit(code)

    def start_schedulers(self):
        for _ in range(SCHEDULERS):
            self.scheduler_pids.add(self._fork(self.schedule, "schedulers.log"))

    def schedule(self):
        """The body of a scheduler process, until SIGTERM: wait for the next due time of the
        session's periodic tasks (on the database's clock), make the pass, record it (the
        database's time it was made at: every due time up to it was this pass's to handle)."""
        stopping = []
        signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
        from ..store.bound import Store
        store = Store(self.config)
        scheduler, queues = PeriodicScheduler(store), (workload.PERIODIC_QUEUE,)
        while not stopping:
            try:
                due = scheduler.next_due(queues)
                wait = SCHEDULER_LOOK if due is None else \
                    (due - store.database_time()).total_seconds()
                if wait > 0:
                    time.sleep(min(wait, SCHEDULER_LOOK))
                    continue
                now = utcnow()
                result = scheduler.run_pending(now=now, queues=queues)
                history.record(self.directory, "pass", now=str(store.database_time(now)),
                               submitted=result["submitted"])
            except Exception:     # the database went away (restart-db): the next pass retries
                logging.getLogger("taskrunner.verify").exception("a scheduler's pass failed")
                store.close()
                time.sleep(SCHEDULER_LOOK)
        store.close()

    def stop_schedulers(self):
        """TERM: each ends after its pass; KILL after STOP_GRACE."""
        for pid in self.scheduler_pids:
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE
        for pid in self.scheduler_pids:
            while not os.waitpid(pid, os.WNOHANG)[0]:
                if time.monotonic() > deadline:
                    os.killpg(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                    break
                time.sleep(0.05)
        self.scheduler_pids.clear()

    def reap(self):
        """Forget the runners that exited (killed, refused), reaping them."""
        for pid in list(self.pids):
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                done = pid
            if done:
                self.pids.discard(pid)

    def keep_runners(self):
        """Start runners in place of those that died."""
        self.reap()
        while len(self.pids) < self.workers:
            self.spawn_runner()

    def runner_pids(self):
        """The PIDs of the session's runners that registered and run, those executing a run
        only when any is: a fault is meant to land mid-run."""
        Runner, Run = self.store.Runner, self.store.Run
        rows = Runner.select(Runner.id, Runner.pid).where((Runner.host == self.host_id)
                                                         & (Runner.kind == RUNNER)
                                                         & (Runner.status == RUNNING))
        mine = {row.id: row.pid for row in rows if row.pid in self.pids}
        busy = {run.runner_id for run in Run.select(Run.runner_id).where(
            (Run.status == RUNNING) & Run.runner_id.in_(list(mine)))} if mine else set()
        return [pid for runner_id, pid in mine.items() if runner_id in busy] \
            or list(mine.values())

    def queue_pass(self):
        """The pass an overseer's maintainer makes, for this session's host id and queues."""
        liveness.refresh_runners(self.store, other_hosts=False)
        lifecycle.timeout_overdue_runs(self.store, queues=QUEUES)
        lifecycle.create_missing_runs(self.store, queues=QUEUES)

    def stop_runners(self):
        """TERM (a graceful stop), KILL after STOP_GRACE; the session's row retired."""
        self.reap()
        for pid in self.pids:
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE
        while self.pids and time.monotonic() < deadline:
            self.reap()
            time.sleep(0.05)
        for pid in self.pids:
            os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        self.pids.clear()
        liveness.refresh_runners(self.store, other_hosts=False)
        liveness.retire(self.store, self.row_id, "verify session ended")

    # -- the session ---------------------------------------------------------------------

    def _unfinished(self, task_ids):
        """Whether a task of this session is not final yet: one of its queues' from its first
        task on (no list of ids to bind, however long the session)."""
        Task = self.store.Task
        return Task.select().where(Task.queue.in_(QUEUES) & (Task.id >= min(task_ids))
                                   & Task.finished_on.is_null()).exists()

    def run(self):
        """Run the session; returns (the checker's results, what happened: counts)."""
        workload.create_effects_table(self.store)
        work = workload.Workload(self.queue, self.directory, self.session, self.workers)
        work.limits()
        periodic = workload.Periodic(self.store, self.directory, self.session)
        started = time.monotonic()
        next_wave = next_pass = started
        self.register()
        try:
            try:
                periodic.add()
                self.start_schedulers()
                self.keep_runners()
                while time.monotonic() - started < self.duration:
                    now = time.monotonic()
                    if now >= next_wave:
                        work.wave()
                        next_wave = now + WAVE_INTERVAL
                    if now >= next_pass:
                        self.queue_pass()
                        next_pass = now + PASS_INTERVAL
                    self.faults.tick(self.runner_pids())
                    self.keep_runners()
                    time.sleep(0.05)       # the loop's tick, as an overseer's
                self.faults.end()
                self.stop_schedulers()
                drain_until = time.monotonic() + self.drain
                while self._unfinished(work.task_ids) and time.monotonic() < drain_until:
                    self.queue_pass()
                    self.keep_runners()
                    time.sleep(PASS_INTERVAL)
            finally:
                self.faults.end()
                self.stop_schedulers()
                self.stop_runners()
            periodic.collect()
            collect(self.store, self.directory, work.task_ids + periodic.task_ids())
        finally:
            periodic.remove()       # however the session ended
        results = checker.check(history.read(self.directory))
        happened = dict(self.faults.counts, tasks=len(work.task_ids),
                        runners=self.started_runners,
                        seconds=round(time.monotonic() - started, 1))
        self.queue.close()
        return results, happened


def collect(store, directory, task_ids, effects=True):
    """What the database recorded about `task_ids`, into the history in `directory`: each
    run's claim and end (the database's times), each task's final state and, with
    `effects`, the steps' application rows (workload.EFFECTS). Our chaos tests call it too,
    so their history is read as verify's."""
    Run, Task = store.Run, store.Task
    record = history.record
    task_ids = list(task_ids)
    for start in range(0, len(task_ids), 500):
        chunk = task_ids[start:start + 500]
        for run in Run.select(Run.id, Run.task_id, Run.attempt, Run.status, Run.runner_id,
                              Run.started_on, Run.finished_on).where(Run.task_id.in_(chunk)):
            record(directory, "end", task=run.task_id, run=run.id, attempt=run.attempt,
                   status=run.status, runner=run.runner_id,
                   started=run.started_on and str(run.started_on),
                   finished=run.finished_on and str(run.finished_on))
        for task in Task.select(Task.id, Task.last_status).where(Task.id.in_(chunk)):
            record(directory, "final", task=task.id, status=task.last_status)
    for (task, step), count in (workload.effects(store, task_ids) if effects else {}).items():
        record(directory, "effect", task=task, step=step, count=count)
