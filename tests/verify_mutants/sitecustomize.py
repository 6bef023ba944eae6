"""Test-only: seeds a defect into the run state machine's statements of every Python process
started with this directory on PYTHONPATH and $TASKRUNNER_VERIFY_MUTANT set (the verify
command and the runners it starts), so tests/test_verify.py can show that the checker
reports it. Production code has no hook for this: the catalogues' texts are rewritten here,
after import, before any statement is built from them.

Mutants:
- claim-no-status-guard: the claim picks the first run of its queue whatever its status
  (a finished run is claimed and executed again);
- end-no-runner-check: a success ends the run whoever holds it and whatever its status (a
  runner that comes back late overwrites the timeout of a run that ran again elsewhere);
- claim-no-row-lock (PostgreSQL): the claim's candidate is read without FOR UPDATE SKIP
  LOCKED (two claimers take the same run);
- release-no-parent-count: a parent's success releases its dependents whatever their count
  of parents still to succeed (runs/graph.py's RELEASE_READY): a fan-in starts after its
  first parent;
- periodic-take-unlocked: a scheduler's pass reads the due periodic tasks before the
  transaction that submits and advances them, no row locked (periodic/scheduler.py's
  `_take` outside `_batch`'s write): two schedulers both submit one due time.
"""
import os

MUTANT = os.environ.get("TASKRUNNER_VERIFY_MUTANT")

REWRITES = {
    "claim-no-status-guard": (
        ("WHERE status = 'scheduled' AND queue = ?", "WHERE queue = ?"),
        ("WHERE task_runs.status = 'scheduled' AND task_runs.queue = %s",
         "WHERE task_runs.queue = %s")),
    "end-no-runner-check": (
        ("AND status = 'running' AND runner_id = ?", "AND ? IS NOT NULL"),
        ("AND status = 'running' AND runner_id = %s", "AND %s::bigint IS NOT NULL"),
        ("AND r.status = 'running' AND r.runner_id = %s", "AND %s::bigint IS NOT NULL")),
    "claim-no-row-lock": (
        ("FOR UPDATE OF task_runs SKIP LOCKED FOR SHARE OF t SKIP LOCKED", ""),),
    "release-no-parent-count": ((" AND waiting_parents = 0 AND", " AND"),),
}


def mutate(value):
    if isinstance(value, str):
        for old, new in REWRITES[MUTANT]:
            value = value.replace(old, new)
        return value
    if isinstance(value, tuple):
        return tuple(mutate(item) for item in value)
    return value


def wrap(function):
    return lambda *args, **kwargs: mutate(function(*args, **kwargs))




def take_unlocked():
    from taskrunner.periodic.scheduler import PeriodicScheduler
    take, batch = PeriodicScheduler._take, PeriodicScheduler._batch

    def read_first(self, now, after, result, only=None, queues=None):
        rows = take(self, now, after, only, queues)     # in a transaction of its own
        self._take = lambda *args: rows
        try:
            return batch(self, now, after, result, only, queues)
        finally:
            del self._take
    PeriodicScheduler._batch = read_first


PATCHES = {"periodic-take-unlocked": take_unlocked}

if MUTANT in PATCHES:
    PATCHES[MUTANT]()
elif MUTANT:
    if MUTANT not in REWRITES:
        raise SystemExit("unknown TASKRUNNER_VERIFY_MUTANT %r" % MUTANT)
    from taskrunner.runs import graph
    from taskrunner.runs.statements import mysql, postgresql, sqlite
    for module in (postgresql, sqlite, mysql, graph):
        for name, value in list(vars(module).items()):
            if name.isupper() and isinstance(value, (str, tuple)):
                setattr(module, name, mutate(value))
    for catalogue in (postgresql, sqlite, mysql):
        catalogue.claim = wrap(catalogue.claim)
