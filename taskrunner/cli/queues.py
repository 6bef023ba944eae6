"""``taskrunner queue pause|resume|remove|list``, and the queues part of ``status``."""
from .args import add_wide, open_queue, print_json, print_table, queue_name


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
    p = command("queue", cmd_queue, "pause, resume, remove or list queues (on every host)")
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
    a = actions.add_parser("list", help="queues: paused, limit, waiting, running, lag")
    add_wide(a)
    a.add_argument("--json", action="store_true", help="print JSON")


def print_queues(queues, wide=False):
    """The queues table of ``status`` and ``queue list``."""
    if not queues:
        return
    headers = ["QUEUE", "STATE", "LIMIT", "SCHEDULED", "RUNNING", "RUNNERS", "LAG"]
    rows = [[q["name"], "paused" if q["paused"] else "active",
             q["limit"] if q["limit"] is not None else "-", q["scheduled"], q["running"],
             q["runners"], "paused %.0fs" % q["paused_for"] if q["paused"]
             else "%.1fs" % q["lag"] if q["lag"] is not None else "-"] for q in queues]
    print_table(headers, rows, wide=wide)
