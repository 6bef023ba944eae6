"""``taskrunner versions``: per code version, the runners running it and the durable tasks
still open that started under it — whether an old version has drained after a deploy (docs:
"Changing durable code under running work"); and ``--code-version`` of the task filters."""
from .args import add_wide, open_queue, print_json, print_table
from .runs import when


def cmd_versions(args):
    from ..reads import versions
    found = [v.to_json() for v in versions.code_versions(open_queue(args).store)]
    if args.json:
        print_json(found)
        return
    print_versions(found, wide=args.wide)


def print_versions(found, wide=False):
    """The table of `taskrunner versions` (and of ``status``)."""
    if not found:
        print("no runner has recorded a code version yet")
        return
    print_table(["CODE VERSION", "RUNNERS", "OPEN TASKS", "FIRST STARTED", "LAST STARTED",
                 "DRAINED"],
                [[v["code_version"], v["runners"], v["open_tasks"], when(v["first_started_on"]),
                  when(v["last_started_on"]), "yes" if v["drained"] else "no"]
                 for v in found], wide=wide, zone=True)


def add_versions_command(command):
    """Add ``versions`` to the CLI's parser; `command(name, func, help)` makes a subparser."""
    p = command("versions", cmd_versions, "code versions: the runners running each and the "
                                          "durable tasks still open that started under it "
                                          "(drained: neither left)")
    add_wide(p)
    p.add_argument("--json", action="store_true", help="print JSON")
