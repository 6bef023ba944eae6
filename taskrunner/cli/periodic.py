"""``taskrunner periodic``: add, alter, list, enable, disable and remove periodic tasks — one
by name, or every one of an owner at once — run one now, and backfill the instances a period
missed."""
from .args import (add_max_attempts, add_wide, iso_time, json_arg, open_queue, print_json,
                   print_table, queue_name, shown)
from .runs import STATS_HEADERS, stats_cells, when
from ..errors import InputError

_past = {"enable": "enabled", "disable": "disabled", "remove": "removed"}


def cmd_periodic(args):
    from ..periodic import scheduler as periodic
    from ..reads import records as reads
    if args.action in _past and (args.all == (args.name is not None) or
                                 (args.all and not args.owner)):
        raise InputError("periodic %s: give a NAME, or --owner WHO --all" % args.action)
    if args.action == "add":
        options = {"priority": args.priority, "catch_up": args.catch_up,
                   "max_runtime": args.max_runtime, "min_spacing": args.min_spacing,
                   "max_retries": args.max_retries, "max_attempts": args.max_attempts,
                   "owner": args.owner,
                   "enabled": not args.disabled, "subject": args.subject, "group": args.group,
                   "timebox": args.timebox, "tolerance": args.tolerance, "queue": args.queue,
                   "anchor": args.anchor, "resume": bool(args.resume), "jitter": args.jitter}
        # As `add`: a refused definition opens no database (not even to create the schema).
        periodic.check_periodic(args.loaded_config, args.name, args.handler, args.timer,
                                data=args.data, **options)
    store = open_queue(args).store
    if args.action == "alter":
        changes = {key: getattr(args, key) for key in ALTER_OPTIONS
                   if getattr(args, key) is not None}
        row = reads.periodic_info(periodic.alter_periodic(store, args.name, owner=args.owner,
                                                          **changes))
        if args.json:
            print_json(shown(row.to_json(), args.loaded_config))
            return
        print("periodic task %r altered; next run %s" % (row.name, row.nextrun.isoformat()
                                                         if row.enabled and row.nextrun
                                                         else "never" if row.enabled
                                                         else "none (disabled)"))
        return
    if args.action == "backfill":
        print_backfill(args, periodic.backfill(store, args.name, args.start, args.end,
                                               owner=args.owner, max_instances=args.max))
        return
    if args.action == "run":
        task_id = periodic.run_now(store, args.name, owner=args.owner)
        if args.json:
            print_json({"name": args.name, "task_id": task_id})
        else:
            print("periodic task %r: task %d submitted" % (args.name, task_id))
        return
    if args.action == "add":
        row = reads.periodic_info(periodic.add_periodic(
            store, args.name, args.handler, args.timer, data=args.data, **options))
        if args.json:
            print_json(shown(row.to_json(), args.loaded_config))
            return
        print("periodic task %r added; next run %s"
              % (row.name, row.nextrun.isoformat() if row.nextrun else "never"))
    elif args.action == "list":
        rows = [shown(r.to_json(), args.loaded_config)
                for r in reads.list_periodic(store, args.owner, args.group)]
        if args.json:
            print_json(rows)
            return
        if args.wide:
            # The counts are lifetime ones; AVG and P95 are over the runs rotation has kept.
            print_table(["NAME", "ENABLED", "TIMER", "NEXT RUN", "LAST RUN", "LAST STATUS",
                         "FAILURES", "CRASHED", "DROPPED", "GROUP", "SUBJECT", "HANDLER"]
                        + STATS_HEADERS,
                        [[r["name"], "yes" if r["enabled"] else "no",
                          " ".join(filter(None, (r["timer"], r["timezone"], "jitter %gs"
                                                 % r["jitter"] if r["jitter"] else None))),
                          when(r["nextrun"]), when(r["last_run"]), r["last_status"],
                          r["consecutive_failures"], r["consecutive_crashes"], r["dropped"],
                          r["group"], r["subject"], r["handler"], r["run_count"],
                          r["success_count"], r["error_count"], r["crash_count"]]
                         + stats_cells(r["stats"])[4:] for r in rows],
                        wide=True, zone=True)
            return
        # What an operator scans for; --wide (or --json) has the rest.
        # RUNS, OK and ERRORS are lifetime counts; P95 is over the runs rotation has kept.
        print_table(["NAME", "TIMER", "NEXT RUN", "LAST RUN", "LAST", "FAILS", "CRASHED", "RUNS",
                     "OK", "ERRORS", "P95"],
                    [[r["name"], r["timer"], when(r["nextrun"]) if r["enabled"] else "disabled",
                      when(r["last_run"]), r["last_status"], r["consecutive_failures"],
                      r["consecutive_crashes"], r["run_count"], r["success_count"],
                      r["error_count"], stats_cells(r["stats"])[5]] for r in rows],
                    zone=True)
    elif args.all:
        count = periodic.remove_owned(store, args.owner) if args.action == "remove" else \
            periodic.set_enabled_owned(store, args.owner, args.action == "enable")
        if args.json:
            print_json({"owner": args.owner, "count": count, "done": _past[args.action]})
            return
        print("%d periodic task%s of owner %r %s" % (count, "" if count == 1 else "s",
                                                     args.owner, _past[args.action]))
    else:
        if args.action == "remove":
            periodic.remove_periodic(store, args.name, owner=args.owner)
        else:
            periodic.set_enabled(store, args.name, args.action == "enable", owner=args.owner)
        done = args.action.rstrip("e") + "ed"
        if args.json:
            print_json({"name": args.name, "done": done})
            return
        print("periodic task %r %s" % (args.name, done))


def add_periodic_parser(command, parser_class):
    """The ``periodic`` command and its actions, through the main parser's `command`."""
    p = command("periodic", cmd_periodic, "manage periodic tasks")
    actions = p.add_subparsers(dest="action", metavar="ACTION", parser_class=parser_class)
    actions.required = True
    a = actions.add_parser("add", help="add a periodic task")
    a.add_argument("name")
    a.add_argument("handler")
    a.add_argument("timer", help="calendar event (e.g. 'Mon..Fri 07:30'), 'every SPAN' (a "
                                 "fixed grid) or 'after SPAN' (SPAN after the last task ended)")
    a.add_argument("--data", type=json_arg, default=None)
    a.add_argument("--priority", type=int, default=0)
    a.add_argument("--catch-up", choices=("once", "skip"), default="once")
    a.add_argument("--max-runtime", metavar="SPAN", help="timebox of each submitted task")
    a.add_argument("--min-spacing", metavar="SPAN",
                   help="drop a task at start if the previous one started less than this ago")
    add_max_attempts(a)
    a.add_argument("--owner")
    a.add_argument("--disabled", action="store_true")
    a.add_argument("--subject", help="what it is for, in words")
    a.add_argument("--group", help="the group (tenant) it belongs to")
    a.add_argument("--timebox", choices=("half", "off"),
                   help="half: max_runtime of each task = interval / 2 (interval timers; the "
                        "default with --tolerance); off: none")
    a.add_argument("--tolerance", metavar="SPAN", help="drop a task at start if the previous "
                   "one started less than interval - SPAN ago ('every' timers)")
    a.add_argument("--anchor", choices=("due", "now"),
                   help="'every' timers: count the next due time from the last due time "
                        "(due, the default: a fixed grid) or from when the scheduler ran (now: "
                        "Nuntium)")
    a.add_argument("--queue", type=queue_name, metavar="NAME",
                   help="the queue of its tasks (default: the handler's, else 'default')")
    add_jitter(a)
    add_resume(a)
    a.add_argument("--json", action="store_true", help="print JSON")
    a = actions.add_parser("alter", help="change a periodic task in place (its counters stay)")
    a.add_argument("name")
    a.add_argument("--timer", help="a new timer: its schedule starts afresh from now, unless "
                                   "--next-start is given")
    a.add_argument("--next-start", type=iso_time, metavar="ISO8601",
                   help="its next due time (naive = local time)")
    a.add_argument("--data", type=json_arg)
    a.add_argument("--priority", type=int)
    add_max_attempts(a)
    a.add_argument("--max-runtime", metavar="SPAN",
                   help="timebox of each task submitted from now on (replaces a timebox)")
    a.add_argument("--queue", type=queue_name, metavar="NAME")
    a.add_argument("--enable", dest="enabled", action="store_const", const=True)
    a.add_argument("--disable", dest="enabled", action="store_const", const=False)
    add_jitter(a)
    add_resume(a)
    a.add_argument("--owner", help="refuse unless the periodic task has this owner")
    a.add_argument("--json", action="store_true", help="print the periodic task as JSON")
    a = actions.add_parser("list", help="list periodic tasks")
    a.add_argument("--owner", help="only the periodic tasks of this owner")
    a.add_argument("--group", help="only the periodic tasks of this group")
    add_wide(a)
    a.add_argument("--json", action="store_true", help="print JSON")
    a = actions.add_parser("run", help="submit a task of a periodic task now (its schedule "
                                       "stays); refused while one of its tasks is unfinished")
    a.add_argument("name")
    a.add_argument("--owner", help="refuse unless the periodic task has this owner")
    a.add_argument("--json", action="store_true", help='print {"name": ..., "task_id": N}')
    a = actions.add_parser("backfill", help="create the instances of its calendar times from "
                                            "--from to --to that have no task, once each")
    a.add_argument("name")
    a.add_argument("--from", dest="start", type=iso_time, metavar="ISO8601", required=True,
                   help="the first calendar time to look at (naive = local time)")
    a.add_argument("--to", dest="end", type=iso_time, metavar="ISO8601", required=True,
                   help="the last calendar time to look at (naive = local time)")
    a.add_argument("--max", type=int, default=MAX_BACKFILL, metavar="N",
                   help="refuse a range of more than N calendar times (default %(default)s)")
    a.add_argument("--owner", help="refuse unless the periodic task has this owner")
    a.add_argument("--json", action="store_true",
                   help="print the created, existing and upcoming instances as JSON")
    for action in ("enable", "disable", "remove"):
        a = actions.add_parser(action, help="%s a periodic task, or all of an owner's" % action)
        a.add_argument("name", nargs="?")
        a.add_argument("--owner", help="with NAME: refuse unless the task has this owner; "
                                       "with --all: whose periodic tasks")
        a.add_argument("--all", action="store_true",
                       help="every periodic task of --owner, in one transaction")
        a.add_argument("--json", action="store_true", help="print JSON")


# `periodic alter`'s options, by the name alter_periodic takes.
ALTER_OPTIONS = ("timer", "next_start", "data", "priority", "max_attempts", "max_retries",
                 "max_runtime", "queue", "enabled", "resume", "jitter")

# The scheduler's cap, without importing it (and the database layer) to build the parser.
MAX_BACKFILL = 1000


def print_backfill(args, outcome):
    """What a backfill created, found existing and left to the scheduler (upcoming)."""
    if args.json:
        print_json(dict({"name": args.name}, **{kind: [i.to_json() for i in instances]
                                                for kind, instances in outcome.items()}))
        return
    print("periodic task %r: %d created, %d existing, %d upcoming"
          % (args.name, len(outcome["created"]), len(outcome["existing"]),
             len(outcome["upcoming"])))
    rows = sorted((i.instance, kind, i.to_json()) for kind, instances in outcome.items()
                  for i in instances)
    if rows:
        print_table(["INSTANCE", "STATE", "SCHEDULED", "TASK"],
                    [[when(shown["instance"]), kind, when(shown["scheduled_on"]),
                      shown["task_id"] or "-"] for _, kind, shown in rows], zone=True)


def add_jitter(parser):
    parser.add_argument("--jitter", metavar="SPAN",
                        help="spread each instance's due time by a stable offset in [0, SPAN) "
                             "after its calendar time (0: none)")


def add_resume(parser):
    parser.add_argument("--resume", dest="resume", action="store_const", const=True,
                        help="start each task from the checkpoint of the previous one when "
                             "that one ended without success")
    parser.add_argument("--no-resume", dest="resume", action="store_const", const=False)
