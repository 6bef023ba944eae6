"""Runner rows: registration under the host's limit (rule 5), heartbeats, a clean exit, and
noticing the dead (rule 7) — which makes their runs ``timeout`` and re-queues the tasks.

A runner row on this host is alive when its PID exists, is not a zombie, and has the
recorded psutil create_time (PIDs get reused), on the boot it was recorded on. A runner on
another host is alive while its heartbeat is younger than ``[overseer] heartbeat_timeout``.

"This host" is the host id (`host_id`): the PID numbering a local PID check is valid in.
Heartbeats are written and aged with the database server's clock (`Store.server_time`), in
the query that reads them, so hosts whose clocks disagree never judge each other by them.
"""
import ctypes
import ctypes.util
import logging
import os
import socket
import sys
from datetime import timedelta

import peewee as pw
import psutil

from ..host import claimfile
from ..errors import RunnerLimitReached
from ..runs import queues
from ..runs.lifecycle import end_in_transaction, release_runs_of, runs_of_runner_query
from ..store.models import (CRASHED, ERROR, OVERSEER, REQUEUED, RUNNER, RUNNING, STOPPING_PREFIX,
                            SUCCESS, TIMEOUT, run_status_is, utcnow)

log = logging.getLogger("taskrunner.liveness")

# psutil's create_time is derived from clock ticks since boot: stable for one process,
# so anything beyond float noise means another process holds the PID now.
CREATE_TIME_TOLERANCE = 0.05
PR_SET_PDEATHSIG = 1        # prctl(2)


# The initial PID namespace has this fixed inode (PROC_PID_INIT_INO) on every Linux kernel.
INITIAL_PID_NAMESPACE = 0xEFFFFFFC


class ResidentSize:
    """This process's RSS in bytes, cheap enough to read after every run: /proc/PID/statm
    through a descriptor kept open (psutil opens and parses the file on every call, which
    costs more than a no-op run's handler); psutil where there is no /proc."""

    def __init__(self):
        self._page = os.sysconf("SC_PAGE_SIZE")
        try:
            self._fd = os.open("/proc/%d/statm" % os.getpid(), os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            self._fd, self._process = None, psutil.Process()

    def __call__(self):
        if self._fd is None:
            return self._process.memory_info().rss
        return int(os.pread(self._fd, 128, 0).split()[1]) * self._page

    def close(self):
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def hostname():
    return socket.gethostname()


def pid_namespace():
    """The inode of this process's PID namespace, or None where there is no /proc."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


def default_host_id():
    """The hostname, plus the PID namespace when it is not the machine's own: two containers
    sharing a hostname have separate PID numberings (so each must judge only its own PIDs),
    whereas containers sharing one PID namespace may judge each other's PIDs correctly. The
    boot id and machine-id would not do: every container on one kernel shares the boot id,
    and containers made from one image usually share (or lack) /etc/machine-id."""
    namespace = pid_namespace()
    if namespace is None or namespace == INITIAL_PID_NAMESPACE:
        return hostname()
    return "%s/pidns:%d" % (hostname(), namespace)


def host_id(store):
    """This host's identity in runner rows: ``[runner] host_id``, else `default_host_id`."""
    return store.config.runner.host_id or default_host_id()


def boot_id():
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            return fh.read().strip()
    except OSError:
        return "boot-%d" % int(psutil.boot_time())


def create_time(pid):
    return psutil.Process(pid).create_time()


def process_alive(pid, recorded_create_time):
    """The PID exists, is not a zombie, and is the process that registered."""
    try:
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:
            return False
        return abs(process.create_time() - recorded_create_time) <= CREATE_TIME_TOLERANCE
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return False
    except psutil.AccessDenied:
        return True  # it exists; another user's process cannot be ours, but do not guess dead


def register(store, kind=RUNNER, parent_id=None, now=None, take_slot=True, serving=None,
             code_version=None):
    """Insert this process's runner row and return it, or raise RunnerLimitReached.

    Rule 5 is a database rule: a runner takes a slot 1..limit, and (host, slot) is unique,
    so concurrent registrations cannot exceed the limit — a slot taken by a racing process
    makes the insert fail and this one tries the next free slot. Dead runners of this host
    are swept first so they do not hold slots. An overseer takes no slot, nor does work run
    inside an application's process (`take_slot` false: ``TaskQueue.run_pending``). A runner
    also takes, in the same transaction, a slot of each queue it is `serving` that has a
    ``[queues.NAME] limit`` (task_runner_queues, unique per host and queue likewise) — or the
    limit stored on the queue's row (``queue limit``), which replaces the config's.
    ``row.queue_slots``: {queue: the slot it took}. `code_version`: the version of the
    handler code the process runs (runner/versions.py), None for one that runs none.
    """
    Runner = store.Runner
    now = now or utcnow()
    host, pid = host_id(store), os.getpid()
    process = psutil.Process(pid)
    fields = dict(host=host, boot_id=boot_id(), pid=pid, pid_create_time=process.create_time(),
                  kind=kind, parent_id=parent_id, started_on=now,
                  heartbeat_on=store.server_time(), status=RUNNING,
                  rss=process.memory_info().rss, code_version=code_version)
    if kind == OVERSEER or not take_slot:
        return _created(Runner, fields)
    refresh_runners(store, now=now, other_hosts=False)
    limit = store.config.runner.limit
    taken = {r.slot for r in Runner.select(Runner.slot).where(
        (Runner.host == host) & Runner.slot.is_null(False))}
    for slot in range(1, limit + 1):
        if slot in taken:
            continue
        def take(slot=slot):
            row = _created(Runner, dict(fields, slot=slot))
            _take_queue_slots(store, row, serving or ())
            return row
        try:
            # store.write: again after a deadlock (MySQL, racing registrations of one queue)
            return store.write(take)
        except pw.IntegrityError:
            continue  # another process took this slot a moment ago
    raise RunnerLimitReached("this host already has %d running runners ([runner] limit)" % limit)


def _created(Runner, fields):
    """Insert the row; the instance returned carries its id and the heartbeat read back."""
    row = Runner(**fields)
    row.id = Runner.insert(**fields).execute()
    row.queue_slots = {}
    row.heartbeat_on = Runner.select(Runner.heartbeat_on).where(Runner.id == row.id).get(
    ).heartbeat_on
    return row


def _take_queue_slots(store, row, serving):
    """Inside register()'s transaction: a task_runner_queues row per queue served, with a
    free slot under the queue's limit; RunnerLimitReached (rolling the runner back) when a
    queue has none."""
    RunnerQueue = store.RunnerQueue
    stored = queues.host_limits(store, serving)
    for name in serving:
        config = store.config.queues.get(name)
        if config is None:
            RunnerQueue.create(runner_id=row.id, host=row.host, queue=name, slot=None)
            continue
        limit = stored.get(name) or config.limit
        taken = {r.slot for r in RunnerQueue.select(RunnerQueue.slot).where(
            (RunnerQueue.host == row.host) & (RunnerQueue.queue == name))}
        for slot in range(1, limit + 1):
            if slot in taken:
                continue
            try:
                with store.db.atomic():
                    RunnerQueue.create(runner_id=row.id, host=row.host, queue=name, slot=slot,
                                       config_limit=config.limit)
                row.queue_slots[name] = slot
                break
            except pw.IntegrityError:
                continue  # taken by a racing process
        else:
            raise RunnerLimitReached("this host already has %d running runners serving queue "
                                     "%r (%s)" % (limit, name, "its limit set by `queue limit`"
                                                  if name in stored else
                                                  "[queues.%s] limit" % name))


# The heartbeat's UPDATE per backend and shape (which columns it sets), written once: built
# by peewee on every beat, it cost about 0.9M instructions (forty nodes rendered, and the
# attribute lookups peewee answers through __getattr__, each an AttributeError made first),
# a job's worth of work every beat of every runner.
_HEARTBEATS = {}


def _heartbeat_sql(store, stopping, rss, runs_done):
    """(the heartbeat's UPDATE of `store.Runner` with its placeholders, whether the server's
    time is bound a second time for stopping_since) for the columns this beat sets."""
    key = (store.backend, None if stopping is None else bool(stopping), rss is not None,
           runs_done is not None)
    found = _HEARTBEATS.get(key)
    if found is None:
        p, now = store.db.param, store.server_time().sql
        table = store.Runner._meta.table_name
        sets = ["heartbeat_on = " + now]
        if stopping is not None:
            sets.append("exit_reason = " + p)
            # Since the first reason: the one written for it by whoever timed its run out
            # (lifecycle.timeout_overdue_runs), or its own.
            sets.append("stopping_since = " + ("COALESCE(stopping_since, %s)" % now
                                               if stopping else "NULL"))
            sets.append("stopping_run_id = " + p)
        if rss is not None:
            sets.append("rss = " + p)
        if runs_done is not None:
            sets.append("runs_done = " + p)
        found = _HEARTBEATS[key] = (
            "UPDATE %s SET %s WHERE id = %s AND status = %s" % (table, ", ".join(sets), p, p),
            bool(stopping))
    return found


def heartbeat(store, runner_id, rss=None, runs_done=None, stopping=None, stopping_run_id=None):
    """Refresh the runner's heartbeat (the database server's time); False when the row is no
    longer ``running`` (someone declared this runner dead), so it must stop claiming.
    `stopping`: why the runner is winding down its run (it then reads as ``stopping``); ""
    when that run has ended and the runner goes on; `stopping_run_id`: that run."""
    sql, since = _heartbeat_sql(store, stopping, rss, runs_done)
    now = store.server_time().params
    params = list(now)
    if stopping is not None:
        params.append(STOPPING_PREFIX + stopping if stopping else None)
        if since:
            params.extend(now)
        params.append(stopping_run_id if stopping else None)
    params.extend(value for value in (rss, runs_done) if value is not None)
    params.extend((runner_id, RUNNING))
    with store.host_turn():
        return store.db.execute_sql(sql, params).rowcount > 0


def retire(store, runner_id, reason, now=None, rss=None, runs_done=None):
    """This runner decided to exit: ``success``, and its slot is free. A run it still has
    ``running`` (it is leaving through an error) ends ``error`` / ``RunnerExited`` in the
    same transaction, so the task is retried instead of waiting for its run_timeout. `rss`
    and `runs_done`, its figures at the end, are written on the row in the same update
    (otherwise the row keeps those of its last heartbeat)."""
    final = {key: value for key, value in (("rss", rss), ("runs_done", runs_done))
             if value is not None}
    return _end_runner(store, runner_id, SUCCESS, reason, ERROR, "RunnerExited",
                       "runner %d exited: %s" % (runner_id, reason), now, final=final)


def mark_runner_dead(store, runner_id, reason, now=None, retry_at=None, unstarted=()):
    """Runner → ``timeout``, and every run it had ``running`` → ``timeout`` (a crash,
    ``RunnerDied``) with its task aggregated as after any failed run, retried not before
    `retry_at` — but those of `unstarted` (a batched runner's claimed runs it had not started,
    from its claim file: claimfile.py), which go back to the queue unstarted, as a stopping
    runner gives back its claimed runs (not a failure, not a new attempt). Race closed: two
    processes noticing the same death — the runner update is conditional on ``running``, and
    each run's end is conditional too (rule 4), so each run is counted as failed once."""
    given_back = []
    if not _end_runner(store, runner_id, TIMEOUT, reason, TIMEOUT, CRASHED,
                       "runner %d died: %s" % (runner_id, reason), now, retry_at,
                       unstarted, given_back):
        return False
    log.warning("runner %d marked timeout: %s%s", runner_id, reason,
                "; %d claimed run(s) it had not started given back" % len(given_back)
                if given_back else "")
    return True


def mark_runner_of_this_host_dead(store, runner_id, reason, now=None, retry_at=None):
    """mark_runner_dead() of a runner that died on this host: the claimed runs its claim file
    lists as not started go back to the queue unstarted; the file is removed."""
    marked = mark_runner_dead(store, runner_id, reason, now, retry_at,
                              claimfile.unstarted(store.wakeup_directory, runner_id))
    claimfile.discard(store.wakeup_directory, runner_id)    # kept if the marking failed
    return marked


def _end_runner(store, runner_id, status, reason, run_status, error_code, error_message, now,
                retry_at=None, unstarted=(), given_back=None, final=None):
    """The runner row → `status` (with the values of `final`) and its running runs →
    `run_status` (those of `unstarted`: given back unstarted, their ids appended to
    `given_back`), in one transaction: a process dying half-way must not leave the runner
    ended with runs still ``running`` (no check would visit them again). A lease it held is
    free at once (leadership.py): a host that restarts its overseer after a crash takes the
    fleet's maintenance back at once."""
    Runner = store.Runner
    now = now or utcnow()

    def step():
        ended = Runner.update(status=status, finished_on=now, slot=None, exit_reason=reason,
                              **(final or {})
                              ).where((Runner.id == runner_id) & (Runner.status == RUNNING)).execute()
        if not ended:
            return False
        store.RunnerQueue.delete().where(store.RunnerQueue.runner_id == runner_id).execute()
        store.Lease.update(holder_id=None, holder_kind=None, host=None).where(
            store.Lease.holder_id == runner_id).execute()
        if given_back is not None:
            given_back.clear()      # a transaction tried again starts afresh
        for run in list(runs_of_runner_query(store, runner_id)):
            if run.id in unstarted and release_runs_of(store, runner_id, only=run.id, now=now):
                if given_back is not None:
                    given_back.append(run.id)
                continue
            end_in_transaction(store, run.id, run.task_id, run_status, runner_id, None,
                               error_code, error_message, now, retry_at=retry_at)
        return True
    return store.write(step)


def dead_reason(row, host, current_boot, stale, heartbeat_timeout):
    """Why the runner row is dead, or None while it is alive. `stale`: its heartbeat is older
    than `heartbeat_timeout` by the database's clock. A PID is only ever checked on the host
    that recorded it. A runner of this host whose process lives but whose heartbeat stopped
    (SIGSTOP, a deadlock) is hung: dead too."""
    if row.host == host:
        if row.boot_id != current_boot:
            return "pid %d belonged to an earlier boot" % row.pid
        if not process_alive(row.pid, row.pid_create_time):
            return "pid %d is gone" % row.pid
        if row.kind == RUNNER and stale:
            return "pid %d is hung: no heartbeat for over %gs" % (row.pid, heartbeat_timeout)
        return None
    if stale:
        return "no heartbeat from %s for over %gs" % (row.host, heartbeat_timeout)
    return None


def frozen_reason(store, row, lag):
    """Why `row`, a runner of this host whose heartbeat is older than `lag` (kill_grace, or
    heartbeat_interval when longer), is to be killed: a run of it was timed out (by anyone)
    over `lag` ago, after its last heartbeat, and it has claimed no run since — its process
    cannot enforce rule 8 itself (SIGSTOP, a handler holding the GIL), so the overseer's
    side does, as before the runner took rule 8 over. None when no such run exists. Times on
    the database's clock; the runs read along the finished_on index, since the heartbeat."""
    Run = store.Run
    ended = (Run.select(Run.id, Run.finished_on).where(
        (Run.finished_on > row.heartbeat_on) & (Run.finished_on < store.server_time(-lag))
        & (Run.runner_id == row.id) & run_status_is(Run, TIMEOUT)).first())
    if ended is None or runs_of_runner_query(store, row.id).where(
            Run.started_on > ended.finished_on).exists():
        return None
    return "pid %d is hung: run %d timed out over %gs ago and it has not ended it " \
           "(kill_grace)" % (row.pid, ended.id, lag)


def process_ended(store, host, pid, created):
    """Whether the process `pid` of `host` (another host's, created at `created`) is known to
    be gone: it registered, and every row it has is ended (it retired, or a sweep marked it
    dead by its heartbeat's age). A process without a row is not known either way."""
    Runner = store.Runner
    rows = [r for r in Runner.select(Runner.status, Runner.pid_create_time).where(
        (Runner.host == host) & (Runner.pid == pid))
        if r.pid_create_time is not None and abs(r.pid_create_time - created) < 0.01]
    return bool(rows) and all(r.status != RUNNING for r in rows)


def kill_hung(row):
    """KILL a hung runner of this host, with its process group when it leads one (an
    overseer's child: the handler's subprocesses go too). Its PID was checked just now."""
    try:
        os.killpg(row.pid, 9) if os.getpgid(row.pid) == row.pid else os.kill(row.pid, 9)
    except (ProcessLookupError, PermissionError):
        pass


def refresh_runners(store, now=None, other_hosts=True, crash_grace=None, reaped_by=None,
                    reachable_since=None):
    """Check every ``running`` runner row (this host by PID and heartbeat, other hosts by
    heartbeat age) and mark the dead ones; hung runners of this host are killed, and so are
    those frozen with a run timed out over kill_grace ago (frozen_reason). Heartbeats
    are aged by the database's clock in the query that reads them; `now` stamps what is
    marked; `other_hosts` false: only this host's rows, and not the fleet-wide orphaned runs
    (end_orphaned_runs). Heartbeats are not judged until the database has been up for
    heartbeat_timeout (a server restart, or `reachable_since`: see Store.writable_since):
    nobody could write one while it was down. Runs found crashed are retried not before
    `crash_grace` seconds from now. The dead children of the overseer whose row is
    `reaped_by` (a live overseer of this host: its maintainer's caller) are left to that
    overseer, which marks each one as it reaps it and knows why it died (killed by its own
    stop: a hand-back, not a crash); a hung one is killed and marked here. Returns the ids
    marked."""
    Runner = store.Runner
    now = now or utcnow()
    host, current_boot = host_id(store), boot_id()
    timeout = store.config.overseer.heartbeat_timeout
    stale = Runner.heartbeat_on < store.server_time(-timeout)
    # A runner enforces rule 8 from its heartbeat thread: one silent for longer than it takes
    # to notice a timed-out run and stop it may be frozen with that run (frozen_reason).
    lag = max(store.config.overseer.kill_grace, store.config.runner.heartbeat_interval)
    lagging = Runner.heartbeat_on < store.server_time(-lag)
    query = Runner.select(Runner, stale.alias("stale"), lagging.alias("lagging")).where(
        Runner.status == RUNNING)
    if not other_hosts:
        query = query.where(Runner.host == host)
    retry_at = now + timedelta(seconds=crash_grace) if crash_grace else None
    rows = list(query)
    just_back = False
    if any(row.stale for row in rows):
        since = store.writable_since(reachable_since)     # asked only when it matters
        just_back = since is not None and since > now - timedelta(seconds=timeout)
    dead = []
    for row in rows:
        reason = dead_reason(row, host, current_boot, bool(row.stale) and not just_back,
                             timeout)
        # Slotless rows are work run inside an application's process (run_pending): not
        # a runner's to kill for a run.
        if reason is None and row.host == host and row.kind == RUNNER and row.lagging \
                and row.slot is not None:
            reason = frozen_reason(store, row, lag)
        if not reason or (row.host == host and reaped_by is not None
                          and row.parent_id == reaped_by and "hung" not in reason):
            continue
        if "hung" in reason:
            kill_hung(row)
        mark = mark_runner_of_this_host_dead if row.host == host else mark_runner_dead
        if mark(store, row.id, reason, now, retry_at):
            dead.append(row.id)
    if other_hosts:
        end_orphaned_runs(store, now, retry_at)
    return dead


def end_orphaned_runs(store, now, retry_at=None):
    """End ``timeout`` (RunnerDied) the runs still ``running`` under a runner row that has
    ended. A claim sent just before its runner was killed can commit on the server after the
    runner was marked dead (the server finishes a statement it received); no later check
    would visit that run until its run_timeout. Returns how many were ended."""
    Run, Runner = store.Run, store.Runner
    orphans = list(Run.select(Run.id, Run.task_id, Run.runner_id)
                   .join(Runner, on=(Run.runner_id == Runner.id))
                   .where(run_status_is(Run, RUNNING) & (Runner.status != RUNNING)))
    for run in orphans:
        log.warning("run %d was still running under ended runner %d: marked timeout",
                    run.id, run.runner_id)
        store.write(lambda run=run: end_in_transaction(
            store, run.id, run.task_id, TIMEOUT, run.runner_id, None, CRASHED,
            "runner %d died: the run was claimed as it died" % run.runner_id, now,
            retry_at=retry_at))
    return len(orphans)


# -- what an overseer asks about its own children ---------------------------------------------

def child_registered(store, parent_id, pid):
    """Did the overseer's child `pid` register a runner row?"""
    Runner = store.Runner
    return Runner.select(Runner.id).where(
        (Runner.parent_id == parent_id) & (Runner.pid == pid)).exists()


def mark_child_dead(store, parent_id, pid, reason, now=None, stopped=False):
    """The overseer reaped child `pid`: its row, if still ``running``, and its runs become
    ``timeout`` at once rather than at the next check — or, when the overseer's own stop
    killed it (`stopped`), its runs are handed back: ``requeued``, not a failure."""
    Runner = store.Runner
    rows = list(Runner.select(Runner.id).where(
        (Runner.parent_id == parent_id) & (Runner.pid == pid) & (Runner.status == RUNNING)))
    if stopped:
        marked = [row.id for row in rows if _end_runner(
            store, row.id, TIMEOUT, reason, REQUEUED, "Stopped",
            "handed back: its runner was %s" % reason, now)]
        for row in rows:
            claimfile.discard(store.wakeup_directory, row.id)
        return marked
    return [row.id for row in rows if mark_runner_of_this_host_dead(store, row.id, reason, now)]


def register_again(store, old_id):
    """An overseer whose row `old_id` was declared dead (no heartbeat while it was cut off
    from the database) and that lives on: a new row, and its children's live rows name it as
    their parent, in one transaction — the overseer finds its children by that name when it
    reaps them. Returns the new row."""
    Runner = store.Runner

    def step():
        row = register(store, kind=OVERSEER)
        Runner.update(parent_id=row.id).where(
            (Runner.parent_id == old_id) & (Runner.status == RUNNING)).execute()
        return row
    return store.write(step)


def others_running(store, parent_id):
    """Runners of this host that are not this overseer's children (supervisord numprocs,
    cron run-event, an earlier overseer's children still finishing): they share the limit."""
    Runner = store.Runner
    return Runner.select().where(
        (Runner.host == host_id(store)) & (Runner.status == RUNNING) & Runner.slot.is_null(False)
        & ((Runner.parent_id != parent_id) | Runner.parent_id.is_null())).count()


def name_process(name):
    """Show `name` (its first 15 bytes) as this process's name in ``ps -o comm``, ``top``
    and ``pgrep``, so the overseer and each runner are told apart. Linux's /proc/self/comm;
    elsewhere, or if it cannot be written, nothing changes. Returns the name it had (None
    where it cannot be read)."""
    try:
        with open("/proc/self/comm", "r+") as comm:
            previous = comm.read().rstrip("\n")
            comm.seek(0)
            comm.write(name[:15])
        return previous
    except OSError:
        return None


def others_serving(store, parent_id):
    """{queue: how many} of others_running()'s runners hold a slot of each limited queue:
    they share that queue's limit."""
    Runner, RunnerQueue = store.Runner, store.RunnerQueue
    rows = (RunnerQueue.select(RunnerQueue.queue, pw.fn.COUNT(RunnerQueue.id))
            .join(Runner, on=(Runner.id == RunnerQueue.runner_id))
            .where((RunnerQueue.host == host_id(store)) & RunnerQueue.slot.is_null(False)
                   & ((Runner.parent_id != parent_id) | Runner.parent_id.is_null()))
            .group_by(RunnerQueue.queue).tuples())
    return dict(rows)


def children_queue_slots(store, parent_id):
    """{pid: the highest queue slot it holds} of the running runners `parent_id` started."""
    Runner, RunnerQueue = store.Runner, store.RunnerQueue
    return dict(RunnerQueue.select(Runner.pid, pw.fn.MAX(RunnerQueue.slot))
                .join(Runner, on=(Runner.id == RunnerQueue.runner_id))
                .where((Runner.parent_id == parent_id) & (Runner.status == RUNNING)
                       & RunnerQueue.slot.is_null(False))
                .group_by(Runner.pid).tuples())


def die_with_parent(sig):
    """Linux: the kernel sends `sig` to this process when its parent dies. Elsewhere the
    runner's parent-pid check does the same, one poll later."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except OSError:
        pass
