"""Binds and runs the run state machine's statements: every statement that adds a task,
claims, ends, gives back or cancels a run. The statements themselves are named in one
catalogue per database (River's river_job.sql per dialect, Procrastinate's queries.sql):
`statements/postgresql.py`, `statements/sqlite.py`, `statements/mysql.py`, each with the race
it closes, and what they share in `statements/shared.py`. `lifecycle` decides which one runs
when and calls the hooks; `runner.batches` claims and ends many runs with the same
statements; `enqueue` validates what it adds with these INSERTs.

A claim and a success happen once per job: plain SQL (peewee's query building costs more
than the database's work). PostgreSQL: one statement of data-modifying CTEs each, and a busy
runner's success and its next claim in one (one round trip and commit per job). SQLite:
UPDATE ... RETURNING; MySQL: a locking SELECT of the runs joined to their tasks. A claim
reads one queue along the task_runs_claim index (queue, CLAIM_ORDER). The rarer ends
(failures, timeouts, cancels, give-backs) are peewee queries, the same on every database.

Rule 4 in every end: the run's UPDATE is conditional on its state (``status = 'running'``,
and ``runner_id`` for a runner's own end), so whoever comes late changes nothing and learns
it from the row count. Times are bound as values, already on the database's clock
(`Store.database_time`).
"""
import json
from datetime import datetime

from ..host.wakeup import NOTIFY_SQL
from ..store.db import executor
from ..store.models import CANCELLED, RUNNING, SCHEDULED
from .statements import mysql, postgresql, sqlite
from .statements.shared import CLAIM_ORDER

# Each database's catalogue of statements, by the store's backend name.
CATALOGUES = {"postgresql": postgresql, "sqlite": sqlite, "mysql": mysql}

# -- the claim order (rule 2: statements/shared.py) --------------------------------------------


def claim_order_of(Run):
    """CLAIM_ORDER for a peewee query of runs."""
    return [getattr(Run, column).desc() if desc else getattr(Run, column)
            for column, desc in CLAIM_ORDER]


def in_claim_order(rows, width):
    """`rows` whose last columns are CLAIM_COLUMNS (RETURNING has no order), sorted in the
    claim order and cut to their first `width` columns. Stable sorts, last key first. A
    claim of one run returns no CLAIM_COLUMNS: it is only cut."""
    rows = list(rows)
    if len(rows) < 2:
        return [tuple(row[:width]) for row in rows]
    for index, (_, desc) in reversed(list(enumerate(CLAIM_ORDER))):
        rows.sort(key=lambda row: row[width + index], reverse=desc)
    return [tuple(row[:width]) for row in rows]


# -- flow control in the claim (runs/flow.py; the races closed: statements/shared.py) ---------

_FLOW_CLAIMS = {}     # (backend, rate, keys, fair) -> the statement(s) of a flow claim


def flow_claim_statements(backend, rate, keys, fair, slot_check=True):
    """The statement(s) of a claim of one run of a queue under flow control: its `rate`
    (token bucket), the rate limits of keys (`keys`), fairness between tenants (`fair`);
    `slot_check`: see claim_statements."""
    key = (backend, bool(rate), bool(keys), bool(fair), bool(slot_check))
    if key not in _FLOW_CLAIMS:
        _FLOW_CLAIMS[key] = CATALOGUES[backend].flow_claim(*key[1:])
    return _FLOW_CLAIMS[key]


def epoch_seconds(at):
    """A naive UTC datetime as seconds since the epoch (a bucket's stamp)."""
    return (at - EPOCH).total_seconds()


EPOCH = datetime(1970, 1, 1)


def flow_claim(store, runner_id, queue, at, rate, keys, fair, slot_check=True):
    """The claim of one run of `queue` under flow control (flow_claim_statements), inside
    the caller's write transaction but on PostgreSQL (one statement). A fair claim that finds
    no tenant with a run (only runs without a tenant, or its tenant's run locked by another
    claimer) claims as the queue would without fairness. A list of at most one row, as
    `claim`'s."""
    execute, backend = store.db.execute_sql, store.backend
    statements = flow_claim_statements(backend, rate, keys, fair, slot_check)
    stamp = at.isoformat(" ") if backend == "sqlite" else at
    values = {"q": queue, "runner": runner_id, "at": stamp, "e": epoch_seconds(at)}
    if backend == "postgresql":
        rows = [tuple(row) for row in execute(statements, values)]
    elif backend == "sqlite":
        claim_run, spend_queue, spend_key, served = statements
        row = execute(claim_run, values).fetchone()
        rows = []
        if row is not None:
            if rate:
                execute(spend_queue, values)
            if keys and row[3] is not None:
                execute(spend_key, dict(values, key=row[3]))
            if fair and row[4] is not None:
                execute(served, dict(values, tenant=row[4]))
            task = execute(sqlite.CLAIMED_TASK, (row[1],)).fetchone()
            rows = [tuple(row[:3]) + tuple(task)]
    else:
        rows = _mysql_flow_claim_rows(store, statements, values, rate, keys, fair)
    if not rows and fair:
        return flow_claim(store, runner_id, queue, at, rate, keys, False, slot_check) \
            if (rate or keys) else claim(store, runner_id, queue, at, slot_check=slot_check)
    return rows


def _mysql_flow_claim_rows(store, statements, values, rate, keys, fair):
    execute = store.db.execute_sql
    check, claim_run, spend_queue, spend_key, served = statements
    if rate:
        allowed = execute(check, values).fetchone()
        if allowed is not None and not allowed[0]:
            return []
    row = execute(claim_run, values).fetchone()
    if row is None:
        return []
    if keys and row[7] is not None and not execute(spend_key, dict(values, key=row[7])
                                                   ).rowcount:
        Bucket = store.RateBucket
        if Bucket.select().where((Bucket.kind == "key") & (Bucket.name == row[7])).exists():
            return []         # its key's last token went to another claimer meanwhile
    if rate:
        execute(spend_queue, values)
    if fair and row[8] is not None:
        execute(served, dict(values, tenant=row[8]))
    execute(mysql.START % "%s", (values["runner"], values["at"], values["at"], row[0]))
    return [tuple(row[:CLAIMED_WIDTH])]


# -- a batch's share of the backlog -----------------------------------------------------------

# The most runners a share is counted for: the backlog is read up to `want` times this.
SHARE_OF = 64


def backlog_share(store, queue, want):
    """How many of `queue`'s scheduled runs a batched runner takes, at most `want`: its share
    of them among the runners running now, rounded up — all of `want` while the backlog
    is at least `want` per runner, one when there are no more runs than runners. So a few
    runs added at once go to as many runners instead of the first one woken, and a batch
    shrinks as the backlog drains (no runner holds runs the others could start)."""
    runners, backlog = store.db.execute_sql(CATALOGUES[store.backend].BACKLOG,
                                            (queue, want * SHARE_OF)).fetchone()
    return max(1, min(want, -(-backlog // max(1, runners))))


# -- claiming ----------------------------------------------------------------------------------

_CLAIMS = {}      # (backend, limit, guarded, slot_check) -> the statement(s) of a claim


def claim_statements(backend, limit, guarded=False, slot_check=True):
    """The statement(s) that claim up to `limit` runs of one queue on `backend`: a single
    claim is the claim of many with a limit of 1 (LIMIT is written into the statement, as
    the planner then knows it reads a few rows off the index). `guarded`: see CLAIM_GUARD
    (statements/shared.py); not on MySQL (mysql.claim says why). `slot_check`: the claimer's
    slot of the queue is checked against its limit (SLOT_WITHIN_LIMIT; a claimer that cannot
    be above one leaves it out: shared.needs_slot_check)."""
    key = (backend, limit, guarded, slot_check)
    if key not in _CLAIMS:
        _CLAIMS[key] = CATALOGUES[backend].claim(limit, guarded, slot_check)
    return _CLAIMS[key]


CLAIMED_WIDTH = 7     # run id, task id, attempt, handler, data, max_runtime, periodic_task_id


def claim(store, runner_id, queue, at, limit=1, flow=None, guarded=False, slot_check=True):
    """Up to `limit` scheduled runs of `queue` become ``running`` under `runner_id`, in the
    claim order: a list of (run id, task id, attempt, handler, data, max_runtime,
    periodic_task_id). The runs alone are written: their tasks' rows are read (and locked
    where rows are: a task row another transaction holds is skipped). Inside the caller's
    write transaction, but on PostgreSQL (one statement).
    Race closed: two runners taking the same run — PostgreSQL and MySQL lock the candidates
    FOR UPDATE SKIP LOCKED, so a concurrent claimer passes over them instead of waiting, and
    lock each candidate's task row with it (postgresql.claim; MySQL's join), so a task row
    another transaction holds makes the claim pass over that task, not wait for it at the
    run's end; SQLite takes the write lock up front (BEGIN IMMEDIATE), so the select and the
    update are one step.
    `flow`: (rate, keys, fair) of a queue under flow control (`flow_claim`, one run).
    `guarded`: the queue must not be paused, nor any rate key limited (CLAIM_GUARD in
    statements/shared.py; not with `flow`). `slot_check`: see claim_statements."""
    if flow is not None and any(flow):
        return flow_claim(store, runner_id, queue, at, *flow, slot_check=slot_check)
    execute = executor(store.db)
    statements = claim_statements(store.backend, limit, guarded, slot_check)
    held = (runner_id, queue) if slot_check else ()
    if store.backend == "postgresql":
        return in_claim_order(execute(statements, (queue, runner_id, *held, runner_id, at,
                                                   at)), CLAIMED_WIDTH)
    if store.is_sqlite:
        stamp = at.isoformat(" ")         # bound as text once
        if limit == 1:                    # a busy runner's every claim: no order to restore
            pick, start = statements
            run = execute(pick, (queue, runner_id, *held)).fetchone()
            if run is None:
                return []
            execute(start, (runner_id, stamp, stamp, run[0]))
            return [run]
        claim_runs, claim_task = statements
        found = execute(claim_runs, (runner_id, stamp, stamp, queue, runner_id, *held))
        return [run + execute(claim_task, (run[1],)).fetchone()
                for run in in_claim_order(found, 3)]
    rows = execute(statements, (queue, runner_id, *held)).fetchall()
    if rows:
        execute(mysql.START % ", ".join(["%s"] * len(rows)),
                (runner_id, at, at, *[r[0] for r in rows]))
    return [tuple(row) for row in rows]


# What end_success answers besides True (ended) and False (not: rule 4): the run ended and its
# task has dependents, for the caller to release in the same transaction (graph.release).
RELEASE = "release"


_SUCCESS_AND_CLAIM = {True: postgresql.SUCCESS_AND_CLAIM,
                      False: postgresql.success_and_claim(False)}


def end_success_and_claim(store, run_id, task_id, runner_id, results, at, queue,
                          slot_check=True):
    """PostgreSQL, one statement: `end_success_alone` of a runner's run (of the task
    `task_id`) and the `claim` of its next from `queue`, with the races both close. Returns
    (True, False or None as end_success_alone, the claimed row or None)."""
    held = (runner_id, queue) if slot_check else ()
    row = store.db.execute_sql(_SUCCESS_AND_CLAIM[slot_check], (
        task_id, at, at, results, run_id, runner_id, at, at, queue, runner_id, *held,
        runner_id, at, at)).fetchone()
    ended = True if row[0] > 0 else None if row[1] else False
    return ended, None if row[2] is None else tuple(row[2:2 + CLAIMED_WIDTH])


# -- ending ------------------------------------------------------------------------------------

def end_success_alone(store, run_id, task_id, runner_id, results, at):
    """PostgreSQL, one statement and its own transaction: the run ``success`` and its task,
    as `end_success`, unless the task has dependents. Returns True (ended), False (not: rule
    4), or None: the task has dependents — not ended; end it in a transaction
    (`end_success`, then graph.release)."""
    ended, dependents = store.db.execute_sql(
        postgresql.SUCCESS, (task_id, at, at, results, run_id, runner_id, at, at)).fetchone()
    return True if ended > 0 else None if dependents else False


def end_success(store, run_id, task_id, runner_id, results, at):
    """Inside the caller's transaction: the run ``success`` and its task, RUN_SUCCESS and
    TASK_SUCCESS. Returns False (not ended), True, or RELEASE (ended, and the task has
    dependents to release in this transaction).
    Race closed: a runner finishing a run someone timed out meanwhile (rule 4) — WHERE
    status = 'running' AND runner_id = ?, and the task is written only when the run was."""
    execute = executor(store.db)
    if store.backend == "postgresql":
        ended, dependents = execute(postgresql.SUCCESS_IN_TRANSACTION, (
            at, at, results, run_id, runner_id, at, at)).fetchone()
        return False if not ended else RELEASE if dependents else True
    if store.is_sqlite:
        end_run, end_run_apart, end_task, end_task_apart, clear_task = sqlite.SUCCESS
        at = at.isoformat(" ")
        # The run's own statement first; its second only when the first changed nothing: a
        # run with a concurrency slot, or not this runner's running run any more (rule 4).
        if not execute(end_run, (at, at, results, run_id, runner_id)).rowcount \
                and not execute(end_run_apart, (at, at, results, run_id, runner_id)).rowcount:
            return False
        if execute(end_task, (at, at, task_id)).rowcount:
            return True
        task = execute(end_task_apart, (at, at, task_id)).fetchone()
        if task is not None and task[0] is not None:
            execute(clear_task, (task_id,))
        return RELEASE if task is not None and task[1] else True
    if not execute(mysql.SUCCESS[0], (at, at, results, run_id, runner_id)).rowcount:
        return False
    if execute(mysql.SUCCESS[1], (at, at, task_id)).rowcount:
        return True
    execute(mysql.SUCCESS[2], (at, at, task_id))
    return RELEASE


def end_successes(store, runner_id, done):
    """Inside the caller's write transaction: `end_success` of each of `done`, (run id, task
    id, results, at) of runs of `runner_id`, under the same condition (rule 4); PostgreSQL
    in one statement. Returns {run id ended: its task id if it has dependents to release in
    this transaction, else None}."""
    if store.backend == "postgresql":
        ids, _, results, ats = zip(*done)
        return {row[0]: row[1] if row[2] else None for row in store.db.execute_sql(
            postgresql.SUCCESSES, (list(ids), list(ats), list(results), runner_id))}
    ended = {}
    for run_id, task_id, results, at in done:
        outcome = end_success(store, run_id, task_id, runner_id, results, at)
        if outcome:
            ended[run_id] = task_id if outcome == RELEASE else None
    return ended


def end_running(store, run_id, runner_id, status, at, error_code=None, error_message=None,
                results=None, traceback=None):
    """A ``running`` run (of `runner_id`, when given: a runner ending its own) ends with
    `status`: error, timeout, cancelled, or requeued (handed back: it runs again). Returns
    whether it did.
    Race closed: a runner that comes back late, or two processes noticing one death or one
    timeout (rule 4) — the UPDATE matches only a run still ``running`` (under that runner),
    so exactly one end counts."""
    Run = store.Run
    values = {Run.status: status, Run.finished_on: at, Run.updated_on: at,
              Run.active_task_id: None, Run.concurrency_slot: None, Run.error_code: error_code,
              Run.error_message: error_message}
    if results is not None:
        values[Run.results] = results
    if traceback is not None:
        values[Run.traceback] = traceback
    condition = (Run.id == run_id) & (Run.status == RUNNING)
    if runner_id is not None:
        condition &= Run.runner_id == runner_id
    return Run.update(values).where(condition).execute() > 0


def cancel_scheduled(store, run_id, at):
    """A ``scheduled`` run ends ``cancelled``; returns whether it did.
    Race closed: a cancel against a runner claiming the run — WHERE status = 'scheduled':
    once claimed, the run is the runner's to end (it is asked to stop instead)."""
    Run = store.Run
    return Run.update(status=CANCELLED, finished_on=at, updated_on=at, active_task_id=None,
                      concurrency_slot=None).where(
        (Run.id == run_id) & (Run.status == SCHEDULED)).execute() > 0


def ask_to_stop(store, run_id, at):
    """An operator's cancel of a ``running`` run: its runner sees it and ends the run
    ``cancelled`` (the run stays its runner's to end). Returns whether the run was running.
    Race closed: the run ending meanwhile — WHERE status = 'running'."""
    Run = store.Run
    return Run.update(cancel_requested_on=at).where(
        (Run.id == run_id) & (Run.status == RUNNING)).execute() > 0


def give_back(store, run_id, task_id, runner_id, at):
    """A ``running`` run of `runner_id` goes back to ``scheduled``, unstarted (not a failure,
    not a new attempt), and its task with it. Returns whether it did.
    Race closed: giving back a run someone timed out meanwhile (rule 4) — WHERE status =
    'running' AND runner_id = ?, and the task is written only when the run was."""
    Task, Run = store.Task, store.Run
    if not Run.update(status=SCHEDULED, runner_id=None, started_on=None, updated_on=at).where(
            (Run.id == run_id) & (Run.status == RUNNING) & (Run.runner_id == runner_id)
    ).execute():
        return False
    Task.update(last_status=SCHEDULED, updated_on=at).where(Task.id == task_id).execute()
    return True


def end_task(store, task_id, status, at, **values):
    """The task ends: final with `status` (``success`` is `end_success`'s; cancelled, or a
    failure given up), no next run, its unique_key free, waiting for no concurrency slot.
    `values`: more columns to write (a failure's counts and error)."""
    Task = store.Task
    Task.update(last_status=status, next_run_on=None, finished_on=at, active_key=None,
                waiting_key=None, updated_on=at, **values).where(Task.id == task_id).execute()


# -- adding tasks ------------------------------------------------------------------------------
# A task, and its first run when it is due, as plain SQL: peewee builds a node per value,
# which costs several times the inserts themselves. Rule 1 needs no statement of its own: a
# first run carries active_task_id, under its unique index. Every INSERT of a task or a run
# is one of these three, through the store's connection or the caller's (a task added inside
# the application's transaction).

def columns(model, names, param):
    """The fields of `names` in `model`, their column list and as many placeholders."""
    fields = [model._meta.fields[name] for name in names]
    return fields, ", ".join(f.column_name for f in fields), ", ".join([param] * len(fields))


def bind(backend, fields, values):
    """The values of `fields` as the driver binds them; SQLite's datetimes as the text
    peewee stores (Python 3.12 deprecates sqlite3's own adapter)."""
    values = [f.db_value(value) for f, value in zip(fields, values)]
    if backend != "sqlite":
        return values
    return [v.isoformat(" ") if isinstance(v, datetime) else v for v in values]


_INSERT_ROW = {}      # (backend, table, names) -> (the statement, its fields)


def insert_row(backend, model, names):
    """INSERT of one row of `model` with the fields `names`: (statement, fields). PostgreSQL
    returns the id (RETURNING), the others give the driver's lastrowid."""
    key = (backend, model._meta.table_name, names)
    if key not in _INSERT_ROW:
        fields, listed, marks = columns(model, names, "?" if backend == "sqlite" else "%s")
        _INSERT_ROW[key] = ("INSERT INTO %s (%s) VALUES (%s)%s" % (
            model._meta.table_name, listed, marks,
            " RETURNING id" if backend == "postgresql" else ""), fields)
    return _INSERT_ROW[key]


def insert_rows(backend, model, rows):
    """One INSERT of `rows` (dicts with the same keys) of `model`: (statement, parameters),
    RETURNING nothing (append " RETURNING id" where INSERT ... RETURNING works: the ids come
    in row order within one statement, though RETURNING's own order is not promised)."""
    fields = [model._meta.fields[name] for name in rows[0]]
    table, listed = model._meta.table_name, ", ".join(f.column_name for f in fields)
    if backend == "postgresql":
        # psycopg parses each of thousands of placeholders in Python; one JSON parameter
        # expanded by the server costs a fraction of that.
        return ("INSERT INTO %s (%s) SELECT %s FROM json_populate_recordset(NULL::%s, %%s)"
                % (table, listed, listed, table),
                [json.dumps([{f.column_name: f.db_value(row[f.name]) for f in fields}
                             for row in rows], default=str)])
    values = "(%s)" % ", ".join(["?" if backend == "sqlite" else "%s"] * len(fields))
    return ("INSERT INTO %s (%s) VALUES %s" % (table, listed, ", ".join([values] * len(rows))),
            [v for row in rows for v in bind(backend, fields, [row[f.name] for f in fields])])


_ADD = {}     # (task names, run names, notify) -> (the statement, task fields, run fields)


def insert_task_and_run(Task, Run, task_names, run_names, notify):
    """PostgreSQL: the task, its first run when due (`run_names`: its fields but the two
    that take the task's id) and the NOTIFY to other hosts, in one statement of
    data-modifying CTEs that returns the task id; (statement, task fields, run fields). An
    add is then one round trip, as Procrastinate's defer is, where BEGIN, two INSERTs, the
    NOTIFY and COMMIT were five. Every data-modifying CTE runs to completion, and the NOTIFY
    is read by the final SELECT, so all happen or none."""
    key = (task_names, run_names, notify)
    if key not in _ADD:
        task_fields, listed, marks = columns(Task, task_names, "%s")
        statement = "WITH task AS (INSERT INTO %s (%s) VALUES (%s) RETURNING id)" % (
            Task._meta.table_name, listed, marks)
        run_fields, listed, marks = columns(Run, run_names, "%s")
        if run_names:
            statement += ", run AS (INSERT INTO %s (%s, %s, %s) SELECT id, id, %s FROM task)" \
                % (Run._meta.table_name, Run.task_id.column_name,
                   Run.active_task_id.column_name, listed, marks)
        if notify:
            statement += ", news AS (%s AS sent)" % NOTIFY_SQL
        statement += " SELECT id FROM task" + (" CROSS JOIN news" if notify else "")
        _ADD[key] = (statement, task_fields, run_fields)
    return _ADD[key]


# The row of a queue first seen, by backend (the race it closes: postgresql.INSERT_QUEUE).
INSERT_QUEUE = {backend: catalogue.INSERT_QUEUE for backend, catalogue in CATALOGUES.items()}
