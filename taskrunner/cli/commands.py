"""The ``taskrunner`` command. Exit codes: 0 ok, 1 runtime failure, 2 usage, config or input
error (one line on stderr, no traceback, nothing changed), 141 the reader of stdout went away.

Commands that need no database (``--help``, ``calendar``) import no database code: peewee
loads every driver it finds, which costs more than the rest of the CLI. Commands that do
open the database bring its schema up to date first, under the migration lock."""
import argparse
import logging
import os
import stat
import sys
from datetime import datetime, timedelta, timezone

from . import runs as cli_runs
from .args import (add_max_attempts, add_wide, iso_time, json_arg, masked_url, one_line,
                   open_queue, positive_int, task_id_list, print_json, print_password_hash,
                   print_table, queue_list, queue_name, shown, span_arg, task_id_arg, zone_note)
from .calendar import MAX_ITERATIONS, cmd_calendar, iterations
from .periodic import add_periodic_parser
from .runs import when
from ..config import Config
from ..errors import InputError
from .indexes import add_index_command
from .queues import add_queue_command, add_rate_command, print_queues, print_rates
from .verify import add_verify_command
from .versions import add_versions_command, print_versions
from .workflows import add_workflow_command
from ..handler import encode_data, load_handler
from ..logs import setup_logging
from ..masking import redactor, text_masker
from ..runner import stops

log = logging.getLogger("taskrunner.cli")

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2
EXIT_BROKEN_PIPE = 141   # 128 + SIGPIPE, what a shell reports for a process SIGPIPE killed
QUEUE_HELP = ("the queues this runner serves, comma-separated (default: 'default', which "
              "also serves every queue without a [queues.NAME] table)")
WAIT_FOR_SLOT_HELP = ("at the host's or a queue's limit, wait for a free slot instead of "
                      "exiting (supervisord numprocs above the limit: no respawn loop)")
EVENTS = ("task-queue:OnProcess", "task-runner:OnProcess", "task-queue:OnRotate",
          "periodic-task:OnProcess")


RUN_EVENT_OPTIONS = ("--json", "--queue", "--hash-password", "--wait-for-slot",
                     "--password-file", "-h", "--help", "--")
PASSWORD_ENV = "TASKRUNNER_RUN_EVENT_PASSWORD"


class _Parser(argparse.ArgumentParser):
    # Arguments of run-event that may be its password, wherever argparse took them (an
    # extra argument, an option's explicit value: "-hPASSWORD" quotes "PASSWORD"). With any,
    # an error quotes none of run-event's arguments.
    hidden = ()

    def error(self, message):
        # One line starting "taskrunner: ", like every other error; exit 2. The usage block
        # is for --help. A subcommand's parser names the command: "taskrunner: error: add: ...".
        command = self.prog.partition(" ")[2]
        if self.hidden:
            command, message = "run-event", (
                "expected UNIT:EVENT (%s), then the password if [run_event] password_hash is "
                "set (one starting with '-' after '--'); the arguments are not shown: one may "
                "be the password" % " | ".join(EVENTS))
        self.exit(EXIT_USAGE, "taskrunner: error: %s%s\n"
                  % (command + ": " if command else "", one_line(message)))


def _possible_passwords(argv):
    """The arguments after ``run-event`` that are neither an event nor one of its options.
    A mistyped event is among them: `run-event PASSWORD` (the event left out) puts the
    password where the event goes."""
    if "run-event" not in argv:
        return ()
    after = argv[argv.index("run-event") + 1:]
    return tuple(arg for arg in after if arg not in EVENTS and arg not in RUN_EVENT_OPTIONS)


# -- commands ---------------------------------------------------------------------------

def cmd_init_db(args):
    queue = open_queue(args)
    if args.json:
        print_json({"database": masked_url(queue), "schema": "up to date"})
        return
    print("schema of %s is up to date" % masked_url(queue))


def cmd_add(args):
    # Refuse a bad handler or data before opening the database: a refused add creates
    # nothing, not even the schema, and prints nothing but its one error line.
    config = args.loaded_config
    load_handler(args.handler, config.handlers.allow)
    encode_data(args.data, config.task.max_data_size)
    if args.delay is not None:
        # The delay counts from the database's clock (enqueue.task_row), not this host's;
        # one too large for any clock is refused here, with the option's name.
        try:
            datetime.now(timezone.utc) + timedelta(seconds=args.delay)
        except OverflowError:
            raise InputError("--in %gs is too far in the future" % args.delay) from None
    if args.after is not None:
        from ..runs.enqueue import add_task
        if args.unique_key is not None or args.debounce is not None:
            raise InputError("--after cannot be combined with --%s" % (
                "unique-key" if args.unique_key is not None else "debounce"))
        task_id = add_task(
            open_queue(args).store, args.handler, data=args.data, scheduled_on=args.at,
            delay=args.delay, max_retries=args.max_retries, max_attempts=args.max_attempts,
            priority=args.priority,
            run_timeout=args.timeout, queued_by=args.queued_by, max_runtime=args.max_runtime,
            queue=args.queue, concurrency_key=args.concurrency_key,
            concurrency_limit=args.concurrency_limit, rate_key=args.rate_key,
            tenant=args.tenant, after=args.after, on_parent_failure=args.on_parent_failure)
        if args.json:
            print_json({"id": task_id, "existed": False})
        else:
            print(task_id)
        return
    if args.on_parent_failure is not None:
        raise InputError("--on-parent-failure needs --after")
    from ..runs.enqueue import add_task_created
    task_id, created = add_task_created(
        open_queue(args).store, args.handler, data=args.data, scheduled_on=args.at,
        delay=args.delay,
        max_retries=args.max_retries, max_attempts=args.max_attempts, priority=args.priority,
        run_timeout=args.timeout, unique_key=args.unique_key, queued_by=args.queued_by, max_runtime=args.max_runtime,
        queue=args.queue, concurrency_key=args.concurrency_key,
        concurrency_limit=args.concurrency_limit, rate_key=args.rate_key, tenant=args.tenant,
        debounce=args.debounce, debounce_key=args.debounce_key, debounce_max=args.debounce_max,
        debounce_keep=args.debounce_keep)
    # existed: a live task held --unique-key, or the open window of --debounce-key took the
    # add; no task was added
    if args.json:
        print_json({"id": task_id, "existed": not created})
        return
    print(task_id)


def cmd_runner(args):
    from ..runner.loop import run_runner
    if args.reload and args.burst:
        raise InputError("runner: --reload and --burst exclude each other")
    queue = open_queue(args)
    report = {}
    code = run_runner(queue.store, burst=args.burst, max_runs=args.max_runs,
                      serving=args.queue, facade=lambda store: queue, held_stops=args.held_stops,
                      wait_for_slot=args.wait_for_slot, report=report, reload=args.reload)
    if report.get("code_changed"):
        from ..runner.reload import restart
        queue.close()
        restart()
    return code


def cmd_overseer(args):
    from ..overseer.overseer import run_overseer
    return run_overseer(args.loaded_config, args.config, args.database)


def read_password_file(path):
    """The first line of `path`, which must be a regular file of this user that nobody else
    may read or write: a password file others can read is no better than `ps`. The checks
    are made on the open file, so a file swapped after them is not the one read."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError as exc:
        raise InputError("run-event --password-file %s: %s" % (path, exc.strerror)) from None
    with os.fdopen(fd, encoding="utf-8", errors="strict") as f:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise InputError("run-event --password-file %s: not a regular file" % path)
        if info.st_uid != os.geteuid():
            raise InputError("run-event --password-file %s: owned by uid %d, not by this user "
                             "(uid %d)" % (path, info.st_uid, os.geteuid()))
        if info.st_mode & 0o077:
            raise InputError("run-event --password-file %s: mode %04o lets others read or "
                             "write it; chmod 600 it" % (path, stat.S_IMODE(info.st_mode)))
        try:
            password = f.readline().rstrip("\r\n")
        except (UnicodeDecodeError, OSError):
            raise InputError("run-event --password-file %s: not readable UTF-8 text"
                             % path) from None
    if not password:
        raise InputError("run-event --password-file %s: its first line is empty" % path)
    return password


def run_event_password(args):
    """The password from exactly one of: the trailing argument (In-Portal's form; `ps` shows
    it to every local user for the process's whole life), --password-file, or the
    TASKRUNNER_RUN_EVENT_PASSWORD environment variable (readable by this user and root
    only). None when none is given."""
    given = [source for source, present in (
        ("the PASSWORD argument", args.password is not None),
        ("--password-file", args.password_file is not None),
        (PASSWORD_ENV, PASSWORD_ENV in os.environ)) if present]
    if len(given) > 1:
        raise InputError("run-event: give the password one way, not by %s" % " and ".join(given))
    # Taken out of the environment: a handler's subprocesses inherit it otherwise.
    from_env = os.environ.pop(PASSWORD_ENV, None)
    if args.password_file is not None:
        return read_password_file(args.password_file)
    return args.password if args.password is not None else from_env


def check_run_event_password(config, password):
    """In-Portal's ``run_event.php EVENT password_here``: with ``[run_event] password_hash``
    set, the password must be given and match (compared in constant time); without one, a
    password given is refused rather than ignored. No message quotes it."""
    from ..passwords import check_hash
    stored = config.run_event.password_hash
    if not stored:
        if password is not None:
            raise InputError("run-event: a password was given, but no run-event password is "
                             "set: put the output of `taskrunner run-event --hash-password` "
                             "in [run_event] password_hash of %s, or leave the password out"
                             % config.source)
        return
    if password is None:
        raise InputError("run-event: a password is required ([run_event] password_hash is set "
                         "in %s): give it with --password-file or $%s (or after the event, "
                         "where ps shows it)" % (config.source, PASSWORD_ENV))
    if not check_hash(password, stored):
        raise InputError("run-event: wrong password")


def cmd_run_event(args):
    """One event; with --json, what it did as one object (ids and counts)."""
    if args.hash_password:
        if args.event is not None or args.password is not None \
                or args.password_file is not None:
            raise InputError("run-event --hash-password reads the password from standard "
                             "input and takes no UNIT:EVENT")
        print_password_hash()
        return EXIT_OK
    if args.event is None:
        raise InputError("run-event: UNIT:EVENT is required: %s" % " | ".join(EVENTS))
    # Before the database is opened: a refused event changes nothing.
    check_run_event_password(args.loaded_config, run_event_password(args))
    queue = open_queue(args)
    code = EXIT_OK
    if args.event == "task-queue:OnProcess":
        result = queue.process_queue()
        log.info("queue processed: %d dead runners, %d runs timed out, %d runs created",
                 len(result["dead_runners"]), len(result["timed_out_runs"]), result["created_runs"])
        result["timed_out_runs"] = [{"run_id": run_id, "runner_id": runner_id}
                                    for run_id, runner_id in result["timed_out_runs"]]
    elif args.event == "task-queue:OnRotate":
        result = {"deleted": queue.rotate()}
    elif args.event == "periodic-task:OnProcess":
        from ..periodic import scheduler as periodic
        periodic.sync_definitions(queue.store)
        scheduler = periodic.PeriodicScheduler(queue.store)
        scheduler.clear_stale_marks()
        result = scheduler.run_pending()
        log.info("periodic tasks: %d submitted, %d skipped", len(result["submitted"]),
                 len(result["skipped"]))
    else:
        from ..runner.loop import run_runner
        result = {}
        code = run_runner(queue.store, refuse_quietly=True, serving=args.queue, report=result,
                          facade=lambda store: queue, held_stops=args.held_stops,
                          wait_for_slot=args.wait_for_slot)
    if args.json:
        print_json(dict(event=args.event, **result))
    return code


def cmd_status(args):
    from ..fleet import leadership
    from ..reads import records as reads, summaries, versions
    queue = open_queue(args)
    leases = leadership.leases(queue.store)
    rows = [r.to_json() for r in reads.running_runners(queue.store)]
    counts = summaries.status_counts(queue.store)     # the words of the dashboard and metrics
    figures = reads.health(queue.store)
    handlers = {name: stats.to_json() for name, stats in
                sorted(reads.run_stats(queue.store, by="handler").items())}
    queues = [q.to_json() for q in reads.queue_stats(queue.store)]
    rates = reads.rate_limits(queue.store)["buckets"]
    code_versions = [v.to_json() for v in versions.code_versions(queue.store)
                     if not v.drained]
    if args.json:
        print_json({"database": masked_url(queue), "runners": rows, "tasks": counts,
                    "retrying": figures["tasks_retrying"], "given_up": figures["tasks_given_up"],
                    "handlers": handlers, "queues": queues, "leases": leases,
                    "rate_limits": rates, "code_versions": code_versions})
        return
    print("database: %s" % masked_url(queue))
    for lease in leases:
        print("%s lease: %s" % (lease["name"], "held by %s %d on %s until %s (since %s)" % (
            lease["holder_kind"], lease["holder_id"], lease["host"], when(lease["expires_on"]),
            when(lease["taken_on"])) if lease["held"] else "not held"))
    print("tasks: " + (", ".join("%s %d" % kv for kv in counts.items() if kv[1]) or "none"))
    print("failed tasks: %d retrying, %d given up" % (figures["tasks_retrying"],
                                                     figures["tasks_given_up"]))
    if handlers:
        print()
        print_table(*cli_runs.stats_table("HANDLER", handlers), wide=args.wide)
        print()
    print_queues(queues, wide=args.wide)
    if rates:
        print()
        print_rates(rates, wide=args.wide)
    if len(code_versions) > 1:          # a deploy not drained yet: which runs are still old
        print()
        print_versions(code_versions, wide=args.wide)
    if not rows:
        print("no runners running")
        return
    print_table(["ID", "KIND", "HOST", "PID", "STATE", "RUN", "PROGRESS", "RSS MB", "RUNS",
                  "STARTED", "HEARTBEAT", "CODE VERSION"],
                 [[r["id"], r["kind"], r["host"], r["pid"], r["state"],
                   run_column(r),
                   "%d%%" % r["progress"] if r["progress"] is not None else "-", r["rss_mb"],
                   r["runs_done"], when(r["started_on"]), when(r["heartbeat_on"]),
                   r["code_version"] or "-"] for r in rows],
                wide=args.wide, zone=True)
    for r in rows:
        if r["stopping_reason"] is not None:
            print("runner %d stopping since %s: %s" % (r["id"], when(r["stopping_since"]),
                                                       r["stopping_reason"]))


def run_column(runner):
    """The run a runner executes; with a batch, how many more it holds (claimed, or ended
    and not written yet: see docs/explanation/guarantees.md, "Batched acknowledgements")."""
    if not runner["run_id"]:
        return "-"
    more = runner.get("claimed", 1) - 1
    return "%s (task %s)%s" % (runner["run_id"], runner["task_id"],
                               " +%d claimed" % more if more > 0 else "")


def cmd_tasks(args):
    queue = open_queue(args)
    filters = cli_runs.task_filters(args)
    from ..reads import data_search, records as reads
    if args.data is not None:
        filters["data"] = data_search.parse(queue.store, args.data)
        if not data_search.indexed(queue.store, filters["data"][0]):
            print("taskrunner: %s" % data_search.unindexed_note(filters["data"][0]),
                  file=sys.stderr)
    tasks = [shown(t.to_json(), args.loaded_config) for t in reads.list_tasks(
        queue.store, limit=None if args.all else args.limit, offset=args.offset, **filters)]
    if args.json:
        print_json(tasks)
        return
    print_table(["ID", "HANDLER", "STATUS", "RUNS", "FAILED", "CRASHED", "SCHEDULED",
                  "NEXT RUN", "FINISHED", "RESULT / ERROR"],
                 [[t["id"], t["handler"], t["status"],
                   t["runs"], t["runs_failed"], t["runs_crashed"], when(t["scheduled_on"]),
                   when(t["next_run_on"]),
                   when(t["finished_on"]),
                   cli_runs.outcome_column(t)] for t in tasks], wide=args.wide)
    total = reads.count_tasks(queue.store, **filters)
    print("showing %d of %d tasks%s; %s" % (len(tasks), total, " (--offset, --limit or --all "
                                             "for the others)" if len(tasks) < total else "",
                                             zone_note()))


def cmd_show(args):
    from ..reads import records as reads
    task = shown(reads.get_task(open_queue(args).store, args.id, with_steps=True).to_json(),
                 args.loaded_config)
    if args.json:
        print_json(task)
        return
    cli_runs.print_task(task)


def cmd_runs(args):
    runs = [shown(r.to_json(), args.loaded_config) for r in open_queue(args).runs_of(args.id)]
    if args.json:
        print_json(runs)
        return
    print_table(["RUN", "ATTEMPT", "STATUS", "RUNNER", "%", "STARTED", "DURATION", "RESULTS",
                  "ERROR"],
                 [[r["id"], r["attempt"], "stopping" if r["stopping_reason"] else r["status"],
                   r["runner_id"],
                   r["percent_completed"],
                   when(r["started_on"]),
                   "%.3fs" % r["duration"] if r["duration"] is not None else None,
                   cli_runs.short(r["results"]),
                   "%s: %s" % (r["error_code"], r["error_message"]) if r["error_code"] else None]
                  for r in runs], wide=args.wide, zone=True)
    for r in runs:
        if r["stopping_reason"]:
            print("run %d stopping since %s: %s" % (r["id"], when(r["stopping_since"]),
                                                    r["stopping_reason"]))
    for r in runs:
        if r["steps"]:
            print("\nrun %d (attempt %d) steps:" % (r["id"], r["attempt"]))
            cli_runs.print_steps(r["steps"])
    cli_runs.print_tracebacks(runs)


def cmd_wait(args):
    return cli_runs.wait(open_queue(args), args.id, args.timeout, args.json,
                         args.loaded_config)


def cmd_send_event(args):
    woken = open_queue(args).send_event(args.id, args.name, args.data)
    if args.json:
        print_json({"task_id": args.id, "event": args.name, "woken": woken})
    elif woken:
        print("task %d woken by event %s" % (args.id, args.name))
    else:
        print("event %s stored: task %d is not waiting for it yet (its wait_for takes it)"
              % (args.name, args.id))


def cmd_retry(args):
    return cli_runs.bulk(open_queue(args), "retry", args)


def cmd_rerun(args):
    by = args.by if args.by is not None else cli_runs.operator_name()
    run_id = open_queue(args).rerun_from(args.id, args.from_step, reason=args.reason,
                                         requested_by=by)
    if args.json:
        print_json({"task_id": args.id, "from_step": args.from_step, "run_id": run_id,
                    "requested_by": by, "reason": args.reason})
    else:
        print("task %d runs again from step %s (run %d)" % (args.id, args.from_step, run_id))


def cmd_cancel(args):
    return cli_runs.bulk(open_queue(args), "cancel", args)


def cmd_delete(args):
    return cli_runs.bulk(open_queue(args), "delete", args)


def cmd_rotate(args):
    result = open_queue(args).rotate()
    if args.json:
        print_json(result)
        return
    print("deleted %(success)d successful tasks, %(failed)d failed tasks, %(runners)d runner rows"
          % result)


def cmd_check(args):
    from ..periodic import scheduler as periodic
    from ..reads import records as reads
    # Everything the overseer would refuse, before the database is even opened.
    periodic.validate_definitions(args.loaded_config)
    queue = open_queue(args)
    figures = reads.health(queue.store)
    if args.json:
        print_json({"ok": True, "database": masked_url(queue), "backend": queue.store.backend,
                    "config": queue.config.source, "warnings": queue.config.warnings,
                    **{key: figures[key] for key in (
                        "runners_running", "runs_waiting", "tasks_retrying")}})
        return
    print("ok: %s (%s), config %s; %d runners running, %d runs waiting, %d tasks retrying"
          % (masked_url(queue), queue.store.backend, queue.config.source,
             figures["runners_running"], figures["runs_waiting"], figures["tasks_retrying"]))
    for warning in queue.config.warnings:
        print("warning: %s" % warning)


def cmd_dashboard(args):
    from ..web import require_prometheus_client
    if args.hash_password:
        print_password_hash()
        return EXIT_OK
    require_prometheus_client()
    from ..web.app import serve
    from ..web.auth import Guard, parse_bind
    config = args.loaded_config.dashboard
    # Refuse a bad or unauthenticated bind before touching the database.
    Guard(config).check_bind(parse_bind(args.bind or config.bind)[0])
    return serve(open_queue(args).store, config, bind=args.bind,
                 read_only=True if args.read_only else None)


def cmd_metrics(args):
    from ..web import require_prometheus_client
    require_prometheus_client()
    from ..web.metrics import exposition
    sys.stdout.write(exposition(open_queue(args).store).decode())


# -- parser -----------------------------------------------------------------------------

def build_parser(hidden=()):
    """The parser; its errors never quote an argument of `hidden` (_possible_passwords)."""
    parser_class = type("_Parser", (_Parser,), {"hidden": tuple(hidden)})
    parser = parser_class(prog="taskrunner", description="A durable, database-backed task queue.")
    parser.add_argument("--config", metavar="FILE",
                        help="TOML config file (default: $TASKRUNNER_CONFIG)")
    parser.add_argument("--database", metavar="URL",
                        help="database URL (default: $TASKRUNNER_DATABASE_URL, [database] url, "
                             "sqlite:///taskrunner.db)")
    from taskrunner import __version__   # the package itself (layer 5, like cli)
    parser.add_argument("--version", action="version", version="taskrunner " + __version__)
    parser.add_argument("--log-level", choices=("debug", "info", "warning", "error"),
                        help="log level on stderr (default: [log] level)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=parser_class)
    sub.required = True

    def command(name, func, help_text):
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(func=func)
        return p

    command("init-db", cmd_init_db, "create or upgrade the schema").add_argument(
        "--json", action="store_true", help="print JSON")
    p = command("add", cmd_add, "queue a task; prints its id")
    p.add_argument("handler", help="dotted path of a TaskHandler subclass")
    p.add_argument("--data", type=json_arg, default=None, help="task data as JSON")
    when = p.add_mutually_exclusive_group()
    when.add_argument("--at", type=iso_time, help="run at this ISO 8601 time (naive = local time)")
    when.add_argument("--in", dest="delay", type=span_arg, metavar="SPAN",
                      help="run after this span (seconds, or like '5min')")
    p.add_argument("--priority", type=int, default=0, help="higher runs first (default 0)")
    add_max_attempts(p)
    p.add_argument("--timeout", type=span_arg, metavar="SPAN",
                   help="run_timeout: a run with no update for this long is timed out")
    p.add_argument("--max-runtime", type=span_arg, metavar="SPAN",
                   help="hard limit on one run's duration")
    p.add_argument("--unique-key", metavar="KEY",
                   help="if a live task holds KEY, add nothing and print its id")
    p.add_argument("--queued-by", metavar="WHO", help="who queued the task")
    p.add_argument("--queue", type=queue_name, metavar="NAME",
                   help="the task's queue (default: the handler's, else 'default')")
    p.add_argument("--concurrency-key", metavar="KEY",
                   help="at most --concurrency-limit runs of tasks with KEY at once, all hosts")
    p.add_argument("--concurrency-limit", type=positive_int, metavar="N", help="default 1")
    p.add_argument("--rate-key", metavar="KEY",
                   help="its runs spend KEY's rate limit (`taskrunner rate set`), all hosts")
    p.add_argument("--tenant", metavar="NAME",
                   help="whose task it is: a queue with fair_by = \"tenant\" round-robins "
                        "between tenants")
    p.add_argument("--after", type=task_id_list, metavar="ID,...",
                   help="run after these tasks succeeded (it waits without a run until then)")
    p.add_argument("--on-parent-failure", choices=("cancel", "run"),
                   help="when a task it runs after is given up or cancelled: cancel this one "
                        "too (default) or run it anyway")
    p.add_argument("--debounce", type=span_arg, metavar="SPAN",
                   help="enqueues of --debounce-key within SPAN of each other are one task, "
                        "run SPAN after the last; prints its id")
    p.add_argument("--debounce-key", metavar="KEY",
                   help="the key that --debounce collapses (default: the handler)")
    p.add_argument("--debounce-max", type=span_arg, metavar="SPAN",
                   help="run at most SPAN after the first enqueue of the window")
    p.add_argument("--debounce-keep", choices=("last", "first"),
                   help="the data the task runs with: the last enqueue's (default) or the "
                        "first's")
    p.add_argument("--json", action="store_true",
                   help='print {"id": N, "existed": false|true (a --unique-key hit, or an '
                        'open --debounce window)}')
    command("overseer", cmd_overseer, "the supervised parent of the runners, foreground")
    p = command("runner", cmd_runner, "one runner, foreground")
    p.add_argument("--burst", action="store_true", help="exit when no run is left")
    p.add_argument("--max-runs", type=int, help="exit after this many runs")
    p.add_argument("--queue", type=queue_list, default=("default",), metavar="A,B",
                   help=QUEUE_HELP)
    p.add_argument("--wait-for-slot", action="store_true", help=WAIT_FOR_SLOT_HELP)
    p.add_argument("--reload", action="store_true",
                   help="development: when a file of the code it imported changes, finish "
                        "the current run and start again with the new code")
    p = command("run-event", cmd_run_event, "one event, for cron or supervisord")
    p.add_argument("event", nargs="?", choices=EVENTS, metavar="UNIT:EVENT",
                   help=" | ".join(EVENTS))
    p.add_argument("password", nargs="?", metavar="PASSWORD",
                   help="required when [run_event] password_hash is set, refused otherwise "
                        "(In-Portal's run_event.php EVENT password_here); visible to every "
                        "local user in ps: prefer --password-file or $" + PASSWORD_ENV)
    p.add_argument("--password-file", metavar="FILE",
                   help="read the password from the first line of FILE (owned by this user, "
                        "mode 600 or stricter)")
    p.add_argument("--hash-password", action="store_true",
                   help="print the hash of the password read from stdin for [run_event] "
                        "password_hash, and exit")
    p.add_argument("--queue", type=queue_list, default=("default",), metavar="A,B",
                   help="task-runner:OnProcess: " + QUEUE_HELP)
    p.add_argument("--wait-for-slot", action="store_true",
                   help="task-runner:OnProcess: " + WAIT_FOR_SLOT_HELP)
    p.add_argument("--json", action="store_true", help="print what the event did")
    p = command("status", cmd_status, "runners and task counts")
    add_wide(p)
    p.add_argument("--json", action="store_true", help="print JSON")
    p = command("tasks", cmd_tasks, "list tasks, most recent first")
    cli_runs.add_task_filters(p, iso_time)
    p.add_argument("--data", metavar="KEY=VALUE",
                   help="tasks whose data has this top-level key with this value (a string "
                        "or a number as written); read off the key's index if it has one "
                        "(`taskrunner index add KEY`), else in the most recent tasks only")
    p.add_argument("--limit", type=positive_int, default=100)
    p.add_argument("--offset", type=cli_runs.non_negative_int, default=0,
                   help="skip this many of the most recent")
    p.add_argument("--all", action="store_true", help="every matching task (no --limit)")
    add_wide(p)
    p.add_argument("--json", action="store_true", help="print JSON")
    for name, func, text in (("show", cmd_show, "one task"), ("runs", cmd_runs, "a task's runs")):
        p = command(name, func, text)
        p.add_argument("id", type=task_id_arg)
        if name == "runs":
            add_wide(p)
        p.add_argument("--json", action="store_true", help="print JSON")
    p = command("wait", cmd_wait, "wait until a task is final and print its outcome; exit 0 "
                                  "success, 1 given up or cancelled, 3 timeout")
    p.add_argument("id", type=task_id_arg)
    p.add_argument("--timeout", type=span_arg, metavar="SPAN", help="give up after this long")
    p.add_argument("--json", action="store_true", help="print JSON")
    p = command("send-event", cmd_send_event, "send an event to a task: wakes it if it waits "
                                              "for it (run.wait_for), else kept for its wait")
    p.add_argument("id", type=task_id_arg)
    p.add_argument("name", help="the event's name")
    p.add_argument("--data", type=json_arg, default=None, help="its payload, as JSON")
    p.add_argument("--json", action="store_true", help="print JSON")
    p = command("rerun", cmd_rerun, "run a durable task that succeeded or gave up again from "
                                    "one of its steps (the steps before it keep their "
                                    "results)")
    p.add_argument("id", type=task_id_arg)
    p.add_argument("--from-step", required=True, metavar="NAME",
                   help="the step to run again, with every step recorded after it "
                        "(`taskrunner show ID` lists them)")
    p.add_argument("--reason", help="why, kept with the re-run")
    p.add_argument("--by", help="who asks (default: your user name @ this host)")
    p.add_argument("--json", action="store_true", help="print JSON")
    for name, func, text in (("retry", cmd_retry, "re-arm failed or given-up tasks"),
                             ("cancel", cmd_cancel, "cancel tasks (a running one stops "
                                                    "cooperatively)"),
                             ("delete", cmd_delete, "delete ended tasks (success, given up, "
                                                    "cancelled) with their runs")):
        p = command(name, func, text + ", by id and/or filter")
        p.add_argument("ids", type=task_id_arg, nargs="*", metavar="ID")
        cli_runs.add_task_filters(p, iso_time)
        p.add_argument("--json", action="store_true", help="print JSON")
    command("rotate", cmd_rotate, "delete old ended tasks and runner rows").add_argument(
        "--json", action="store_true", help="print JSON")
    command("check", cmd_check, "check the config and the database").add_argument(
        "--json", action="store_true", help="print JSON")
    add_queue_command(command)
    add_index_command(command)
    add_rate_command(command)
    add_workflow_command(command)
    add_verify_command(command)
    add_versions_command(command)

    add_periodic_parser(command, parser_class)

    p = command("dashboard", cmd_dashboard, "serve the web dashboard and /metrics "
                                            "(pip install 'taskrunner-db[web]')")
    p.add_argument("--bind", metavar="HOST:PORT",
                   help="listen here (default: [dashboard] bind, 127.0.0.1:8411)")
    p.add_argument("--read-only", action="store_true", help="serve the pages without actions")
    p.add_argument("--hash-password", action="store_true",
                   help="print the hash of the password read from stdin for [dashboard] "
                        "password_hash, and exit")
    command("metrics", cmd_metrics, "print the Prometheus metrics (for a textfile collector)")

    p = command("calendar", cmd_calendar, "next elapses of a timer: a calendar event, like "
                                          "systemd-analyze calendar, or 'every SPAN'")
    p.add_argument("expression")
    p.add_argument("--base", type=iso_time, help="ISO 8601 base time (default: now)")
    p.add_argument("-n", "--iterations", type=iterations, default=1,
                   help="how many elapses, 0 to %d (default 1)" % MAX_ITERATIONS)
    p.add_argument("--json", action="store_true", help="print JSON")
    return parser


def _redactor(config):
    """Masks the database URL's secrets in log lines (tracebacks included), whatever quoted
    them: a driver's message, a handler's exception; and the values of task data's secret
    keys (``[task] secret_keys``) that a line quotes, such as the debug log's statements."""
    redact_url, mask = redactor(config.database.url), text_masker(config.task.secret_keys)
    if mask is None:
        return redact_url
    return lambda text: mask(redact_url(text))


def _not_utf8(argv):
    """The position of the first argument that is not UTF-8 text (Python decodes invalid
    bytes to lone surrogates), or None. Its text is not shown: it may be a password."""
    for position, arg in enumerate(argv, 1):
        try:
            arg.encode("utf-8")
        except UnicodeEncodeError:
            return position
    return None


def starts_a_runner(args):
    return args.func is cmd_runner or (args.func is cmd_run_event
                                       and args.event == "task-runner:OnProcess")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    position = _not_utf8(argv)
    if position is not None:
        print("taskrunner: error: argument %d is not valid UTF-8 text" % position, file=sys.stderr)
        return EXIT_USAGE
    args = build_parser(hidden=_possible_passwords(argv)).parse_args(argv)
    # A runner holds its stop signals before it reads its config or opens the database: a
    # supervisor's HUP or TERM while it starts is a graceful stop, not death (stops.py).
    args.held_stops = stops.hold() if starts_a_runner(args) else ()
    try:
        args.loaded_config = Config.load(args.config, args.database)
        setup_logging(args.log_level or args.loaded_config.log.level,
                      args.loaded_config.log.format, _redactor(args.loaded_config))
        code = args.func(args) or EXIT_OK
        sys.stdout.flush()          # here, so that a closed pipe is handled below
        return code
    except InputError as exc:
        print("taskrunner: error: %s" % one_line(exc), file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader went away (`taskrunner tasks | head`): stop quietly, as a process killed
        # by SIGPIPE would, and flush nothing more to the closed pipe at exit.
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError, AttributeError):  # stdout is not a file (in-process)
            pass
        return EXIT_BROKEN_PIPE
    except Exception as exc:
        peewee = sys.modules.get("peewee")   # loaded only by commands that use a database
        if peewee is None or not isinstance(exc, peewee.DatabaseError):
            raise
        from ..store.db import describe_error
        print("taskrunner: database error: %s"
              % one_line(describe_error(exc, args.loaded_config.database.url)), file=sys.stderr)
        return EXIT_FAILURE


if __name__ == "__main__":
    sys.exit(main())
