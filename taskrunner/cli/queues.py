"""``taskrunner queue pause|resume|limit|remove|list``, ``taskrunner rate set|list|clear``
(flow control, runs/flow.py), and the queues and rate limits parts of ``status``."""
import argparse

from ..errors import InputError
from .args import add_wide, open_queue, print_json, print_table, queue_name


def queue_limit(text):
    """A queue's limit as written on the command line: a whole number >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError("a queue's limit must be a whole number >= 1, not %r"
                                         % text)
    return value


def cmd_queue(args):
    from ..reads import records as reads
    queue = open_queue(args)
    try:
        if args.action == "list":
            queues = [q.to_json() for q in reads.queue_stats(queue.store)]
            if args.json:
                print_json(queues)
            else:
                print_queues(queues, wide=args.wide)
            return
        if args.action == "limit":
            if (args.limit is None) != args.reset:
                raise InputError("queue limit: give a limit N or --reset, not %s"
                                 % ("both" if args.reset else "neither"))
            found = queue.set_queue_limit(args.name, args.limit)
            if args.json:
                print_json(found)
            elif args.reset:
                print("queue %r: limit %d runners per host, from the config ([queues.%s] "
                      "limit), on every host" % (args.name, found["limit"], args.name))
            else:
                print("queue %r: limit %d runners per host, stored: on every host from now on "
                      "(runs in flight finish)" % (args.name, found["limit"]))
            return
        if args.action == "remove":
            queue.remove_queue(args.name)
            if args.json:
                print_json({"queue": args.name, "removed": True})
            else:
                print("queue %r removed" % args.name)
            return
        if args.action == "pause":
            changed = queue.pause_queue(args.name, create=args.create)
        else:
            changed = queue.resume_queue(args.name)
        if args.json:   # paused: its state now; changed: false if it was so already
            print_json({"queue": args.name, "paused": args.action == "pause",
                        "changed": changed})
        elif args.action == "pause":
            print("queue %r %s" % (args.name, "paused: runners on every host stop claiming "
                                   "from it within one check interval" if changed
                                   else "was paused already"))
        else:
            print("queue %r %s" % (args.name, "resumed" if changed else "was not paused"))
    finally:
        queue.close()


def add_queue_command(command):
    """Add ``queue`` to the CLI's parser; `command(name, func, help)` makes a subparser."""
    p = command("queue", cmd_queue, "pause, resume, limit, remove or list queues (on every "
                                    "host)")
    actions = p.add_subparsers(dest="action", metavar="ACTION", parser_class=type(p))
    actions.required = True
    for action, text in (("pause", "stop claiming from a queue; runs in flight finish"),
                         ("resume", "claim from a paused queue again"),
                         ("remove", "forget a queue that no task is in (a typo, a queue no "
                                    "longer used)")):
        a = actions.add_parser(action, help=text, description=text)
        a.add_argument("name", type=queue_name)
        if action == "pause":
            a.add_argument("--create", action="store_true",
                           help="record the queue if no task used it yet (else refused)")
        a.add_argument("--json", action="store_true", help="print JSON")
    text = ("set a queue's limit of runners per host on every host, without a restart "
            "(stored; --reset: back to the config's [queues.NAME] limit)")
    a = actions.add_parser("limit", help=text, description=text)
    a.add_argument("name", type=queue_name)
    a.add_argument("limit", type=queue_limit, nargs="?", metavar="N",
                   help="runners serving the queue at once on one host (>= 1)")
    a.add_argument("--reset", action="store_true",
                   help="forget the stored limit: the config's applies again")
    a.add_argument("--json", action="store_true", help="print JSON")
    a = actions.add_parser("list", help="queues: paused, limit, tasks by status (as "
                                        "`tasks --status S --queue NAME` counts them), "
                                        "runs due, lag")
    add_wide(a)
    a.add_argument("--json", action="store_true", help="print JSON")


def print_queues(queues, wide=False):
    """The queues table of ``status`` and ``queue list``; the flow-control columns when a
    queue has a rate, fairness or aging, or runs held back by a key's rate."""
    if not queues:
        return
    headers = ["QUEUE", "STATE", "LIMIT", "SCHEDULED", "DUE", "RUNNING", "WAITING",
               "RETRYING", "RUNNERS", "LAG"]
    rows = [[q["name"], "paused" if q["paused"] else "active",
             "%d (%s)" % (q["limit"], q["limit_source"]) if q["limit"] is not None else "-",
             q["scheduled"], q["due"],
             q["running"], q["tasks"]["waiting"], q["tasks"]["retrying"], q["runners"],
             "paused %.0fs" % q["paused_for"] if q["paused"]
             else "%.1fs" % q["lag"] if q["lag"] is not None else "-"] for q in queues]
    if any(q["rate"] or q["fair_by"] or q["aging"] or q["throttled"] for q in queues):
        headers += ["RATE", "ALLOWANCE", "THROTTLED", "TENANTS WAITING", "AGING"]
        for row, q in zip(rows, queues):
            row += [q["rate"] or "-",
                    "%.1f" % q["allowance"] if q["allowance"] is not None else "-",
                    q["throttled"],
                    q["tenants_waiting"] if q["tenants_waiting"] is not None else "-",
                    "%gs" % q["aging"] if q["aging"] else "-"]
    print_table(headers, rows, wide=wide)


def print_rates(buckets, wide=False):
    """The rate limits table of ``status`` and ``rate list``: every bucket."""
    print_table(["KIND", "NAME", "LIMIT", "BURST", "ALLOWANCE", "THROTTLED"], [
        [b["kind"], b["name"], b["limit"], "%g" % b["burst"], "%.1f" % b["allowance"],
         b["throttled"]] for b in buckets], wide=wide)


def cmd_rate(args):
    queue = open_queue(args)
    try:
        if args.action == "set":
            keys = queue.set_rate_limit(args.key, args.rate, args.burst)
            if args.json:
                print_json({"key": args.key, "rate": args.rate, "keys": keys})
            else:
                print("rate limit of %r: %s (on every host; %d live key(s) now: %s)" % (
                    args.key, args.rate, len(keys), ", ".join(keys) or "none"))
        elif args.action == "clear":
            queue.clear_rate_limit(args.key)
            if args.json:
                print_json({"key": args.key, "cleared": True})
            else:
                print("rate limit of %r cleared" % args.key)
        else:
            found = queue.rate_limits()
            if args.json:
                print_json(found)
                return
            if found["limits"]:
                print_table(["KEY", "LIMIT", "BURST", "SOURCE"], [
                    [r["pattern"], r["limit"], "%g" % r["burst"], r["source"]]
                    for r in found["limits"]], wide=args.wide)
            if found["buckets"]:
                if found["limits"]:
                    print()
                print_rates(found["buckets"], wide=args.wide)
            if not found["limits"] and not found["buckets"]:
                print("no rate limits")
    finally:
        queue.close()


def _burst(text):
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if value != 0 and value < 1:
        raise argparse.ArgumentTypeError("--burst must be 0 or a number >= 1, not %r" % text)
    return value


def add_rate_command(command):
    """Add ``rate`` to the CLI's parser."""
    p = command("rate", cmd_rate, "set, list or clear rate limits of keys (on every host)")
    actions = p.add_subparsers(dest="action", metavar="ACTION", parser_class=type(p))
    actions.required = True
    a = actions.add_parser("set", help="limit the runs of tasks added with --rate-key KEY "
                                       "(or PREFIX*) to RATE, on all hosts together",
                           description="limit the runs of tasks added with --rate-key KEY "
                                       "(or any key starting with PREFIX, for PREFIX*) to RATE "
                                       "on all hosts together, from now on")
    a.add_argument("key", metavar="KEY")
    a.add_argument("rate", metavar="RATE", help="25/s, 1500/min or 90/h")
    a.add_argument("--burst", type=_burst, default=0.0, metavar="N",
                   help="the bucket's size (default: a tenth of a second of RATE, at least 1)")
    a.add_argument("--json", action="store_true", help="print JSON")
    a = actions.add_parser("clear", help="remove the limit `rate set` gave KEY")
    a.add_argument("key", metavar="KEY")
    a.add_argument("--json", action="store_true", help="print JSON")
    a = actions.add_parser("list", help="the limits of keys, and every bucket: limit, "
                                        "allowance now, runs throttled")
    add_wide(a)
    a.add_argument("--json", action="store_true", help="print JSON")
