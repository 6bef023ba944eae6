"""What the ``taskrunner`` command prints about tasks and runs: compact local times, short
results and errors for tables, tracebacks under them, and ``taskrunner wait``.

``wait`` exit codes: 0 the task succeeded; 1 it gave up or was cancelled; 3 it was not final
within ``--timeout`` (2 stays the usage error of every command).
"""
import json
import os
import sys

from .args import shown

EXIT_SUCCESS, EXIT_NOT_SUCCESS, EXIT_TIMEOUT = 0, 1, 3
FAILED_STATUSES = ("retrying", "given-up", "cancelled")


def when(iso):
    """A table's time: local, to the second ("2026-11-22 23:14:36"); ``--json`` keeps ISO
    8601 UTC. Today's times drop the date."""
    if iso is None:
        return None
    from datetime import datetime
    local = datetime.fromisoformat(iso).astimezone()
    if local.date() == datetime.now().astimezone().date():
        return local.strftime("%H:%M:%S")
    return local.strftime("%Y-%m-%d %H:%M:%S")


def short(value, width=40):
    """One line of at most `width` characters: text as is, anything else as JSON."""
    if value is None:
        return None
    text = value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))
    text = " ".join(text.split())
    return text if len(text) <= width else text[:width - 3] + "..."


def outcome_column(task):
    """A task table's RESULT / ERROR cell: its last error while it is failing or gave up,
    what it waits for, why a scheduled task is not running, else its latest results."""
    if task["status"] in FAILED_STATUSES and task["last_error_code"]:
        return short("%s: %s" % (task["last_error_code"], task["last_error_message"]))
    if task["status"] == "waiting":
        return short(waiting_text(task))
    if task["status"] == "scheduled" and task.get("blocked_by"):
        return short(blocked_text(task), 60)
    return short(task["results"])


def blocked_text(task):
    """Why a task that has not ended is not running (its ``blocked_by``), in one line."""
    return "; ".join(b["text"] for b in task.get("blocked_by") or [])


def waiting_text(task):
    """What a waiting task waits for: its parents, an event (until its timeout), or the end
    of a sleep."""
    if task.get("waiting_parents"):
        from ..reads.records import parents_text
        return parents_text(task["waiting_parents"])
    if task["waiting_for"]:
        return "event %s%s" % (task["waiting_for"], " until %s" % when(task["waiting_until"])
                               if task["waiting_until"] else "")
    return "until %s" % when(task["waiting_until"])


def print_task(task):
    """`show ID` as text: one field a line, data and results as JSON, the last traceback
    under them."""
    from .args import zone_note
    for key, value in task.items():
        if key in ("last_traceback", "steps", "blocked_by", "reruns"):
            continue
        if key in ("data", "results", "checkpoint"):
            value = json.dumps(value)
        elif key.endswith("_on"):
            value = when(value)
        print("%-18s %s" % (key + ":", value))
    if task.get("blocked_by"):
        print("waiting because:")
        for blocker in task["blocked_by"]:
            print("  %s" % blocker["text"])
    print(zone_note())
    if task.get("steps"):
        print("steps:")
        print_steps(task["steps"])
    if task.get("reruns"):
        from .args import print_table
        print("re-runs:")
        print_table(["FROM STEP", "DROPPED", "RUN", "BY", "ON", "REASON"],
                    [[r["from_step"], r["steps_dropped"], r["run_id"], r["requested_by"],
                      when(r["requested_on"]), r["reason"]] for r in task["reruns"]])
    if task["last_traceback"]:
        print("last traceback:")
        print(task["last_traceback"].rstrip())


STEP_HEADERS = ["STEP", "KIND", "STATUS", "RUN", "ATTEMPT", "FINISHED", "DURATION", "RESULT"]


def step_rows(steps):
    return [[s["name"], s["kind"], s["status"], s["run_id"], s["attempt"], when(s["finished_on"]),
             "%.3fs" % s["duration"] if s["duration"] is not None else None, short(s["result"])]
            for s in steps]


def operator_name():
    """Who runs this command, for the records of what an operator asked: user@host."""
    import getpass
    import socket
    try:
        user = getpass.getuser()
    except (KeyError, OSError):       # no name for this uid (a container's numeric user)
        user = str(os.getuid())
    return "%s@%s" % (user, socket.gethostname())


def print_steps(steps):
    """The steps of a task (or of a run) as a table."""
    from .args import print_table
    print_table(STEP_HEADERS, step_rows(steps))


def print_tracebacks(runs):
    """Under a `runs ID` table: the traceback of each run that has one."""
    for run in runs:
        if run["traceback"]:
            print("\nrun %d (attempt %d) traceback:" % (run["id"], run["attempt"]))
            print(run["traceback"].rstrip())


STATS_HEADERS = ["RUNS", "OK", "ERRORS", "CRASHES", "AVG", "P95"]


def _duration(seconds):
    return None if seconds is None else "%.3fs" % seconds


def stats_cells(stats):
    return [stats["runs"], stats["successes"], stats["errors"], stats["crashes"],
            _duration(stats["avg_duration"]), _duration(stats["p95_duration"])]


def stats_table(key_header, stats_by_key):
    """(headers, rows) of run statistics, one row per handler or periodic task."""
    return ([key_header] + STATS_HEADERS + ["LAST SUCCESS"],
            [[key] + stats_cells(stats) + [when(stats["last_success"])]
             for key, stats in stats_by_key.items()])


def wait(queue, task_id, timeout, as_json, config):
    """``taskrunner wait``: block until the task is final; print its outcome (its secret
    keys masked: `shown`); exit code."""
    from ..errors import WaitTimeout
    try:
        outcome = queue.wait(task_id, timeout=timeout)
    except WaitTimeout as exc:
        if as_json:
            print(json.dumps({"task_id": task_id, "status": "timeout"}))
        print("taskrunner: %s" % exc, file=sys.stderr)
        return EXIT_TIMEOUT
    result = shown(outcome.to_json(), config)
    if as_json:
        print(json.dumps(result, indent=2))
    else:
        print("task %d %s" % (task_id, outcome.status))
        if result["results"] is not None:
            print("results: %s" % json.dumps(result["results"]))
        if outcome.error_code:
            print("error: %s: %s" % (outcome.error_code, outcome.error_message))
        if outcome.traceback:
            print(outcome.traceback.rstrip())
    return EXIT_SUCCESS if outcome.ok else EXIT_NOT_SUCCESS


# -- task filters and the bulk verbs -----------------------------------------------------

# records.TASK_STATUSES (a test keeps them equal), written out: --help loads no peewee.
STATUS_CHOICES = ("scheduled", "running", "waiting", "retrying", "given-up", "success",
                  "cancelled", "error", "timeout", "failed")


def non_negative_int(text):
    import argparse
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError("expected a whole number >= 0, got %r" % text)
    return value


def add_task_filters(parser, time_type):
    from .args import code_version_arg, queue_name
    """The filters shared by ``tasks``, ``retry`` and ``cancel``."""
    parser.add_argument("--status", choices=STATUS_CHOICES, metavar="WORD",
                        help="one of: %s (docs: Words)" % ", ".join(STATUS_CHOICES))
    parser.add_argument("--handler", metavar="PATH", help="tasks of this handler")
    parser.add_argument("--queue", type=queue_name, metavar="NAME", help="tasks of this queue")
    parser.add_argument("--error-code", metavar="CODE",
                        help="tasks whose last error has this code")
    parser.add_argument("--since", type=time_type, metavar="TIME",
                        help="queued at or after this ISO 8601 time")
    parser.add_argument("--until", type=time_type, metavar="TIME",
                        help="queued before this ISO 8601 time")
    parser.add_argument("--periodic", metavar="NAME", help="tasks of this periodic task")
    parser.add_argument("--code-version", type=code_version_arg, metavar="VERSION",
                        help="durable tasks that started under this code version "
                             "(`taskrunner versions`)")


def task_filters(args):
    return {name: getattr(args, name, None) for name in (
        "status", "handler", "since", "until", "periodic", "queue", "error_code", "data",
        "code_version") if getattr(args, name, None) is not None}


def bulk(queue, verb, args):
    """``retry`` / ``cancel`` / ``delete`` of the tasks named by id, matched by the filters,
    or both (the named ones that match). One id and no filter: the single-task verb (its
    refusal is the command's error, exit 2). Else every task, retries and deletes in
    batches, with a progress line on
    a terminal; prints how many were changed and why the others were not. Exit 0, or 1
    when a named id has no task (each one said on stderr). ``--json``: what was done, as
    one object."""
    from ..runs import control
    from ..reads import records as reads
    from ..errors import InputError, StateError, TaskNotFound
    filters = task_filters(args)
    if not args.ids and not filters:
        raise InputError("%s: give task ids, or filters (--status, --handler, --queue, "
                         "--error-code, --since, --until, --periodic, --code-version)" % verb)
    if len(args.ids) == 1 and not filters and verb != "delete":
        task_id = args.ids[0]
        action = control.retry if verb == "retry" else control.cancel
        stopping = action(queue.store, task_id)
        status = "re-armed" if verb == "retry" else "stopping" if stopping else "cancelled"
        if args.json:
            print(json.dumps({"task_id": task_id, "status": status, "run_id": stopping}))
        elif stopping:
            print("task %d: its run %d is asked to stop; the task ends cancelled when it does"
                  % (task_id, stopping))
        else:
            print("task %d %s" % (task_id, status))
        return EXIT_SUCCESS
    ids = list(dict.fromkeys(args.ids))
    existing = set(reads.existing_task_ids(queue.store, ids))
    missing = [i for i in ids if i not in existing]
    if len(args.ids) == 1 and not filters and missing:
        raise TaskNotFound("no task with id %d" % missing[0])
    if filters:        # with ids too: those of them that match
        matched = set(reads.task_ids(queue.store, **filters))
        ids = [i for i in ids if i in matched] if ids else sorted(matched)
    else:
        ids = [i for i in ids if i in existing]
    show = Progress(verb, len(ids))
    if verb == "retry":
        outcome = control.retry_many(queue.store, ids, progress=show)
    elif verb == "delete":
        from ..runs import rotation
        outcome = rotation.delete_finished(queue.store, ids, progress=show)
    else:
        outcome = {}
        for task_id in ids:
            try:
                control.cancel(queue.store, task_id)
                outcome[task_id] = None
            except (StateError, InputError) as exc:
                outcome[task_id] = exc
            if len(outcome) % BULK_PROGRESS == 0:
                show(len(outcome))
    show.end(len(outcome))
    if len(args.ids) == 1 and not filters and outcome.get(args.ids[0]) is not None:
        raise outcome[args.ids[0]]      # one task refused: nothing changed, as retry ID does
    changed = [i for i, exc in outcome.items() if exc is None]
    missing += [i for i, exc in outcome.items() if isinstance(exc, TaskNotFound)]
    refused = [str(exc) for exc in outcome.values()
               if exc is not None and not isinstance(exc, TaskNotFound)]
    if args.json:
        print(json.dumps({"changed": changed, "refused": refused, "missing": missing},
                         indent=2))
    else:
        done = BULK_DONE[verb]
        print("%s %d of %d task(s)" % (done, len(changed), len(ids) + len(missing)))
        for reason in refused:
            print("  not %s: %s" % (done.split()[0], reason))
    for task_id in missing:
        print("taskrunner: %s: no task with id %d" % (verb, task_id), file=sys.stderr)
    return EXIT_NOT_SUCCESS if missing else EXIT_SUCCESS


BULK_DONE = {"retry": "re-armed", "cancel": "cancelled (or asked to stop)", "delete": "deleted"}
BULK_PROGRESS = 200     # tasks between two progress lines of a bulk cancel (retry: a batch)


class Progress:
    """``\rretry: 400 of 3992`` on stderr while a bulk verb works, when stderr is a
    terminal (a log or a pipe gets the summary only)."""

    def __init__(self, verb, total):
        self.verb, self.total = verb, total
        self.shown = sys.stderr.isatty() and total > 0

    def __call__(self, done):
        if self.shown:
            sys.stderr.write("\r%s: %d of %d" % (self.verb, done, self.total))
            sys.stderr.flush()

    def end(self, done):
        if self.shown:
            self(done)
            sys.stderr.write("\n")
