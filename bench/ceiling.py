"""The ceiling of SQLite on this disk: the least any durable SQLite queue can do per job —
one transaction that takes one row off a one-table queue (``BEGIN IMMEDIATE``, ``DELETE …
RETURNING`` of the oldest row, ``COMMIT``), at the bench's synchronous, in W processes,
with no handler, no history and no Python beyond the loop.

No queue that commits once per job can go faster here. Huey's dequeue is exactly this shape
(select the next message, delete it, commit) plus its own Python; taskrunner commits once
per job too, but writes more per commit, since it keeps every run. So ceiling / Huey bounds
taskrunner / Huey from above.

``python -m bench.ceiling prepare PATH N`` fills a queue of N rows;
``python -m bench.ceiling work PATH SYNCHRONOUS OUT`` drains it and writes the finish time
of each job to OUT (one per line, at exit, so the timing itself costs nothing).
"""
import sqlite3
import sys
import time


def prepare(path, n):
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode=wal")
    conn.execute("CREATE TABLE jobs (id INTEGER PRIMARY KEY, data TEXT NOT NULL)")
    conn.execute("BEGIN")
    conn.executemany("INSERT INTO jobs (data) VALUES (?)", (("null",) for _ in range(n)))
    conn.execute("COMMIT")
    conn.close()


def work(path, synchronous, out):
    conn = sqlite3.connect(path, isolation_level=None, timeout=30)
    conn.execute("PRAGMA synchronous=%s" % synchronous)
    finishes = []
    while True:
        conn.execute("BEGIN IMMEDIATE")
        row = conn.execute("DELETE FROM jobs WHERE id = (SELECT min(id) FROM jobs) "
                           "RETURNING data").fetchone()
        conn.execute("COMMIT")
        if row is None:
            break
        finishes.append(time.time())
    conn.close()
    with open(out, "w") as fh:
        fh.write("".join("%.6f\n" % t for t in finishes))


if __name__ == "__main__":
    if sys.argv[1] == "prepare":
        prepare(sys.argv[2], int(sys.argv[3]))
    else:
        work(*sys.argv[2:5])
