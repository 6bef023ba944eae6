"""``taskrunner index add|list|drop``: the indexes of task data keys that the data search
(``tasks --data``, the dashboard's search) reads (store/data_index.py)."""

from .args import checked_arg, open_queue, print_json, print_table


def data_key(text):
    """A task data key that may be indexed, as written on the command line."""
    from ..store.data_index import check_key
    return checked_arg(check_key, text)


def cmd_index(args):
    from ..store import data_index
    queue = open_queue(args)
    try:
        if args.action == "list":
            keys = data_index.describe(queue.store)
            if args.json:
                print_json(keys)
            else:
                print_table(["KEY", "INDEX", "STATE"], [
                    [k["key"], k["index"], "ready" if k["ready"] else
                     "not ready (being built, or its build failed: add it again)"]
                    for k in keys])
            return
        if args.action == "add":
            changed = data_index.add(queue.store, args.key)
        else:
            changed = data_index.drop(queue.store, args.key)
        if args.json:
            print_json({"key": args.key, "indexed": args.action == "add", "changed": changed})
        elif args.action == "add":
            print("data key %r %s: `taskrunner tasks --data %s=VALUE` and the dashboard's "
                  "search read its index" % (args.key, "indexed" if changed
                                             else "was indexed already", args.key))
        else:
            print("data key %r %s" % (args.key, "no longer indexed" if changed
                                      else "was not indexed"))
    finally:
        queue.close()


def add_index_command(command):
    """Add ``index`` to the CLI's parser; `command(name, func, help)` makes a subparser."""
    p = command("index", cmd_index, "index a top-level key of the task data, so searching "
                                    "tasks by it (tasks --data, the dashboard) stays fast")
    actions = p.add_subparsers(dest="action", metavar="ACTION", parser_class=type(p))
    actions.required = True
    for action, text in (("add", "build the index of a data key without holding writers "
                                 "off (PostgreSQL: CONCURRENTLY; MariaDB: online)"),
                         ("drop", "drop the index of a data key")):
        a = actions.add_parser(action, help=text, description=text)
        a.add_argument("key", type=data_key, help="a top-level key of the task data")
        a.add_argument("--json", action="store_true", help="print JSON")
    a = actions.add_parser("list", help="the indexed data keys")
    a.add_argument("--json", action="store_true", help="print JSON")
