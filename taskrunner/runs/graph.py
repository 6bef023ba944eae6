"""The graph (DESIGN, "Graph"; rule 10): tasks that run after others.

An edge (``task_dependencies``) says that ``task_id`` runs after ``parent_id`` succeeded. A
task that waits has no run — the claim never sees it, at no cost — and counts its edges not
satisfied yet in ``task_queue.waiting_parents``. The parent's success, in its own
transaction, satisfies its edges and takes one off each dependent's count, set-based;
the dependents that reach 0 are released: ``waiting_parents`` becomes NULL and
``last_status`` ``scheduled`` (in that one statement), and the lifecycle creates their run
in that same transaction (`lifecycle` calls these functions).

Exactly once: a parent's edges are satisfied under the parent's row lock (its success, its
failure and an add of a dependent all lock it first), and a dependent's count is changed
under the dependent's row lock; the transaction that takes a count to 0 sets it NULL before
it commits, so no committed live task ever shows 0, and only the transaction that reached 0
releases it. A task whose success releases nothing (``dependents`` = 0, most tasks) runs
none of these statements.

A parent that ends without success (given up, or cancelled) cancels its waiting dependents
with the reason stored (``ParentFailed``), and theirs in turn; a dependent added with
``on_parent_failure="run"`` counts such a parent as done instead. A retry of a given-up
parent re-arms the dependents that its failure cancelled (`rearm`): their edges from it were
left unsatisfied, so they wait for it again.
"""
from . import sql
from ..errors import InputError
from ..store.models import CANCELLED, SCHEDULED, SUCCESS, WAITING

ON_PARENT_FAILURE = ("cancel", "run")
PARENT_FAILED = "ParentFailed"
CHUNK = 500       # ids per IN list: within every database's limit on bound parameters


def _sql(store, statement):
    """`statement` written with %s, for this store's driver."""
    return statement.replace("%s", "?") if store.is_sqlite else statement


def chunks(ids, size=CHUNK):
    ids = list(ids)
    for start in range(0, len(ids), size):
        yield ids[start:start + size]


# -- adding ---------------------------------------------------------------------------------

def parent_states(store, ids):
    """Inside the caller's write transaction: the existing parents `ids`, locked (an add
    against their success: whichever locks first, the other sees it), as {id: "done" |
    "failed" | "pending"}; InputError naming an unknown id."""
    Task = store.Task
    states = {}
    for chunk in chunks(sorted(set(ids))):
        for task in store.locked(Task.select(Task.id, Task.last_status, Task.finished_on)
                                 .where(Task.id.in_(chunk))):
            states[task.id] = ("done" if task.last_status == SUCCESS else
                               "failed" if task.finished_on is not None else "pending")
    unknown = sorted(set(ids) - set(states))
    if unknown:
        raise InputError("after: no task with id %s" % ", ".join(map(str, unknown[:10])))
    return states


def check_policy(value):
    if value is not None and value not in ON_PARENT_FAILURE:
        raise InputError("on_parent_failure must be one of %s, not %r"
                         % (", ".join(ON_PARENT_FAILURE), value))


def plan(rows, parents, states, at):
    """Shape `rows` (validated task rows, changed in place) after their `parents` (per row:
    existing task ids, and ("row", j) for the row j < i of the same add), the existing
    parents' `states`: a row waits, is due as usual, or is cancelled at once (a failed parent
    and the default policy). Returns the edges [(row index, parent: id or ("row", j),
    satisfied)]."""
    edges, state_of_row = [], []
    for index, (row, after) in enumerate(zip(rows, parents)):
        run_anyway = row.get("on_parent_failure") == "run"
        waiting = failed = 0
        for parent in after:
            if isinstance(parent, tuple):
                state = "failed" if state_of_row[parent[1]] == "cancelled" else "pending"
            else:
                state = states[parent]
            satisfied = state == "done" or (state == "failed" and run_anyway)
            waiting += not satisfied
            failed += state == "failed" and not run_anyway
            edges.append((index, parent, satisfied))
            if isinstance(parent, tuple):
                rows[parent[1]]["dependents"] = rows[parent[1]].get("dependents", 0) + 1
        if failed:
            row.update(last_status=CANCELLED, finished_on=at, active_key=None, next_run_on=None,
                       run_count=0, waiting_parents=waiting, last_error_code=PARENT_FAILED,
                       last_error_message="a task it runs after was cancelled or given up "
                                          "before it was added")
            state_of_row.append("cancelled")
        elif waiting:
            row.update(last_status=WAITING, waiting_parents=waiting, next_run_on=None,
                       run_count=0)
            state_of_row.append("waiting")
        else:
            state_of_row.append("ready")
    return edges


def insert_edges(store, edges, ids):
    """Inside the caller's transaction: the edges of `plan` with the new tasks' `ids`, in
    multi-row INSERTs; the existing parents count their new dependents."""
    Task, Dependency = store.Task, store.Dependency
    rows = [{"task_id": ids[index], "parent_id": ids[p[1]] if isinstance(p, tuple) else p,
             "satisfied": satisfied} for index, p, satisfied in edges]
    for start in range(0, len(rows), CHUNK):
        store.db.execute_sql(*sql.insert_rows(store.backend, Dependency,
                                              rows[start:start + CHUNK]))
    counts = {}
    for _, parent, _ in edges:
        if not isinstance(parent, tuple):
            counts[parent] = counts.get(parent, 0) + 1
    by_count = {}
    for parent, count in counts.items():
        by_count.setdefault(count, []).append(parent)
    for count, parents in by_count.items():
        for chunk in chunks(parents):
            Task.update(dependents=Task.dependents + count).where(Task.id.in_(chunk)).execute()


def workflow_of(store, parent_ids):
    """The workflow a task added after existing `parent_ids` joins: its first parent's."""
    Task = store.Task
    row = (Task.select(Task.workflow_id).where(Task.id.in_(list(parent_ids)[:CHUNK])
                                               & Task.workflow_id.is_null(False))
           .order_by(Task.id).first()) if parent_ids else None
    return row.workflow_id if row else None


# -- a parent succeeded -----------------------------------------------------------------------

# The statements of a release, written with %s (and %%s where a list of ids goes in): the
# parent's edges not satisfied yet, read and written by the (parent_id, task_id) index; the
# dependents by primary key. tests/test_claim_plan.py reads their plans.
RELEASE_CHILDREN = ("SELECT task_id FROM task_dependencies WHERE parent_id = %s "
                    "AND NOT satisfied")
RELEASE_RUN_ANYWAY = ("SELECT d.task_id FROM task_dependencies AS d JOIN task_queue AS t "
                      "ON t.id = d.task_id WHERE d.parent_id = %s AND NOT d.satisfied "
                      "AND t.on_parent_failure = 'run'")
RELEASE_SATISFY = ("UPDATE task_dependencies SET satisfied = %s WHERE parent_id = %s "
                   "AND NOT satisfied")
RELEASE_SATISFY_SOME = ("UPDATE task_dependencies SET satisfied = %%s WHERE "
                        "parent_id = %%s AND task_id IN (%s)")
RELEASE_COUNT = ("UPDATE task_queue SET waiting_parents = waiting_parents - 1, "
                 "updated_on = %%s WHERE id IN (%s) AND waiting_parents > 0 "
                 "AND finished_on IS NULL")
RELEASE_READY = ("SELECT id FROM task_queue WHERE id IN (%s) AND waiting_parents = 0 "
                 "AND finished_on IS NULL")
RELEASE_MARK = ("UPDATE task_queue SET waiting_parents = NULL, last_status = 'scheduled' "
                "WHERE id IN (%s)")


def release(store, parent_id, at, only_run_anyway=False):
    """Inside the transaction of `parent_id`'s success (its row locked): its edges are
    satisfied and each dependent still waiting counts one fewer; returns the ids of the
    dependents released (their count reached 0, now NULL), for the lifecycle to start.
    `only_run_anyway`: the parent failed, and only the dependents added with
    ``on_parent_failure="run"`` go on. The dependents are read off the edges' index first
    and then written by primary key: a join the planner could drive from task_queue would
    read the whole table for each parent."""
    execute = store.db.execute_sql
    statement = RELEASE_RUN_ANYWAY if only_run_anyway else RELEASE_CHILDREN
    children = [row[0] for row in execute(_sql(store, statement), (parent_id,))]
    if not children:
        return []
    if not only_run_anyway:
        execute(_sql(store, RELEASE_SATISFY), (True, parent_id))
    released = []
    for chunk in chunks(children):
        marks = ", ".join(["%s"] * len(chunk))
        if only_run_anyway:
            execute(_sql(store, RELEASE_SATISFY_SOME % marks), [True, parent_id] + chunk)
        execute(_sql(store, RELEASE_COUNT % marks), [_at(store, at)] + chunk)
        ready = [row[0] for row in execute(_sql(store, RELEASE_READY % marks), chunk)]
        if ready:
            execute(_sql(store, RELEASE_MARK % ", ".join(["%s"] * len(ready))), ready)
            released += ready
    return released


def _at(store, at):
    return at.isoformat(" ") if store.is_sqlite else at


def _unsatisfied_children(store, parent_id):
    Dependency = store.Dependency
    return [d.task_id for d in Dependency.select(Dependency.task_id).where(
        (Dependency.parent_id == parent_id) & ~Dependency.satisfied)]


# -- a parent failed ------------------------------------------------------------------------

def parent_failed(store, parent_id, status, at):
    """Inside the transaction that ended `parent_id` without success (given up with
    `status`, or cancelled): its waiting dependents are cancelled with the reason stored,
    and theirs in turn; those added with ``on_parent_failure="run"`` count it as done.
    Returns the ids released (for the lifecycle to start)."""
    Task = store.Task
    released, frontier = [], [(parent_id, status)]
    while frontier:
        parent, why = frontier.pop()
        released += release(store, parent, at, only_run_anyway=True)
        waiting = [task for chunk in chunks(_unsatisfied_children(store, parent))
                   for task in Task.select(Task.id, Task.dependents).where(
                       Task.id.in_(chunk) & (Task.waiting_parents > 0)
                       & Task.finished_on.is_null())]
        message = "task %d it runs after %s" % (
            parent, "was cancelled" if why == CANCELLED else "gave up (%s)" % why)
        for chunk in chunks([t.id for t in waiting]):
            Task.update(last_status=CANCELLED, finished_on=at, updated_on=at, active_key=None,
                        next_run_on=None, waiting_key=None, last_error_code=PARENT_FAILED,
                        last_error_message=message).where(Task.id.in_(chunk)).execute()
        frontier += [(t.id, CANCELLED) for t in waiting if t.dependents]
    return released


def rearm(store, parent_id, at):
    """Inside the transaction of `parent_id`'s retry: the dependents its failure cancelled
    (``ParentFailed``), and theirs in turn, are ``waiting`` again, each for its edges not
    satisfied (the edges from the retried parent among them). Returns (how many were
    re-armed, the ids of those that wait for nothing: the lifecycle starts them)."""
    Task, Dependency = store.Task, store.Dependency
    count, released, frontier = 0, [], [parent_id]
    while frontier:
        parent = frontier.pop()
        cancelled = [task for chunk in chunks(_unsatisfied_children(store, parent))
                     for task in Task.select(Task.id, Task.dependents).where(
                         Task.id.in_(chunk) & (Task.last_status == CANCELLED)
                         & (Task.last_error_code == PARENT_FAILED))]
        for task in cancelled:
            left = Dependency.select().where((Dependency.task_id == task.id)
                                             & ~Dependency.satisfied).count()
            Task.update(last_status=WAITING if left else SCHEDULED, finished_on=None,
                        updated_on=at, active_key=Task.unique_key, last_error_code=None,
                        last_error_message=None, waiting_parents=left or None
                        ).where(Task.id == task.id).execute()
            if not left:
                released.append(task.id)
        count += len(cancelled)
        frontier += [t.id for t in cancelled if t.dependents]
    return count, released
