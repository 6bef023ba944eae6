"""``taskrunner verify``: run the guarantees checker against this deployment's database
(taskrunner/verify/): one line per property with its counts and first counter-example; exit
0 when every property held, 1 on any violation, 2 when the deployment is refused up front."""
import shlex
import tempfile

from ..errors import InputError
from .args import positive_int, print_json, span_arg


def fault_list(text):
    from ..verify.faults import FAULTS
    kinds = tuple(part.strip() for part in text.split(",") if part.strip())
    unknown = [kind for kind in kinds if kind not in FAULTS]
    if unknown:
        import argparse
        raise argparse.ArgumentTypeError("unknown fault %r: choose from %s" % (
            unknown[0], ", ".join(FAULTS)))
    return kinds


def cmd_verify(args):
    from ..verify.session import Session
    if "restart-db" in args.faults and not args.restart_db_command:
        raise InputError("--faults restart-db needs --restart-db-command (the command that "
                         "restarts your database server)")
    command = shlex.split(args.restart_db_command) if args.restart_db_command else None
    with tempfile.TemporaryDirectory(prefix="taskrunner-verify-") as scratch:
        session = Session(args.loaded_config, args.history or scratch, duration=args.duration,
                          workers=args.workers, faults=args.faults, restart_db_command=command,
                          drain=args.drain)
        results, happened = session.run()
    ok = all(result.held for result in results)
    if args.json:
        print_json({"ok": ok, "happened": happened,
                    "properties": [result.to_json() for result in results]})
    else:
        print("verify: %d tasks, %d runners, %s in %gs" % (
            happened["tasks"], happened["runners"], ", ".join(
                "%d %s" % (happened[k], k) for k in args.faults) or "no faults",
            happened["seconds"]))
        for result in results:
            print(result.line())
        print("all properties held" if ok else "VIOLATED: see the FAIL lines above")
    return 0 if ok else 1


def add_verify_command(command):
    """Add ``verify`` to the CLI's parser; `command(name, func, help)` makes a subparser."""
    p = command("verify", cmd_verify, "check the guarantees against this database: a mixed "
                                      "workload on queues of its own, with faults; exit 1 on "
                                      "a violation")
    p.add_argument("--duration", type=span_arg, default=10.0, metavar="SPAN",
                   help="how long to enqueue work and inject faults (default 10 s)")
    p.add_argument("--workers", type=positive_int, default=4, metavar="N",
                   help="runner processes to start (default 4)")
    p.add_argument("--faults", type=fault_list, default=("kill", "stop"), metavar="A,B",
                   help="kill (kill -9 a runner), stop (SIGSTOP it past its run's timeout, then "
                        "SIGCONT), restart-db (with --restart-db-command); default kill,stop; "
                        "'' for none")
    p.add_argument("--drain", type=span_arg, metavar="SPAN",
                   help="after --duration, how long the tasks may take to end before those "
                        "left count as lost (default: 3 x --duration, at least 60 s)")
    p.add_argument("--restart-db-command", metavar="COMMAND",
                   help="run (no shell) to restart the database server for restart-db")
    p.add_argument("--history", metavar="DIR",
                   help="keep the history (JSON lines) in DIR (default: a temporary directory)")
    p.add_argument("--json", action="store_true", help="print JSON")
