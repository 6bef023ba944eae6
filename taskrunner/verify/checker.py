"""The checker of a verify history: a pure function of the events (`history.py`), one
result per property of DESIGN.md's rules, each with its counts and the first counter-example
found. It reads nothing but the history, so the same definition of "held" serves
`taskrunner verify` on a user's deployment and our own chaos tests.

The properties:
- one-success: no task has two runs ended ``success`` (rules 1, 4).
- one-live-run: no two runs of a task were live at once — claimed and not yet ended, by the
  database's times (rules 1, 4).
- claimed-once: no run was started by a runner after a runner had returned from it, nor by
  two processes at once (rule 2).
- steps-once: no step's body executed after its record committed, and each step's
  application row, written in the step's transaction, exists exactly once (rule 10).
- fan-in: every fan-in was released once (one first attempt), started only after each of its
  parents had returned, and read every parent's result (rule 10).
- concurrency-key: never more runs of a key live at once than its limit (rule 5).
- rate-window: in no window did a rate-limited queue start more runs than its burst plus its
  rate over the window (flow control).
- nothing-lost: every task enqueued ended ``success`` (rule 6).
- periodic-once: each due time of a periodic task yielded at most one task, and none was
  missed: a due time without a task is one rule 9 skips — its previous task's end had not
  committed when a pass at or after that due time read it, or a late pass handled an
  earlier due time after it (catch-up once) (rule 9).
"""
import bisect
from collections import defaultdict
from datetime import datetime, timedelta
from typing import Any, Dict, List, NamedTuple, Optional

PROPERTIES = ("one-success", "one-live-run", "claimed-once", "steps-once", "fan-in",
              "concurrency-key", "rate-window", "nothing-lost", "periodic-once")


class Result(NamedTuple):
    """One property: whether it held, what was counted, the first counter-example."""
    name: str
    held: bool
    counts: Dict[str, int]
    example: Optional[str] = None

    def line(self):
        counts = ", ".join("%d %s" % (n, what) for what, n in self.counts.items())
        return "%s %s: %s%s" % ("ok  " if self.held else "FAIL", self.name, counts,
                                "" if self.held else "; first: " + str(self.example))

    def to_json(self):
        return {"property": self.name, "held": self.held, "counts": self.counts,
                "counterexample": self.example}


def when(text):
    """A recorded time as a naive UTC datetime (history times are ISO 8601 text)."""
    value = datetime.fromisoformat(text)
    return value.replace(tzinfo=None) - (value.utcoffset() or timedelta(0)) \
        if value.tzinfo else value


def check(events: List[Dict[str, Any]]) -> List[Result]:
    """Every property of the history `events`, in PROPERTIES order."""
    by_kind = defaultdict(list)
    for event in events:
        by_kind[event["kind"]].append(event)
    return [one_success(by_kind), one_live_run(by_kind), claimed_once(by_kind),
            steps_once(by_kind), fan_in(by_kind), concurrency_key(by_kind),
            rate_window(by_kind), nothing_lost(by_kind), periodic_once(by_kind)]


def held(results):
    return all(result.held for result in results)


def _result(name, examples, counts):
    return Result(name, not examples, counts, examples[0] if examples else None)


def one_success(h):
    successes = defaultdict(list)
    for end in h["end"]:
        if end["status"] == "success":
            successes[end["task"]].append(end["run"])
    examples = ["task %d has %d runs ended success: %s" % (
        task, len(runs), ", ".join(map(str, sorted(runs))))
        for task, runs in sorted(successes.items()) if len(runs) > 1]
    # Enqueued by the workload or submitted by a periodic task (read back: its final state).
    tasks = {e["task"] for e in h["enqueue"]} | {e["task"] for e in h["final"]}
    return _result("one-success", examples, {"tasks": len(tasks),
                                             "successful runs": sum(map(len, successes.values()))})


def _intervals(h):
    """{task: [(claimed, ended or None, run)]} of the runs that were claimed."""
    runs = defaultdict(list)
    for end in h["end"]:
        if end.get("started"):
            runs[end["task"]].append((when(end["started"]), end.get("finished") and
                                      when(end["finished"]), end["run"]))
    return runs


def one_live_run(h):
    examples, compared = [], 0
    for task, runs in sorted(_intervals(h).items()):
        runs.sort(key=lambda run: run[0])
        for (start, finish, run), (later, _, other) in zip(runs, runs[1:]):
            compared += 1
            if finish is None or later < finish:
                examples.append("task %d: run %d claimed at %s while run %d was live (claimed "
                                "%s, ended %s)" % (task, other, later, run, start, finish))
    return _result("one-live-run", examples, {"runs": sum(len(r) for r in _intervals(h).values()),
                                              "successive runs compared": compared})


def claimed_once(h):
    """A start after a return from the same run, or two starts of it by different processes
    with no return between (a run given back by a stopping runner starts again once: its
    first execution returned nothing, and the give-back ended it)."""
    timeline = defaultdict(list)
    for event in h["start"] + h["done"]:
        timeline[event["run"]].append(event)
    examples, starts = [], 0
    for run, events in sorted(timeline.items()):
        events.sort(key=lambda e: when(e["at"]))
        returned, running = None, {}
        for event in events:
            if event["kind"] == "done":
                returned = event
                running.pop(event["pid"], None)
                continue
            starts += 1
            if returned is not None:
                examples.append("run %d (task %d) started by pid %d after pid %d had returned "
                                "from it" % (run, event["task"], event["pid"], returned["pid"]))
            others = [pid for pid in running if pid != event["pid"]]
            if others and not returned:
                examples.append("run %d (task %d) started by pid %d while pid %d executed it"
                                % (run, event["task"], event["pid"], others[0]))
            running[event["pid"]] = event
    return _result("claimed-once", examples, {"runs started": len(timeline),
                                              "starts": starts})


def steps_once(h):
    committed, examples = {}, []
    for event in sorted(h["exec"] + h["step"], key=lambda e: (when(e["at"]), e["kind"] == "exec")):
        key = (event["task"], event["step"])
        if event["kind"] == "step":
            committed.setdefault(key, event)
        elif key in committed:
            examples.append("task %d step %s executed again (pid %d, run %d) after its record "
                            "committed (pid %d, run %d)" % (
                                key[0], key[1], event["pid"], event["run"],
                                committed[key]["pid"], committed[key]["run"]))
    expected = {(e["task"], "s%d" % i) for e in h["enqueue"] for i in range(e.get("steps", 0))}
    rows = {(e["task"], e["step"]): e["count"] for e in h["effect"]}
    succeeded = {e["task"] for e in h["final"] if e["status"] == "success"}
    for key in sorted(expected):
        if key[0] in succeeded and rows.get(key, 0) != 1:
            examples.append("task %d step %s: %d application rows written in its transaction, "
                            "not 1" % (key[0], key[1], rows.get(key, 0)))
    return _result("steps-once", examples, {"steps": len(expected),
                                            "executions": len(h["exec"]),
                                            "application rows": sum(rows.values())})


def fan_in(h):
    # A parent has returned when the handler of its successful run did (a run that returned
    # and then lost its end to a kill -9 or a timeout released nothing); before the ends are
    # known, when any of its runs did.
    successful = {end["run"] for end in h["end"] if end["status"] == "success"}
    returned = defaultdict(list)
    for event in h["done"]:
        if not successful or event["run"] in successful:
            returned[event["task"]].append(when(event["at"]))
    starts = defaultdict(list)
    for event in h["start"]:
        starts[event["task"]].append(event)
    first_runs = defaultdict(set)
    for end in h["end"]:
        if end["attempt"] == 1:
            first_runs[end["task"]].add(end["run"])
    seen = defaultdict(list)
    for event in h["fanin"]:
        seen[event["task"]].append(event["parents"])
    examples, fanins = [], 0
    for task in (e for e in h["enqueue"] if e.get("parents")):
        fanins += 1
        tid, parents = task["task"], task["parents"]
        if len(first_runs[tid]) > 1:
            examples.append("task %d released %d times (runs %s of attempt 1)" % (
                tid, len(first_runs[tid]), sorted(first_runs[tid])))
        if starts[tid]:
            first = min(when(e["at"]) for e in starts[tid])
            for parent in parents:
                if not returned[parent] or min(returned[parent]) > first:
                    examples.append("task %d started at %s before its parent %d returned"
                                    % (tid, first, parent))
                    break
        if task.get("reads") and any(n != len(parents) for n in seen[tid]):
            examples.append("task %d read %s parents' results, not %d" % (
                tid, sorted(set(seen[tid])), len(parents)))
    return _result("fan-in", examples, {"dependents": fanins,
                                        "edges": sum(len(e.get("parents") or ())
                                                     for e in h["enqueue"])})


def concurrency_key(h):
    limits = {e["key"]: e["limit"] for e in h["limit"] if e.get("what") == "concurrency"}
    keyed = {e["task"]: e["key"] for e in h["enqueue"] if e.get("concurrency_key")}
    points = defaultdict(list)
    for task, runs in _intervals(h).items():
        if task in keyed:
            for start, finish, run in runs:
                points[keyed[task]].append((start, 1, run))
                points[keyed[task]].append((finish or datetime.max, -1, run))
    examples, most = [], 0
    for key, marks in sorted(points.items()):
        live = set()
        # Ends before starts at one instant: a run's end and the next's claim may share it.
        for at, change, run in sorted(marks, key=lambda m: (m[0], m[1])):
            if change > 0:
                live.add(run)
                if len(live) > limits.get(key, 1):
                    examples.append("key %s: %d runs live at %s (%s), limit %d" % (
                        key, len(live), at, ", ".join(map(str, sorted(live))),
                        limits.get(key, 1)))
            else:
                live.discard(run)
            most = max(most, len(live))
    return _result("concurrency-key", examples, {"keys": len(points),
                                                 "most live at once": most})


def rate_window(h):
    """Token bucket: k claims in [t_i, t_j] need k <= burst + rate * (t_j - t_i). The claim
    times are the database's, written in the claim (where the token is spent); a tolerance
    of one token covers a bucket's refill arithmetic rounding."""
    rates = {e["key"]: (e["rate"], e["burst"]) for e in h["limit"] if e.get("what") == "rate"}
    queue_of = {e["task"]: e["queue"] for e in h["enqueue"] if e.get("queue") in rates}
    claims = defaultdict(list)
    for end in h["end"]:
        if end["task"] in queue_of and end.get("started"):
            claims[queue_of[end["task"]]].append(when(end["started"]))
    examples, checked = [], 0
    for queue, times in sorted(claims.items()):
        rate, burst = rates[queue]
        times.sort()
        for i, first in enumerate(times):
            for j in range(i + 1, len(times)):
                checked += 1
                allowed = burst + rate * (times[j] - first).total_seconds() + 1
                if j - i + 1 > allowed:
                    examples.append("queue %s: %d runs claimed between %s and %s, at most %.1f "
                                    "allowed" % (queue, j - i + 1, first, times[j], allowed))
                    break
            if examples:
                break
    return _result("rate-window", examples, {"claims": sum(map(len, claims.values())),
                                             "windows": checked})


def nothing_lost(h):
    final = {e["task"]: e["status"] for e in h["final"]}
    examples = ["task %d (%s) ended %s, not success" % (
        e["task"], e["shape"], final.get(e["task"], "nowhere: it is missing"))
        for e in h["enqueue"] if final.get(e["task"]) != "success"]
    return _result("nothing-lost", examples, {
        "enqueued": len(h["enqueue"]),
        "succeeded": sum(1 for e in h["enqueue"] if final.get(e["task"]) == "success")})


def _window_end(h):
    """The last due time every scheduler had to handle: the earliest of their last passes'
    times (a due time after it may have been taken by a pass that never committed)."""
    last = defaultdict(lambda: datetime.min)
    for event in h["pass"]:
        last[event["pid"]] = max(last[event["pid"]], when(event["now"]))
    return min(last.values()) if last else None


def _committed_by(h):
    """{task: a time by which the end that finished it had certainly committed, on the
    database's clock}, for the tasks whose runner recorded something afterwards. A task's
    finished time is stamped when its handler returned, before the end's transaction, which
    then waits for the database (its lock, a busy server, a runner stopped meanwhile): the
    end commits some time after it. Its runner executes one run at a time and starts its
    next only once that end has committed (the end and the next claim are one transaction,
    or the claim follows it), so the first event the runner records after returning from the
    task's last run bounds the commit. A runner that recorded nothing after it (killed,
    idle until the end) leaves the task out: its end's commit is bounded by nothing."""
    finished = {e["task"]: when(e["finished"]) for e in h["instance"] if e["finished"]}
    last_run = {}
    for end in h["end"]:
        if end["task"] in finished and end.get("finished") \
                and when(end["finished"]) == finished[end["task"]]:
            last_run[end["run"]] = end["task"]
    by_pid = defaultdict(list)
    for event in h["start"] + h["exec"] + h["step"] + h["fanin"] + h["done"]:
        by_pid[event["pid"]].append((when(event["at"]), when(event.get("db_at")
                                                             or event["at"])))
    for events in by_pid.values():
        events.sort()
    bound = {}
    for done in h["done"]:
        task = last_run.get(done["run"])
        events = by_pid[done["pid"]]
        after = bisect.bisect_right(events, (when(done["at"]), datetime.max))
        if task is not None and after < len(events):
            bound[task] = min(bound.get(task, datetime.max), events[after][1])
    return bound


def periodic_once(h):
    """The due times of each periodic task are its first one plus whole intervals, up to the
    window's end; a task's due time is its scheduled_on (no jitter). A due time without a
    task is a miss unless rule 9 explains it: the pass that handled it ran at or after it and
    found the previous task unfinished — unfinished then, or finished but its end not
    committed by the due time (`_committed_by`: a finished time before the due time is not
    enough) — or a pass after it submitted the previous task (catch-up once)."""
    tasks = defaultdict(list)
    for event in h["instance"]:
        tasks[event["periodic"]].append(dict(event, due=when(event["scheduled"])))
    end, examples, due_times, skipped = _window_end(h), [], 0, 0
    committed_by = _committed_by(h)
    for periodic in h["periodic"]:
        name, every = periodic["name"], timedelta(seconds=periodic["every"])
        mine = sorted(tasks[name], key=lambda t: (t["due"], t["task"]))
        by_due = defaultdict(list)
        for task in mine:
            by_due[task["due"]].append(task["task"])
        examples += ["periodic task %s: its due time %s yielded %d tasks: %s" % (
            name, due, len(ids), ", ".join(map(str, ids)))
            for due, ids in sorted(by_due.items()) if len(ids) > 1]
        due = when(periodic["first"])
        while end is not None and due <= end:
            due_times += 1
            if due not in by_due:
                previous = ([t for t in mine if t["due"] < due] or [None])[-1]
                if previous is not None and (
                        not previous["finished"] or when(previous["created"]) >= due
                        or when(previous["finished"]) > due
                        or committed_by.get(previous["task"], datetime.max) > due):
                    skipped += 1
                else:
                    examples.append("periodic task %s: its due time %s yielded no task, %s" % (
                        name, due, "and none before it" if previous is None else
                        "though its previous task %d (due %s) had finished at %s, its end "
                        "committed by %s" % (previous["task"], previous["due"],
                                             previous["finished"],
                                             committed_by.get(previous["task"]))))
            due += every
    return _result("periodic-once", examples, {
        "periodic tasks": len(h["periodic"]), "due times": due_times,
        "tasks": sum(map(len, tasks.values())), "skipped": skipped,
        "passes": len(h["pass"])})
