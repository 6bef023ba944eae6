"""The task queue: adding tasks, creating runs (rule 3), claiming them (rule 2), ending them
(rule 4) and aggregating each task after its run; retry, cancel, and the regular
`process_queue()` pass.

Every function here that changes state more than one row at a time runs in one write
transaction (`retry_transaction`) and says in its docstring which race it closes.
"""
import json
import logging
import random
import sqlite3
from collections import namedtuple
from datetime import datetime, timedelta

import peewee as pw

from . import liveness, periodic, rotation, wakeup
from .config import Config
from .db import backend_of, check_connection, open_database, retry_transaction
from .errors import ConfigError, HandlerError, InputError, StateError, TaskNotFound
from .handler import encode_data, load_handler
from .migrations import migrate
from .timespan import MAX_SPAN
from .models import (CANCELLED, FAILED, MODELS, RUNNING, SCHEDULED, SUCCESS, TIMEOUT,
                     Run, Task, as_utc, run_status_is, utcnow)

log = logging.getLogger("taskrunner.queue")

ClaimedRun = namedtuple("ClaimedRun", "run_id task_id attempt handler data max_runtime "
                                      "periodic_task_id started_on")

# Claiming and successfully finishing happen once per job, so they are plain SQL: building
# them with peewee costs more than the database work. On PostgreSQL each is one statement of
# data-modifying CTEs, and a runner that goes on working finishes its run and claims the
# next in one statement too (one round trip, one commit per job). SQLite uses UPDATE ...
# RETURNING; MySQL, which has none, a locking SELECT of the run joined to its task.
_PG_CLAIM_CTES = """
    next AS (
        SELECT id FROM task_runs WHERE status = 'scheduled'
        ORDER BY priority DESC, scheduled_on, id LIMIT 1 FOR UPDATE SKIP LOCKED),
    claimed AS (
        UPDATE task_runs AS r SET status = 'running', runner_id = %s, started_on = %s,
            updated_on = %s
        FROM next WHERE r.id = next.id RETURNING r.id, r.task_id, r.attempt),
    claimed_task AS (
        UPDATE task_queue AS t SET last_status = 'running', updated_on = %s FROM claimed
        WHERE t.id = claimed.task_id
        RETURNING claimed.id, claimed.task_id, claimed.attempt, t.handler, t.data,
            t.max_runtime, t.periodic_task_id)"""
_PG_SUCCESS_CTES = """
    ended AS (
        UPDATE task_runs SET status = 'success', finished_on = %s, updated_on = %s,
            active_task_id = NULL, error_code = NULL, error_message = NULL,
            percent_completed = 100, results = %s
        WHERE id = %s AND status = 'running' AND runner_id = %s RETURNING task_id),
    ended_task AS (
        UPDATE task_queue AS t SET last_status = 'success', runs_failed = 0,
            next_run_on = NULL, finished_on = %s, active_key = NULL, updated_on = %s
        FROM ended WHERE t.id = ended.task_id RETURNING t.id)"""
_PG_CLAIM = "WITH" + _PG_CLAIM_CTES + " SELECT * FROM claimed_task"
_PG_SUCCESS = "WITH" + _PG_SUCCESS_CTES + " SELECT count(*) FROM ended_task"
# Every data-modifying CTE runs to completion whether or not the final SELECT reads it.
_PG_SUCCESS_AND_CLAIM = ("WITH" + _PG_SUCCESS_CTES + "," + _PG_CLAIM_CTES + """
    SELECT (SELECT count(*) FROM ended_task), c.* FROM (VALUES (1)) AS one
    LEFT JOIN claimed_task AS c ON true""")
_SQLITE_CLAIM = ("""
    UPDATE task_runs SET status = 'running', runner_id = ?, started_on = ?, updated_on = ?
    WHERE id = (SELECT id FROM task_runs WHERE status = 'scheduled'
                ORDER BY priority DESC, scheduled_on, id LIMIT 1)
    RETURNING id, task_id, attempt""", """
    UPDATE task_queue SET last_status = 'running', updated_on = ? WHERE id = ?
    RETURNING handler, data, max_runtime, periodic_task_id""")
_SUCCESS_STATEMENTS = ("""
    UPDATE task_runs SET status = 'success', finished_on = ?, updated_on = ?,
        active_task_id = NULL, error_code = NULL, error_message = NULL,
        percent_completed = 100, results = ?
    WHERE id = ? AND status = 'running' AND runner_id = ?""", """
    UPDATE task_queue SET last_status = 'success', runs_failed = 0, next_run_on = NULL,
        finished_on = ?, active_key = NULL, updated_on = ? WHERE id = ?""")
# SQLite and MySQL, by the driver's placeholder.
_SUCCESS = {"?": _SUCCESS_STATEMENTS,
            "%s": tuple(s.replace("?", "%s") for s in _SUCCESS_STATEMENTS)}
# MySQL: the candidate and its task locked and read at once (InnoDB locks the joined task
# row too, which the claim updates anyway), then both marked.
_MYSQL_CLAIM = """
    SELECT r.id, r.task_id, r.attempt, t.handler, t.data, t.max_runtime, t.periodic_task_id
    FROM task_runs AS r JOIN task_queue AS t ON t.id = r.task_id
    WHERE r.status = 'scheduled' ORDER BY r.priority DESC, r.scheduled_on, r.id LIMIT 1
    FOR UPDATE SKIP LOCKED"""
_MYSQL_START = (
    "UPDATE task_runs SET status = 'running', runner_id = %s, started_on = %s, updated_on = %s "
    "WHERE id = %s",
    "UPDATE task_queue SET last_status = 'running', updated_on = %s WHERE id = %s")
MAX_INT = 2 ** 31 - 1  # INTEGER columns on every database


def retry_delay(runs_failed, base, cap, rand=random.random):
    """Exponential backoff after `runs_failed` consecutive failures, capped, with jitter
    (half fixed, half random) so failed tasks don't all come back at the same moment."""
    # The exponent is capped: 2 ** 1025 no longer fits a float, and max_retries may be huge.
    delay = min(cap, base * 2 ** min(max(0, runs_failed - 1), 64))
    return delay / 2 + rand() * delay / 2


class TaskQueue:
    """The queue in one database.

    ``TaskQueue("sqlite:///taskrunner.db")``, ``TaskQueue("postgresql://user@host/db")``,
    ``TaskQueue("/etc/taskrunner.toml")``, ``TaskQueue(Config)``, or ``TaskQueue()`` for
    $TASKRUNNER_CONFIG / $TASKRUNNER_DATABASE_URL / the defaults. The schema is brought up
    to date on first use.
    """

    def __init__(self, url_or_config=None, migrate_schema=True):
        if isinstance(url_or_config, Config):
            config = url_or_config
        elif url_or_config is None:
            config = Config.load()
        elif "://" in str(url_or_config):
            config = Config.from_dict({"database": {"url": str(url_or_config)}}, source="<url>")
        else:
            config = Config.load(path=str(url_or_config))
        self.config = config
        self.backend = backend_of(config.database.url)
        self.is_sqlite = self.backend == "sqlite"
        self.db = open_database(config.database)
        self._returning = None
        self.db.bind(MODELS)
        if migrate_schema:
            self.migrate()

    # -- connection ---------------------------------------------------------------------

    def migrate(self):
        check_connection(self.db, self.config.database.url)
        return migrate(self.db, self.backend)

    def close(self):
        if not self.db.is_closed():
            self.db.close()

    def _write(self, fn):
        return retry_transaction(self.db, fn)

    def _locked(self, query):
        """SELECT ... FOR UPDATE where the database has row locks; SQLite's transaction
        already holds the write lock."""
        return query if self.is_sqlite else query.for_update()

    # -- adding tasks -------------------------------------------------------------------

    def _task_row(self, handler, data=None, scheduled_on=None, max_retries=None, priority=0,
                  run_timeout=None, unique_key=None, queued_by=None, max_runtime=None,
                  retry_backoff=None, periodic_task_id=None, now=None, _handlers=None):
        """Validate one task and return the row to insert; raise InputError on bad input."""
        defaults = self.config.task
        if _handlers is None or handler not in _handlers:
            load_handler(handler, self.config.handlers.allow)
            if _handlers is not None:
                _handlers.add(handler)
        text = encode_data(data, defaults.max_data_size)
        now = now or utcnow()
        if scheduled_on is None:
            scheduled_on = now
        elif isinstance(scheduled_on, datetime):
            scheduled_on = as_utc(scheduled_on)
        else:
            raise InputError("scheduled_on must be a datetime, not %r" % (scheduled_on,))
        for name, value in (("max_retries", max_retries), ("priority", priority)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise InputError("%s must be an integer, not %r" % (name, value))
        if max_retries is not None and not 1 <= max_retries <= MAX_INT:
            raise InputError("max_retries must be between 1 and %d" % MAX_INT)
        if priority is not None and not -MAX_INT <= priority <= MAX_INT:
            raise InputError("priority must be between %d and %d" % (-MAX_INT, MAX_INT))
        for name, value in (("run_timeout", run_timeout), ("max_runtime", max_runtime),
                            ("retry_backoff", retry_backoff)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not 0 < value <= MAX_SPAN):
                raise InputError("%s must be a positive number of seconds (at most 100 years), "
                                 "not %r" % (name, value))
        if unique_key is not None and (not isinstance(unique_key, str) or not unique_key
                                       or len(unique_key) > 255):
            raise InputError("unique_key must be a non-empty string of at most 255 characters")
        due = scheduled_on <= now
        return {
            "queued_on": now, "queued_by": queued_by, "scheduled_on": scheduled_on,
            "handler": handler, "data": text, "priority": priority or 0,
            "last_status": SCHEDULED,
            "max_retries": max_retries if max_retries is not None else defaults.max_retries,
            "runs_failed": 0, "run_count": 1 if due else 0,
            "run_timeout": float(run_timeout or defaults.run_timeout),
            "max_runtime": max_runtime, "retry_backoff": retry_backoff,
            "unique_key": unique_key, "active_key": unique_key,
            "periodic_task_id": periodic_task_id,
            "next_run_on": None if due else scheduled_on,
            "updated_on": now,
        }

    def _insert_task(self, row):
        task_id = Task.insert(**row).execute()
        if self._is_due(row):
            # A due task gets its first run in the same transaction: runners can start it at once.
            Run.insert(**self._first_run(task_id, row)).execute()
        return task_id

    @staticmethod
    def _first_run(task_id, row):
        return {"task_id": task_id, "created_on": row["queued_on"], "updated_on": row["queued_on"],
                "attempt": 1, "active_task_id": task_id, "priority": row["priority"],
                "scheduled_on": row["scheduled_on"], "status": SCHEDULED, "percent_completed": 0}

    def _write_and_wake(self, fn, wake):
        """Run fn in a write transaction; when ``wake(result)`` says it made runs claimable,
        wake idle runners (on PostgreSQL by NOTIFY inside the transaction, on this host after
        the commit)."""
        def step():
            result = fn()
            if wake(result):
                wakeup.notify_in_transaction(self.db, self.backend)
            return result
        result = self._write(step)
        if wake(result):
            wakeup.notify_local(self.config.database.url)
        return result

    @staticmethod
    def _is_due(row):
        return row["next_run_on"] is None

    def _add_unique(self, row):
        """Insert a task with a unique_key, or return the id of the live task holding the key.
        Race closed: two adds of one key — the unique index on active_key lets one insert win;
        the other reads the winner's id (and tries again if that task ended meanwhile)."""
        for _ in range(5):
            try:
                return self._write_and_wake(lambda: self._insert_task(row),
                                            lambda _: self._is_due(row))
            except pw.IntegrityError:
                existing = Task.select(Task.id).where(Task.active_key == row["unique_key"]).first()
                if existing is not None:
                    return existing.id
        raise StateError("unique_key %r is contended; try again" % row["unique_key"])

    def add_task(self, handler, data=None, scheduled_on=None, max_retries=None, priority=0,
                 run_timeout=None, unique_key=None, queued_by=None, max_runtime=None,
                 retry_backoff=None, periodic_task_id=None, now=None):
        """Queue one task and return its id.

        With `unique_key`, adding a key that a not-yet-final task holds stores nothing and
        returns that task's id.
        """
        row = self._task_row(handler, data, scheduled_on, max_retries, priority, run_timeout,
                             unique_key, queued_by, max_runtime, retry_backoff, periodic_task_id,
                             now)
        if unique_key is not None:
            return self._add_unique(row)
        return self._write_and_wake(lambda: self._insert_task(row), lambda _: self._is_due(row))

    def add_tasks(self, tasks, now=None):
        """Queue many tasks; `tasks` are dicts of add_task's arguments. All are validated
        before anything is stored; those without a unique_key are stored in one transaction,
        those with one each as add_task() stores them. Returns their ids in order."""
        now = now or utcnow()
        seen = set()
        try:
            rows = [self._task_row(now=now, _handlers=seen, **spec) for spec in tasks]
        except TypeError as exc:
            raise InputError("invalid task: %s" % exc) from None

        plain_rows = [row for row in rows if row["unique_key"] is None]
        due = any(self._is_due(row) for row in plain_rows)
        plain = self._write_and_wake(lambda: self._insert_many(plain_rows),
                                     lambda _: due) if plain_rows else []
        ids, plain_ids = [], iter(plain)
        for row in rows:
            ids.append(next(plain_ids) if row["unique_key"] is None else self._add_unique(row))
        return ids

    BULK_ROWS = 500     # rows per INSERT: within every database's limit on bound parameters

    def _insert_many(self, rows):
        """Insert task rows (and the first run of each due one) in multi-row INSERTs, inside
        the caller's transaction; returns the task ids in order. Without INSERT ... RETURNING
        (MySQL), row by row."""
        if not self._insert_returning():
            return [self._insert_task(row) for row in rows]
        ids = []
        for start in range(0, len(rows), self.BULK_ROWS):
            chunk = rows[start:start + self.BULK_ROWS]
            chunk_ids = self._insert_values(Task, chunk, returning=True)
            runs = [self._first_run(task_id, row) for task_id, row in zip(chunk_ids, chunk)
                    if self._is_due(row)]
            if runs:
                self._insert_values(Run, runs)
            ids.extend(chunk_ids)
        return ids

    def _insert_values(self, model, rows, returning=False):
        """One multi-row INSERT of `rows` (dicts with the same keys), as plain SQL: peewee
        builds a node per value, which costs more than the insert itself. With `returning`,
        the new ids in row order (they are assigned in row order within one statement;
        RETURNING's own order is not promised everywhere, hence the sort)."""
        fields = [model._meta.fields[name] for name in rows[0]]
        table, columns = model._meta.table_name, ", ".join(f.column_name for f in fields)
        if self.backend == "postgresql":
            # psycopg parses each of thousands of placeholders in Python; one JSON parameter
            # expanded by the server costs a fraction of that.
            sql = "INSERT INTO %s (%s) SELECT %s FROM json_populate_recordset(NULL::%s, %%s)" % (
                table, columns, columns, table)
            params = [json.dumps([{f.column_name: f.db_value(row[f.name]) for f in fields}
                                  for row in rows], default=str)]
        else:
            values = "(%s)" % ", ".join([self.db.param] * len(fields))
            sql = "INSERT INTO %s (%s) VALUES %s" % (table, columns, ", ".join([values] * len(rows)))
            params = [f.db_value(row[f.name]) for row in rows for f in fields]
        if not returning:
            self.db.execute_sql(sql, params)
            return None
        return sorted(row[0] for row in self.db.execute_sql(sql + " RETURNING id", params))

    def _insert_returning(self):
        """Whether INSERT ... RETURNING works here: PostgreSQL, SQLite 3.35+, MariaDB 10.5+."""
        if self._returning is None:
            if self.backend == "postgresql":
                self._returning = True
            elif self.is_sqlite:
                self._returning = sqlite3.sqlite_version_info >= (3, 35)
            else:
                version = self.db.execute_sql("SELECT VERSION()").fetchone()[0]
                numbers = tuple(int(n) for n in version.split("-")[0].split(".")[:2])
                self._returning = "mariadb" in version.lower() and numbers >= (10, 5)
        return self._returning

    # -- creating runs (rule 3) ---------------------------------------------------------

    def create_missing_runs(self, now=None, batch=500):
        """Create the next run of every task whose next_run_on has come: due delayed tasks
        and failed tasks whose backoff has passed (given-up and final tasks have no
        next_run_on). Race closed: two processes creating runs at once — the candidate tasks
        are locked (SKIP LOCKED / SQLite's write lock) and the unique index on
        task_runs.active_task_id refuses a second live run whatever happens."""
        now = now or utcnow()
        created = 0
        # A cheap read first: most passes find nothing and need no write lock.
        if not Task.select(Task.id).where(Task.next_run_on <= now).exists():
            return 0
        while True:
            def step():
                query = (Task.select(Task.id).where(Task.next_run_on <= now)
                         .order_by(Task.next_run_on).limit(batch))
                if not self.is_sqlite:
                    query = query.for_update(skip_locked=True)
                ids = [t.id for t in query]
                if ids:
                    live = Run.select(Run.id).where(Run.active_task_id == Task.id)
                    source = (Task.select(Task.id, pw.Value(now), pw.Value(now), Task.run_count + 1,
                                          Task.id, Task.priority, Task.scheduled_on,
                                          pw.Value(SCHEDULED), pw.Value(0))
                              .where(Task.id.in_(ids) & ~pw.fn.EXISTS(live)))
                    Run.insert_from(source, [Run.task_id, Run.created_on, Run.updated_on,
                                             Run.attempt, Run.active_task_id, Run.priority,
                                             Run.scheduled_on, Run.status,
                                             Run.percent_completed]).execute()
                    (Task.update(next_run_on=None, run_count=Task.run_count + 1,
                                 last_status=SCHEDULED, updated_on=now)
                     .where(Task.id.in_(ids)).execute())
                return len(ids)
            count = self._write_and_wake(step, bool)
            created += count
            if count < batch:
                return created

    # -- claiming and ending runs -------------------------------------------------------

    def has_scheduled_runs(self):
        """A cheap read (no write lock) that idle runners poll before trying to claim."""
        return self.scheduled_runs_query().exists()

    @staticmethod
    def scheduled_runs_query():
        """Scheduled runs, read from the partial claim index (never the run history)."""
        return Run.select(Run.id).where(run_status_is(SCHEDULED)).limit(1)

    @staticmethod
    def running_runs_query():
        """Running runs with their task's timeouts, from the partial runner index."""
        return (Run.select(Run.id, Run.task_id, Run.runner_id, Run.updated_on, Run.started_on,
                           Task.run_timeout, Task.max_runtime)
                .join(Task, on=(Run.task_id == Task.id)).where(run_status_is(RUNNING)))

    def claim(self, runner_id, now=None):
        """Start the next run for `runner_id`: highest priority first, FIFO within a priority
        (rule 2). Race closed: two runners taking the same run — PostgreSQL and MySQL lock the
        candidate FOR UPDATE SKIP LOCKED, so a concurrent claimer passes over it instead of
        waiting; SQLite takes the write lock up front (BEGIN IMMEDIATE), so the select and the
        update are one step. Returns a ClaimedRun or None."""
        now = now or utcnow()
        if self.backend == "postgresql":
            return self._claim_step(runner_id, now)     # one statement: its own transaction
        return self._write(lambda: self._claim_step(runner_id, now))

    def _claim_step(self, runner_id, now):
        """claim() inside the caller's write transaction."""
        sql = self.db.execute_sql
        if self.backend == "postgresql":
            row = sql(_PG_CLAIM, (runner_id, now, now, now)).fetchone()
            return None if row is None else ClaimedRun(*row, now)
        if self.is_sqlite:
            claim_run, claim_task = _SQLITE_CLAIM
            run = sql(claim_run, (runner_id, now, now)).fetchone()
            if run is None:
                return None
            task = sql(claim_task, (now, run[1])).fetchone()
            return ClaimedRun(*run, *task, now)
        row = sql(_MYSQL_CLAIM).fetchone()
        if row is None:
            return None
        sql(_MYSQL_START[0], (runner_id, now, now, row[0]))
        sql(_MYSQL_START[1], (now, row[1]))
        return ClaimedRun(*row, now)

    def release_run(self, run_id, runner_id, now=None):
        """Give back a run this runner claimed but did not start (it was told to stop in
        between): the run is ``scheduled`` again for any runner. False if it was no longer
        this runner's running run."""
        return self.release_runs_of(runner_id, only=run_id, now=now) > 0

    def release_runs_of(self, runner_id, only=None, keep=None, now=None):
        """Give back, unstarted, the runs `runner_id` has ``running`` (just `only`, or all
        but `keep`): a runner that lost its connection while claiming cannot know whether
        the claim committed, and a run claimed that way would otherwise stay ``running``
        until its run_timeout. Returns how many were given back."""
        now = now or utcnow()

        def step():
            query = liveness.runs_of_runner_query(runner_id)
            if only is not None:
                query = query.where(Run.id == only)
            if keep is not None:
                query = query.where(Run.id != keep)
            released = 0
            for run in list(query):
                # Conditional like every end (rule 4): an overseer may have timed it out since.
                if Run.update(status=SCHEDULED, runner_id=None, started_on=None, updated_on=now
                              ).where((Run.id == run.id) & run_status_is(RUNNING)
                                      & (Run.runner_id == runner_id)).execute():
                    Task.update(last_status=SCHEDULED, updated_on=now).where(
                        Task.id == run.task_id).execute()
                    released += 1
            return released
        return self._write_and_wake(step, bool)

    def was_ended_by(self, run_id, runner_id, status):
        """Whether the run ended with `status` by `runner_id`'s own end (not a timeout set
        by someone else): after a lost connection, did the end commit?"""
        return Run.select().where((Run.id == run_id) & (Run.runner_id == runner_id)
                                  & (Run.status == status)).exists()

    def report_progress(self, run_id, runner_id, percent, now=None):
        """Store progress; False when the run is no longer this runner's (it was timed out)."""
        now = now or utcnow()
        return Run.update(percent_completed=percent, updated_on=now).where(
            (Run.id == run_id) & (Run.status == RUNNING) & (Run.runner_id == runner_id)
        ).execute() > 0

    def end_run(self, run_id, task_id, status, runner_id=None, results=None, error_code=None,
                error_message=None, now=None, periodic_task_id=None):
        """End a running run with `status` and aggregate its task.

        Rule 4: the update is conditional on the run still being ``running`` (and, for a
        runner finishing its own run, on its runner_id), so a runner that comes back late
        cannot overwrite a ``timeout`` set meanwhile. Returns False when it lost that race.
        """
        now = now or utcnow()
        args = (run_id, task_id, status, runner_id, results, error_code, error_message, now,
                periodic_task_id)
        if self._single_statement_end(status, runner_id, periodic_task_id):
            return self._end_step(*args)
        return self._write(lambda: self._end_step(*args))

    def end_run_and_claim(self, run_id, task_id, status, runner_id, results=None,
                          error_code=None, error_message=None, now=None, periodic_task_id=None):
        """end_run() of a runner's own run and claim() of its next in one transaction, so a
        busy runner pays one commit per job (one statement on PostgreSQL for a success).
        Same rules as the two calls; the claim happens even when the end lost its race.
        Returns (ended, ClaimedRun or None)."""
        now = now or utcnow()
        if self._single_statement_end(status, runner_id, periodic_task_id):
            row = self.db.execute_sql(_PG_SUCCESS_AND_CLAIM, (
                now, now, results, run_id, runner_id, now, now,
                runner_id, now, now, now)).fetchone()
            claimed = None if row[1] is None else ClaimedRun(*row[1:], now)
            return row[0] > 0, claimed
        return self._write(lambda: (
            self._end_step(run_id, task_id, status, runner_id, results, error_code,
                           error_message, now, periodic_task_id),
            self._claim_step(runner_id, now)))

    def _single_statement_end(self, status, runner_id, periodic_task_id):
        """A runner's success of a plain task on PostgreSQL: one statement, no transaction."""
        return (self.backend == "postgresql" and status == SUCCESS and runner_id is not None
                and periodic_task_id is None)

    def _end_step(self, run_id, task_id, status, runner_id, results, error_code, error_message,
                  now, periodic_task_id):
        """end_run() inside the caller's write transaction."""
        if status == SUCCESS and runner_id is not None:
            # The hot path, as plain SQL with the same conditions.
            if self.backend == "postgresql":
                ended = self.db.execute_sql(_PG_SUCCESS, (
                    now, now, results, run_id, runner_id, now, now)).fetchone()[0] > 0
            else:
                end_run, end_task = _SUCCESS[self.db.param]
                ended = self.db.execute_sql(end_run, (now, now, results, run_id, runner_id)).rowcount > 0
                if ended:
                    self.db.execute_sql(end_task, (now, now, task_id))
            if ended and periodic_task_id is not None:
                periodic.record_outcome(periodic_task_id, status, now)
            return ended
        values = {Run.status: status, Run.finished_on: now, Run.updated_on: now,
                  Run.active_task_id: None, Run.error_code: error_code,
                  Run.error_message: error_message}
        if status == SUCCESS:
            values[Run.percent_completed] = 100
        if results is not None:
            values[Run.results] = results
        condition = (Run.id == run_id) & (Run.status == RUNNING)
        if runner_id is not None:
            condition &= Run.runner_id == runner_id
        if not Run.update(values).where(condition).execute():
            return False
        self._aggregate(task_id, status, error_code, error_message, now, periodic_task_id)
        return True

    def _aggregate(self, task_id, status, error_code, error_message, now, periodic_task_id=None):
        """The task after a run ended: last_status, runs_failed (reset by a success), the last
        error, and when (if ever) its next run may be created. A success needs no read; the
        caller passes the periodic task id it knows from the claim."""
        if status in (SUCCESS, CANCELLED):
            values = {Task.last_status: status, Task.next_run_on: None, Task.finished_on: now,
                      Task.active_key: None, Task.updated_on: now}
            if status == SUCCESS:
                values[Task.runs_failed] = 0
            Task.update(values).where(Task.id == task_id).execute()
            if periodic_task_id is not None:
                periodic.record_outcome(periodic_task_id, status, now)
            return
        task = self._locked(Task.select(Task.runs_failed, Task.max_retries, Task.retry_backoff,
                                        Task.periodic_task_id).where(Task.id == task_id)).get()
        runs_failed = task.runs_failed + 1
        values = {Task.last_status: status, Task.runs_failed: runs_failed,
                  Task.last_error_code: error_code, Task.last_error_message: error_message,
                  Task.updated_on: now}
        if runs_failed >= task.max_retries:
            # Given up: final, with the reason kept in last_error_*.
            values.update({Task.next_run_on: None, Task.finished_on: now, Task.active_key: None})
        else:
            base = task.retry_backoff if task.retry_backoff is not None \
                else self.config.task.retry_backoff
            delay = retry_delay(runs_failed, base, self.config.task.retry_backoff_max)
            values[Task.next_run_on] = now + timedelta(seconds=delay)
        Task.update(values).where(Task.id == task_id).execute()
        if task.periodic_task_id is not None:
            periodic.record_outcome(task.periodic_task_id, status, now)

    def timeout_overdue_runs(self, now=None):
        """Mark ``timeout`` every running run with no update for its task's run_timeout, or
        running longer than its max_runtime. Returns [(run_id, runner_id)] of the runs marked,
        so the caller can stop the processes executing them (rule 8)."""
        now = now or utcnow()
        # Read in full before writing: on SQLite an open SELECT would make each end's write
        # transaction fail as soon as another process had committed meanwhile.
        running = list(self.running_runs_query().objects())
        ended = []
        for run in running:
            if run.updated_on + timedelta(seconds=run.run_timeout) < now:
                message = "no update for %gs (run_timeout)" % run.run_timeout
                code = "RunTimeout"
            elif run.max_runtime and run.started_on + timedelta(seconds=run.max_runtime) < now:
                message = "running longer than %gs (max_runtime)" % run.max_runtime
                code = "MaxRuntime"
            else:
                continue
            if self.end_run(run.id, run.task_id, TIMEOUT, error_code=code, error_message=message,
                            now=now):
                log.warning("run %d of task %d timed out: %s", run.id, run.task_id, message)
                ended.append((run.id, run.runner_id))
        return ended

    def process_queue(self, now=None):
        """One pass of the queue's regular work (``run-event task-queue:OnProcess``): mark dead
        runners and their runs ``timeout``, time out overdue runs, create missing runs."""
        now = now or utcnow()
        dead = liveness.refresh_runners(self, now=now)
        overdue = self.timeout_overdue_runs(now)
        created = self.create_missing_runs(now)
        return {"dead_runners": dead, "timed_out_runs": overdue, "created_runs": created}

    def rotate(self, now=None):
        return rotation.rotate(self, now or utcnow())

    # -- operator commands --------------------------------------------------------------

    def get_task(self, task_id):
        task = Task.get_or_none(Task.id == task_id)
        if task is None:
            raise TaskNotFound("no task with id %s" % task_id)
        return task

    def runs_of(self, task_id):
        self.get_task(task_id)
        return list(Run.select().where(Run.task_id == task_id).order_by(Run.id))

    def tasks(self, status=None, limit=100):
        """Most recent first. `status`: a run status, or ``given-up``."""
        query = Task.select().order_by(Task.id.desc()).limit(limit)
        if status == "given-up":
            query = query.where(Task.last_status.in_(FAILED) & Task.next_run_on.is_null()
                                & (Task.runs_failed >= Task.max_retries))
        elif status is not None:
            query = query.where(Task.last_status == status)
        return list(query)

    def retry(self, task_id, now=None):
        """Re-arm a failed or given-up task: runs_failed back to 0 and a run now.
        Race closed: retry against a runner finishing the task's run — the live-run unique
        index and the conditional state check inside one transaction."""
        now = now or utcnow()

        def step():
            task = self._locked(Task.select().where(Task.id == task_id)).first()
            if task is None:
                raise TaskNotFound("no task with id %s" % task_id)
            if task.last_status not in FAILED:
                raise StateError("task %d is %s; only a failed or given-up task can be retried"
                                 % (task.id, task.last_status))
            if Run.select().where(Run.active_task_id == task.id).exists():
                raise StateError("task %d already has a run scheduled or running" % task.id)
            try:
                with self.db.atomic():
                    Task.update(runs_failed=0, next_run_on=now, finished_on=None,
                                active_key=task.unique_key, updated_on=now
                                ).where(Task.id == task.id).execute()
            except pw.IntegrityError:
                raise StateError("task %d cannot be retried: another live task holds its "
                                 "unique_key %r" % (task.id, task.unique_key)) from None
        self._write(step)
        self.create_missing_runs(now)

    def cancel(self, task_id, now=None):
        """Cancel a task that has no running run; its scheduled run becomes ``cancelled``.
        Race closed: cancel against a runner claiming the run — the run is cancelled only
        WHERE status='scheduled', in the same transaction as the task update."""
        now = now or utcnow()

        def step():
            task = self._locked(Task.select().where(Task.id == task_id)).first()
            if task is None:
                raise TaskNotFound("no task with id %s" % task_id)
            if task.last_status == CANCELLED or task.finished_on is not None:
                raise StateError("task %d has already ended (%s)" % (task.id, task.last_status))
            live = Run.select(Run.id, Run.status).where(Run.active_task_id == task.id).first()
            if live is not None:
                cancelled = Run.update(status=CANCELLED, finished_on=now, updated_on=now,
                                       active_task_id=None).where(
                    (Run.id == live.id) & (Run.status == SCHEDULED)).execute()
                if not cancelled:
                    raise StateError("task %d is running (run %d); it cannot be cancelled"
                                     % (task.id, live.id))
            Task.update(last_status=CANCELLED, next_run_on=None, finished_on=now,
                        active_key=None, updated_on=now).where(Task.id == task.id).execute()
        self._write(step)

    # -- in-process work, for testing handlers ------------------------------------------

    def run_pending(self, max_runs=None):
        """Run due work in this process until none is left (or `max_runs`), and return how
        many runs were executed. For tests of handlers: no processes, no signals."""
        from .runner import Worker
        self.process_queue()
        worker = Worker(self, install_signals=False)
        return worker.work(burst=True, max_runs=max_runs)


__all__ = ["TaskQueue", "ClaimedRun", "retry_delay", "utcnow", "as_utc", "ConfigError",
           "HandlerError"]
