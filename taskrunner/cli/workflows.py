"""``taskrunner workflow show|cancel ID``: a workflow's tasks, graph and state."""
from .args import open_queue, print_json, print_table, task_id_arg


def cmd_workflow(args):
    queue = open_queue(args)
    try:
        if args.action == "cancel":
            outcome = queue.cancel_workflow(args.id)
            if args.json:
                print_json(dict(outcome, workflow=args.id))
            else:
                print("workflow %d: %d task(s) cancelled, %d running one(s) asked to stop"
                      % (args.id, outcome["cancelled"], outcome["stopping"]))
            return
        info = queue.workflow(args.id)
        if args.json:
            print_json(info.to_json())
            return
        print("workflow %d%s: %s, %d of %d task(s) final (%.0f%%)" % (
            info.id, " (%s)" % info.name if info.name else "", info.outcome, info.finished,
            info.total, info.progress * 100))
        print("  " + ", ".join("%s %d" % item for item in sorted(info.counts.items())))
        print_table(["TASK", "STATE", "HANDLER", "AFTER"], [
            [t.id, t.state, t.handler, ",".join(map(str, t.after[:8])) +
             (",... (%d)" % len(t.after) if len(t.after) > 8 else "") or "-"]
            for t in info.tasks])
    finally:
        queue.close()


def add_workflow_command(command):
    """Add ``workflow`` to the CLI's parser; `command(name, func, help)` makes a subparser."""
    p = command("workflow", cmd_workflow, "a workflow's tasks, graph and state; cancel it")
    actions = p.add_subparsers(dest="action", metavar="ACTION", parser_class=type(p))
    actions.required = True
    for action, text in (("show", "its state, counts per state and each task with the "
                                  "tasks it runs after"),
                         ("cancel", "cancel every unfinished task of it (running ones "
                                    "cooperatively)")):
        a = actions.add_parser(action, help=text, description=text)
        a.add_argument("id", type=task_id_arg, metavar="ID")
        a.add_argument("--json", action="store_true", help="print JSON")
