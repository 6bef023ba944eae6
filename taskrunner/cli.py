"""The ``taskrunner`` command. Exit codes: 0 ok, 1 runtime failure, 2 usage, config or input
error (one line on stderr, no traceback, nothing changed).

Commands that need no database (``--help``, ``calendar``) import no database code: peewee
loads every driver it finds, which costs more than the rest of the CLI. Commands that do
open the database bring its schema up to date first, under the migration lock."""
import argparse
import json
import logging
import math
import sys
from datetime import datetime, timedelta, timezone

from .config import Config
from .errors import InputError
from .cli_queues import add_queue_command, print_queues
from .handler import encode_data, load_handler

log = logging.getLogger("taskrunner.cli")

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2
QUEUE_HELP = ("the queues this runner serves, comma-separated (default: 'default', which "
              "also serves every queue without a [queues.NAME] table)")
EVENTS = ("task-queue:OnProcess", "task-runner:OnProcess", "task-queue:OnRotate",
          "periodic-task:OnProcess")


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        # One line starting "taskrunner: ", like every other error; exit 2. The usage block
        # is for --help. A subcommand's parser names the command: "taskrunner: error: add: ...".
        command = self.prog.partition(" ")[2]
        self.exit(EXIT_USAGE, "taskrunner: error: %s%s\n"
                  % (command + ": " if command else "", message))


def _at(text):
    try:
        # "Z" is not understood by fromisoformat before Python 3.11.
        when = datetime.fromisoformat(text[:-1] + "+00:00" if text.endswith("Z") else text)
        if when.tzinfo is None:
            when = when.astimezone()  # naive means local time
        return when.astimezone(timezone.utc)
    except (ValueError, OverflowError):
        raise argparse.ArgumentTypeError("invalid ISO 8601 time %r" % text) from None


def _json(text):
    try:
        return json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError("invalid JSON: %s" % exc) from None


def _seconds(text):
    try:
        value = float(text)
    except ValueError:
        value = -1
    if not (0 < value < math.inf):  # also refuses nan
        raise argparse.ArgumentTypeError("expected a positive number of seconds, got %r" % text)
    return value


def _task_id(text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError("invalid int value: %r" % text) from None
    if not 0 < value < 2 ** 63:  # what an id column holds on every database
        raise argparse.ArgumentTypeError("no task can have id %r" % text)
    return value


def _positive_int(text):
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError("expected a positive integer, got %r" % text)
    return value


def _queue_name(text):
    from .config import check_queue_name
    try:
        return check_queue_name(text)
    except InputError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _queue_list(text):
    from .config import parse_queue_list
    try:
        return parse_queue_list(text)
    except InputError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _print_table(headers, rows):
    rows = [["" if v is None else str(v) for v in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]
    for row in [headers] + rows:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip())


def _queue(args):
    from .queue import TaskQueue
    return TaskQueue(args.loaded_config, migrate=True)


def _masked_url(queue):
    from .db import mask_url
    return mask_url(queue.config.database.url)


def _print_json(value):
    print(json.dumps(value, indent=2))


# -- commands ---------------------------------------------------------------------------

def cmd_init_db(args):
    queue = _queue(args)
    print("schema of %s is up to date" % _masked_url(queue))


def cmd_add(args):
    # Refuse a bad handler or data before opening the database: a refused add creates
    # nothing, not even the schema, and prints nothing but its one error line.
    config = args.loaded_config
    load_handler(args.handler, config.handlers.allow)
    encode_data(args.data, config.task.max_data_size)
    scheduled_on = args.at
    if args.delay is not None:
        try:
            scheduled_on = datetime.now(timezone.utc) + timedelta(seconds=args.delay)
        except OverflowError:
            raise InputError("--in %g seconds is too far in the future" % args.delay) from None
    queue = _queue(args)
    print(queue.add_task(args.handler, data=args.data, scheduled_on=scheduled_on,
                         max_retries=args.max_retries, priority=args.priority,
                         run_timeout=args.timeout, unique_key=args.unique_key,
                         queued_by=args.queued_by, max_runtime=args.max_runtime,
                         queue=args.queue, concurrency_key=args.concurrency_key,
                         concurrency_limit=args.concurrency_limit))


def cmd_runner(args):
    from .runner import run_runner
    return run_runner(_queue(args).store, burst=args.burst, max_runs=args.max_runs,
                      serving=args.queue)


def cmd_overseer(args):
    from .overseer import run_overseer
    return run_overseer(args.loaded_config, args.config, args.database)


def cmd_run_event(args):
    queue = _queue(args)
    if args.event == "task-queue:OnProcess":
        result = queue.process_queue()
        log.info("queue processed: %d dead runners, %d runs timed out, %d runs created",
                 len(result["dead_runners"]), len(result["timed_out_runs"]), result["created_runs"])
    elif args.event == "task-queue:OnRotate":
        queue.rotate()
    elif args.event == "periodic-task:OnProcess":
        from . import periodic
        periodic.sync_definitions(queue.store)
        scheduler = periodic.PeriodicScheduler(queue.store)
        scheduler.clear_stale_marks()
        result = scheduler.run_pending()
        log.info("periodic tasks: %d submitted, %d skipped", len(result["submitted"]),
                 len(result["skipped"]))
    else:
        from .runner import run_runner
        return run_runner(queue.store, refuse_quietly=True, serving=args.queue)
    return EXIT_OK


def cmd_status(args):
    from . import reads
    queue = _queue(args)
    rows = [r.to_json() for r in reads.running_runners(queue.store)]
    counts = reads.task_counts(queue.store)
    queues = [q.to_json() for q in reads.queue_stats(queue.store)]
    if args.json:
        _print_json({"database": _masked_url(queue), "runners": rows, "tasks": counts,
                     "queues": queues})
        return
    print("database: %s" % _masked_url(queue))
    print("tasks: " + (", ".join("%s %d" % kv for kv in sorted(counts.items())) or "none"))
    print_queues(queues)
    if not rows:
        print("no runners running")
        return
    _print_table(["ID", "KIND", "HOST", "PID", "STATE", "RUN", "PROGRESS", "RSS MB", "RUNS",
                  "STARTED", "HEARTBEAT"],
                 [[r["id"], r["kind"], r["host"], r["pid"], r["state"],
                   "%s (task %s)" % (r["run_id"], r["task_id"]) if r["run_id"] else "-",
                   "%d%%" % r["progress"] if r["progress"] is not None else "-", r["rss_mb"],
                   r["runs_done"], r["started_on"], r["heartbeat_on"]] for r in rows])


def cmd_tasks(args):
    queue = _queue(args)
    tasks = [t.to_json() for t in queue.tasks(status=args.status, limit=args.limit)]
    if args.json:
        _print_json(tasks)
        return
    _print_table(["ID", "HANDLER", "STATUS", "RUNS", "FAILED", "SCHEDULED", "FINISHED", "ERROR"],
                 [[t["id"], t["handler"], "given-up" if t["given_up"] else t["status"], t["runs"],
                   t["runs_failed"], t["scheduled_on"], t["finished_on"], t["last_error_code"]]
                  for t in tasks])


def cmd_show(args):
    task = _queue(args).get_task(args.id).to_json()
    if args.json:
        _print_json(task)
        return
    for key, value in task.items():
        print("%-18s %s" % (key + ":", json.dumps(value) if key == "data" else value))


def cmd_runs(args):
    runs = [r.to_json() for r in _queue(args).runs_of(args.id)]
    if args.json:
        _print_json(runs)
        return
    _print_table(["RUN", "ATTEMPT", "STATUS", "RUNNER", "%", "STARTED", "DURATION", "ERROR"],
                 [[r["id"], r["attempt"], r["status"], r["runner_id"], r["percent_completed"],
                   r["started_on"], "%.3fs" % r["duration"] if r["duration"] is not None else None,
                   "%s: %s" % (r["error_code"], r["error_message"]) if r["error_code"] else None]
                  for r in runs])


def cmd_retry(args):
    _queue(args).retry(args.id)
    print("task %d re-armed" % args.id)


def cmd_cancel(args):
    _queue(args).cancel(args.id)
    print("task %d cancelled" % args.id)


def cmd_rotate(args):
    result = _queue(args).rotate()
    print("deleted %(success)d successful tasks, %(failed)d failed tasks, %(runners)d runner rows"
          % result)


def cmd_check(args):
    from . import reads
    queue = _queue(args)
    figures = reads.health(queue.store)
    print("ok: %s (%s), config %s; %d runners running, %d runs waiting, %d tasks retrying"
          % (_masked_url(queue), queue.store.backend, queue.config.source,
             figures["runners_running"], figures["runs_waiting"], figures["tasks_retrying"]))


def cmd_periodic(args):
    from . import periodic, reads
    store = _queue(args).store
    if args.action == "add":
        options = {"priority": args.priority, "catch_up": args.catch_up,
                   "max_runtime": args.max_runtime, "min_spacing": args.min_spacing,
                   "max_retries": args.max_retries, "owner": args.owner,
                   "enabled": not args.disabled, "queue": args.queue}
        row = reads.periodic_info(periodic.add_periodic(
            store, args.name, args.handler, args.timer, data=args.data, **options))
        print("periodic task %r added; next run %s"
              % (row.name, row.nextrun.isoformat() if row.nextrun else "never"))
    elif args.action == "list":
        rows = [r.to_json() for r in reads.list_periodic(store, args.owner)]
        if args.json:
            _print_json(rows)
            return
        _print_table(["NAME", "ENABLED", "TIMER", "NEXT RUN", "LAST RUN", "LAST STATUS",
                      "FAILURES", "HANDLER"],
                     [[r["name"], "yes" if r["enabled"] else "no", r["timer"], r["nextrun"],
                       r["last_run"], r["last_status"], r["consecutive_failures"], r["handler"]]
                      for r in rows])
    elif args.action in ("enable", "disable"):
        periodic.set_enabled(store, args.name, args.action == "enable", owner=args.owner)
        print("periodic task %r %sd" % (args.name, args.action))
    else:
        periodic.remove_periodic(store, args.name, owner=args.owner)
        print("periodic task %r removed" % args.name)


def cmd_calendar(args):
    from .calendar import CalendarError, parse_calendar, render_analyze, render_json
    try:
        event = parse_calendar(args.expression)
    except CalendarError as exc:
        raise InputError(str(exc)) from None
    base = args.base or datetime.now(timezone.utc)
    if args.json:
        print(json.dumps(render_json(event, base, args.iterations)))
    else:
        print(render_analyze(event, base, args.iterations))


# -- parser -----------------------------------------------------------------------------

def build_parser():
    parser = _Parser(prog="taskrunner", description="A durable, database-backed task queue.")
    parser.add_argument("--config", metavar="FILE",
                        help="TOML config file (default: $TASKRUNNER_CONFIG)")
    parser.add_argument("--database", metavar="URL",
                        help="database URL (default: $TASKRUNNER_DATABASE_URL, [database] url, "
                             "sqlite:///taskrunner.db)")
    parser.add_argument("--log-level", choices=("debug", "info", "warning", "error"),
                        help="log level on stderr (default: [log] level)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    def command(name, func, help_text):
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(func=func)
        return p

    command("init-db", cmd_init_db, "create or upgrade the schema")
    p = command("add", cmd_add, "queue a task; prints its id")
    p.add_argument("handler", help="dotted path of a TaskHandler subclass")
    p.add_argument("--data", type=_json, default=None, help="task data as JSON")
    when = p.add_mutually_exclusive_group()
    when.add_argument("--at", type=_at, help="run at this ISO 8601 time (naive = local time)")
    when.add_argument("--in", dest="delay", type=_seconds, metavar="SECONDS",
                      help="run in this many seconds")
    p.add_argument("--priority", type=int, default=0, help="higher runs first (default 0)")
    p.add_argument("--max-retries", type=int, help="failed runs before giving up")
    p.add_argument("--timeout", type=_seconds, metavar="SECONDS",
                   help="run_timeout: a run with no update for this long is timed out")
    p.add_argument("--max-runtime", type=_seconds, metavar="SECONDS",
                   help="hard limit on one run's duration")
    p.add_argument("--unique-key", metavar="KEY",
                   help="if a live task holds KEY, add nothing and print its id")
    p.add_argument("--queued-by", metavar="WHO", help="who queued the task")
    p.add_argument("--queue", type=_queue_name, metavar="NAME",
                   help="the task's queue (default: the handler's, else 'default')")
    p.add_argument("--concurrency-key", metavar="KEY",
                   help="at most --concurrency-limit runs of tasks with KEY at once, all hosts")
    p.add_argument("--concurrency-limit", type=_positive_int, metavar="N", help="default 1")
    command("overseer", cmd_overseer, "the supervised parent of the runners, foreground")
    p = command("runner", cmd_runner, "one runner, foreground")
    p.add_argument("--burst", action="store_true", help="exit when no run is left")
    p.add_argument("--max-runs", type=int, help="exit after this many runs")
    p.add_argument("--queue", type=_queue_list, default=("default",), metavar="A,B",
                   help=QUEUE_HELP)
    p = command("run-event", cmd_run_event, "one event, for cron or supervisord")
    p.add_argument("event", choices=EVENTS, metavar="UNIT:EVENT", help=" | ".join(EVENTS))
    p.add_argument("--queue", type=_queue_list, default=("default",), metavar="A,B",
                   help="task-runner:OnProcess: " + QUEUE_HELP)
    p = command("status", cmd_status, "runners and task counts")
    p.add_argument("--json", action="store_true")
    p = command("tasks", cmd_tasks, "list tasks, most recent first")
    p.add_argument("--status", choices=("scheduled", "running", "success", "error", "timeout",
                                        "cancelled", "given-up"))
    p.add_argument("--limit", type=_positive_int, default=100)
    p.add_argument("--json", action="store_true")
    for name, func, text in (("show", cmd_show, "one task"), ("runs", cmd_runs, "a task's runs")):
        p = command(name, func, text)
        p.add_argument("id", type=_task_id)
        p.add_argument("--json", action="store_true")
    for name, func, text in (("retry", cmd_retry, "re-arm a failed or given-up task"),
                             ("cancel", cmd_cancel, "cancel a task that is not running")):
        command(name, func, text).add_argument("id", type=_task_id)
    command("rotate", cmd_rotate, "delete old ended tasks and runner rows")
    command("check", cmd_check, "check the config and the database")
    add_queue_command(command)

    p = command("periodic", cmd_periodic, "manage periodic tasks")
    actions = p.add_subparsers(dest="action", metavar="ACTION", parser_class=_Parser)
    actions.required = True
    a = actions.add_parser("add", help="add a periodic task")
    a.add_argument("name")
    a.add_argument("handler")
    a.add_argument("timer", help="calendar event (e.g. 'Mon..Fri 07:30') or 'every SPAN'")
    a.add_argument("--data", type=_json, default=None)
    a.add_argument("--priority", type=int, default=0)
    a.add_argument("--catch-up", choices=("once", "skip"), default="once")
    a.add_argument("--max-runtime", metavar="SPAN", help="timebox of each submitted task")
    a.add_argument("--min-spacing", metavar="SPAN",
                   help="drop a task at start if the previous one started less than this ago")
    a.add_argument("--max-retries", type=int)
    a.add_argument("--owner")
    a.add_argument("--disabled", action="store_true")
    a.add_argument("--queue", type=_queue_name, metavar="NAME",
                   help="the queue of its tasks (default: the handler's, else 'default')")
    a = actions.add_parser("list", help="list periodic tasks")
    a.add_argument("--owner")
    a.add_argument("--json", action="store_true")
    for action in ("enable", "disable", "remove"):
        a = actions.add_parser(action, help="%s a periodic task" % action)
        a.add_argument("name")
        a.add_argument("--owner", help="refuse unless the task has this owner")

    p = command("calendar", cmd_calendar, "next elapses of a calendar event, like "
                                          "systemd-analyze calendar")
    p.add_argument("expression")
    p.add_argument("--base", type=_at, help="ISO 8601 base time (default: now)")
    p.add_argument("-n", "--iterations", type=int, default=1)
    p.add_argument("--json", action="store_true")
    return parser


def setup_logging(level):
    # The format names no source file, function or thread: skip collecting them (the
    # logging HOWTO's "Optimization"), which a runner would otherwise do for every run.
    logging._srcfile = None
    logging.logThreads = logging.logMultiprocessing = False
    logging.basicConfig(level=getattr(logging, level.upper()), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s")


def main(argv=None):
    args = build_parser().parse_args(argv)
    try:
        args.loaded_config = Config.load(args.config, args.database)
        setup_logging(args.log_level or args.loaded_config.log.level)
        return args.func(args) or EXIT_OK
    except InputError as exc:
        print("taskrunner: error: %s" % exc, file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        peewee = sys.modules.get("peewee")   # loaded only by commands that use a database
        if peewee is None or not isinstance(exc, peewee.DatabaseError):
            raise
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print("taskrunner: database error: %s" % first, file=sys.stderr)
        return EXIT_FAILURE


if __name__ == "__main__":
    sys.exit(main())
