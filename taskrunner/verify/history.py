"""The history of a verify session: one JSON object per line, appended by every process
that takes part (the verify process itself, each runner executing the workload) to a file of
its own in the session's directory, so no two processes write one file and a kill -9 loses at
most the line being written. Each event names its kind, the process (pid) and host, and its
time; the events read back from the database (a run's claim and end) carry the database's
times. The checker (`checker.py`) reads nothing else."""
import json
import os
import socket
from datetime import datetime, timezone

# An event's kinds: what was enqueued and the limits it runs under (written by verify), a
# handler's start, a step's body executing (a side effect outside the database) and its
# record committed, a handler's return, a fan-in's reading of its parents (written by the
# runners), each run as the database ended it, each application row counted, each task's
# final state (read back by verify); the periodic tasks defined (verify), each pass of a
# scheduler and the time it was made at (verify's schedulers), each task a periodic task
# submitted (read back by verify).
KINDS = ("enqueue", "limit", "start", "exec", "step", "done", "fanin", "end", "effect",
         "final", "periodic", "pass", "instance")


def record(directory, kind, **fields):
    """Append one event of `kind` to this process's file in `directory` (O_APPEND: one write
    per line, whole)."""
    event = dict(fields, kind=kind, pid=os.getpid(), host=socket.gethostname(),
                 at=datetime.now(timezone.utc).isoformat())
    line = (json.dumps(event, default=str) + "\n").encode()
    fd = os.open(os.path.join(directory, "history-%d.jsonl" % os.getpid()),
                 os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def read(directory):
    """Every event of the session, file by file; a last line cut short by a kill -9 is
    left out."""
    events = []
    for name in sorted(os.listdir(directory)):
        if not (name.startswith("history-") and name.endswith(".jsonl")):
            continue
        with open(os.path.join(directory, name)) as fh:
            for line in fh:
                try:
                    events.append(json.loads(line))
                except ValueError:
                    continue
    return events
