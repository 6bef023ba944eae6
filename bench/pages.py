"""Which pages each commit writes on SQLite, per table and index: the WAL is read frame by
frame (with checkpoints off), each frame's page number named by the `dbstat` table.

A durable SQLite queue pays per commit for the pages it writes to the WAL (each written and
synced before the commit returns), so this is the count that bounds add_task and a runner's
end-and-claim. Run ``python -m bench.pages [--adds N] [--jobs N] [--json FILE]``: it adds
tasks one by one (add_task commits), then drains them with a runner in this process
(end-and-claim commits), and prints the pages per commit of each kind by b-tree.
"""
import argparse
import os
import sqlite3
import struct
import sys
import tempfile
from collections import Counter

from bench.common import NOOP, write_json

WAL_HEADER = 32
FRAME_HEADER = 24


class Wal:
    """The commits appended to a database's WAL since the last `read`, each as its list of
    page numbers (a frame whose header carries the database size ends a commit). The WAL
    must not be checkpointed meanwhile."""

    def __init__(self, path):
        self.path = path + "-wal"
        self.offset = WAL_HEADER

    def read(self):
        with open(self.path, "rb") as wal:
            header = wal.read(WAL_HEADER)
            page_size = struct.unpack(">I", header[8:12])[0]
            salts = header[16:24]
            wal.seek(self.offset)
            commits, pages = [], []
            while True:
                frame = wal.read(FRAME_HEADER)
                if len(frame) < FRAME_HEADER or frame[8:16] != salts:
                    return commits
                wal.seek(page_size, os.SEEK_CUR)
                page, size = struct.unpack(">II", frame[:8])
                pages.append(page)
                if size:
                    commits.append(pages)
                    pages = []
                    self.offset = wal.tell()


def page_names(conn):
    """{page number: the table or index it belongs to} of the database behind `conn`."""
    return dict((page, name) for name, page in conn.execute("SELECT name, pageno FROM dbstat"))


def named(commits, names):
    """The b-tree of each page of `commits` ("(free)": a freelist page, page 1: the header's)."""
    return [[names.get(p, "(page 1)" if p == 1 else "(free)") for p in pages]
            for pages in commits]


def by_btree(commits):
    """Average pages per commit of each b-tree over `commits` (lists of b-tree names)."""
    counts = Counter(name for names in commits for name in names)
    return {name: round(count / len(commits), 2) for name, count in counts.most_common()}


def measure(adds=300, jobs=300, page_size=None):
    """Pages per add_task commit and per runner end-and-claim commit, by b-tree. Each
    commit's pages are named right after it (pages change hands as indexes grow and shrink).
    `page_size`: the database's (None: what a new taskrunner database gets)."""
    from taskrunner import TaskQueue
    from taskrunner.fleet import liveness
    from taskrunner.runs import lifecycle
    from taskrunner.store.models import SUCCESS
    path = os.path.join(tempfile.mkdtemp(prefix="trpages-"), "pages.db")
    if page_size is not None:
        with sqlite3.connect(path) as conn:
            conn.execute("PRAGMA page_size = %d" % page_size)
            conn.execute("PRAGMA journal_mode = wal")
        conn.close()
    queue = TaskQueue("sqlite:///" + path, migrate=True)
    store = queue.store
    store.db.pragma("wal_autocheckpoint", 0, permanent=True)
    conn = store.db.connection()
    # Past the first splits of every b-tree (the root's), as in a queue that has some work.
    queue.add_tasks([{"handler": NOOP}] * 2000)
    store.db.execute_sql("PRAGMA wal_checkpoint(TRUNCATE)")
    wal = Wal(path)
    add_commits = []
    for _ in range(adds):
        queue.add_task(NOOP)
        add_commits += named(wal.read(), page_names(conn))
    queue.add_tasks([{"handler": NOOP}] * max(0, jobs - adds - 2000))
    runner_id = liveness.register(store, take_slot=False).id     # a claim requires its row
    store.db.execute_sql("PRAGMA wal_checkpoint(TRUNCATE)")
    wal = Wal(path)
    claimed = lifecycle.claim(store, runner_id)
    wal.read()
    job_commits = []
    while claimed is not None:
        _, claimed_next = lifecycle.end_run_and_claim(
            store, claimed.run_id, claimed.task_id, SUCCESS, runner_id,
            periodic_task_id=claimed.periodic_task_id)
        job_commits += named(wal.read(), page_names(conn))
        claimed = claimed_next
    size = store.db.execute_sql("PRAGMA page_size").fetchone()[0]
    queue.close()
    return {"page_size": size, "adds": adds,
            "add_pages": round(sum(map(len, add_commits)) / len(add_commits), 2),
            "add_by_btree": by_btree(add_commits), "jobs": len(job_commits),
            "job_pages": round(sum(map(len, job_commits)) / len(job_commits), 2),
            "job_by_btree": by_btree(job_commits)}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--adds", type=int, default=300)
    parser.add_argument("--jobs", type=int, default=300)
    parser.add_argument("--page-size", type=int, action="append",
                        help="of the database (repeatable; default: a new database's)")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    results = [measure(args.adds, args.jobs, size) for size in args.page_size or [None]]
    for result in results:
        for kind in ("add", "job"):
            print("page size %d, %s: %s pages per commit" % (
                result["page_size"], kind, result[kind + "_pages"]))
            for name, pages in result[kind + "_by_btree"].items():
                print("  %-32s %5.2f" % (name, pages))
    write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
