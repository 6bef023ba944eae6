"""What operators and handlers read of the graph (runs/graph.py): a workflow's state — counts
per state, progress, outcome, its tasks and their edges — for `TaskQueue.workflow`, the CLI's
``workflow show`` and the dashboard's workflow page; and the results of a task's parents
(`ParentResults`, a handler's ``run.parent_results``), read in pages.
"""
import json
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Dict, Iterator, List, Optional, Tuple

import peewee as pw

from ..errors import InputError
from ..store.models import CANCELLED, RUNNING, SCHEDULED, SUCCESS, run_status_is
from .records import Record, aware, counted_word, running_of, state_word

PAGE = 500              # parents' results read per query
GRAPH_LIMIT = 10000     # tasks listed with their edges in one read of a workflow


class WorkflowNotFound(InputError):
    """No workflow with that id."""


@dataclass(frozen=True)
class WorkflowTask(Record):
    """A task of a workflow, in the graph: its state word (``waiting`` while it waits for
    its parents, or sleeps; as `get_task` and every table say) and the tasks it runs
    after."""
    id: int
    handler: str
    state: str
    after: List[int]
    finished_on: Optional[datetime]
    error_code: Optional[str]


@dataclass(frozen=True)
class WorkflowInfo(Record):
    """Tasks added together: how many are in each state, how far it is, how it ended
    (``running`` until every task is final; then ``success`` when all succeeded, else
    ``failed``, or ``cancelled`` when none failed but some were cancelled), and its graph
    (`tasks`, at most GRAPH_LIMIT of them, in id order)."""
    id: int
    name: Optional[str]
    created_on: datetime
    total: int
    counts: Dict[str, int]
    finished: int
    progress: float               # finished / total, 0..1
    outcome: str
    tasks: List[WorkflowTask] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return self.outcome != "running"


def workflow_info(store: Any, workflow_id: int, graph: bool = True) -> WorkflowInfo:
    """The workflow's state; WorkflowNotFound for an unknown id. `graph`: with its tasks and
    their edges (else `tasks` is empty: counts only)."""
    Workflow = store.Workflow
    row = Workflow.get_or_none(Workflow.id == workflow_id)
    if row is None:
        raise WorkflowNotFound("no workflow with id %s" % workflow_id)
    counts = _state_counts(store, [workflow_id]).get(workflow_id, {})
    return _info(row, counts, workflow_tasks(store, workflow_id) if graph else [])


def list_workflows(store: Any, before: Optional[int] = None,
                   limit: int = 50) -> Tuple[List[WorkflowInfo], Optional[int]]:
    """Workflows newest first, with ids below `before` (keyset paging), their counts and
    outcome (no graph); and the `before` of the next page (None at the end)."""
    Workflow = store.Workflow
    query = Workflow.select().order_by(Workflow.id.desc()).limit(limit + 1)
    if before is not None:
        query = query.where(Workflow.id < before)
    rows = list(query)
    counts = _state_counts(store, [r.id for r in rows[:limit]])
    infos = [_info(r, counts.get(r.id, {}), []) for r in rows[:limit]]
    return infos, infos[-1].id if len(rows) > limit else None


def _state_counts(store: Any, workflow_ids: List[int]) -> Dict[int, Dict[str, int]]:
    """Each workflow's tasks counted by state word (one grouped read, by the workflow_id
    index)."""
    Task = store.Task
    counts: Dict[int, Dict[str, int]] = {}
    if not workflow_ids:
        return counts
    # Written out, not bound: GROUP BY must repeat the selected expressions word for word.
    final = pw.SQL("CASE WHEN finished_on IS NULL THEN 0 ELSE 1 END")
    query = (Task.select(Task.workflow_id, Task.last_status, final, pw.fn.COUNT(Task.id))
             .where(Task.workflow_id.in_(workflow_ids))
             .group_by(Task.workflow_id, Task.last_status, final))
    for workflow_id, status, final, count in query.tuples():
        word = counted_word(status, True if final else None)
        mine = counts.setdefault(workflow_id, {})
        mine[word] = mine.get(word, 0) + count
    # A running task's row says scheduled (the claim writes its run alone).
    Run = store.Run
    for workflow_id, count in (Run.select(Task.workflow_id, pw.fn.COUNT(Run.id))
                               .join(Task, on=(Task.id == Run.task_id))
                               .where(run_status_is(Run, RUNNING)
                                      & Task.workflow_id.in_(workflow_ids))
                               .group_by(Task.workflow_id).tuples()):
        mine = counts[workflow_id]
        mine[RUNNING] = count
        mine[SCHEDULED] -= count
        if not mine[SCHEDULED]:
            del mine[SCHEDULED]
    return counts


def _info(row: Any, counts: Dict[str, int], tasks: List[WorkflowTask]) -> WorkflowInfo:
    total = sum(counts.values())
    finished = sum(n for word, n in counts.items()
                   if word in (SUCCESS, CANCELLED, "given-up"))
    if finished < total or total == 0:
        outcome = "running"
    elif counts.get("given-up"):
        outcome = "failed"
    elif counts.get(CANCELLED):
        outcome = CANCELLED
    else:
        outcome = SUCCESS
    return WorkflowInfo(id=row.id, name=row.name, created_on=aware(row.created_on),
                        total=total, counts=counts, finished=finished,
                        progress=finished / total if total else 0.0, outcome=outcome,
                        tasks=tasks)


def workflow_tasks(store: Any, workflow_id: int, limit: int = GRAPH_LIMIT) -> List[WorkflowTask]:
    """The first `limit` tasks of the workflow with the tasks each runs after."""
    Task, Dependency = store.Task, store.Dependency
    rows = list(Task.select(Task.id, Task.handler, Task.last_status, Task.finished_on,
                            Task.last_error_code)
                .where(Task.workflow_id == workflow_id).order_by(Task.id).limit(limit))
    after: Dict[int, List[int]] = {}
    ids = [r.id for r in rows]
    running = running_of(store, [r.id for r in rows if r.last_status == SCHEDULED])
    for start in range(0, len(ids), PAGE):
        for task_id, parent_id in (Dependency.select(Dependency.task_id, Dependency.parent_id)
                                   .where(Dependency.task_id.in_(ids[start:start + PAGE]))
                                   .order_by(Dependency.task_id, Dependency.parent_id)
                                   .tuples()):
            after.setdefault(task_id, []).append(parent_id)
    return [WorkflowTask(id=r.id, handler=r.handler,
                         state=state_word(r.last_status, r.finished_on, r.id in running),
                         after=after.get(r.id, []), finished_on=aware(r.finished_on),
                         error_code=r.last_error_code if r.last_status != SUCCESS else None)
            for r in rows]


def workflow_task_ids(store: Any, workflow_id: int, unfinished: bool = False) -> List[int]:
    Task = store.Task
    query = Task.select(Task.id).where(Task.workflow_id == workflow_id)
    if unfinished:
        query = query.where(Task.finished_on.is_null())
    return [t.id for t in query.order_by(Task.id)]


def parents_of(store: Any, task_id: int) -> List[int]:
    Dependency = store.Dependency
    return [d.parent_id for d in Dependency.select(Dependency.parent_id)
            .where(Dependency.task_id == task_id).order_by(Dependency.parent_id)]


class ParentResults:
    """The results of the tasks a task runs after, keyed by task id (a handler's
    ``run.parent_results``): read from the database when asked, never all at once —
    iterating (`items`, `keys`, `values`, ``for id in``) reads PAGE parents per query, in
    id order; ``results[id]`` reads one. A parent's results are those of its successful
    run (None for a parent that did not succeed: one that failed, for a task added with
    ``on_parent_failure="run"``)."""

    def __init__(self, store: Any, task_id: int) -> None:
        self._store, self.task_id = store, task_id

    def _page(self, after: int, limit: int = PAGE) -> List[Tuple[int, Any]]:
        Dependency, Run = self._store.Dependency, self._store.Run
        rows = (Dependency.select(Dependency.parent_id, Run.results)
                .join(Run, pw.JOIN.LEFT_OUTER, on=((Run.task_id == Dependency.parent_id)
                                                   & (Run.status == SUCCESS)))
                .where((Dependency.task_id == self.task_id) & (Dependency.parent_id > after))
                .order_by(Dependency.parent_id).limit(limit).tuples())
        return [(parent, None if text is None else json.loads(text)) for parent, text in rows]

    def items(self) -> Iterator[Tuple[int, Any]]:
        after = 0
        while True:
            page = self._page(after)
            yield from page
            if len(page) < PAGE:
                return
            after = page[-1][0]

    def keys(self) -> Iterator[int]:
        return (parent for parent, _ in self.items())

    def values(self) -> Iterator[Any]:
        return (results for _, results in self.items())

    def __iter__(self) -> Iterator[int]:
        return self.keys()

    def __len__(self) -> int:
        Dependency = self._store.Dependency
        return Dependency.select().where(Dependency.task_id == self.task_id).count()

    def __contains__(self, parent_id: object) -> bool:
        Dependency = self._store.Dependency
        return Dependency.select().where((Dependency.task_id == self.task_id)
                                         & (Dependency.parent_id == parent_id)).exists()

    def __getitem__(self, parent_id: int) -> Any:
        if not isinstance(parent_id, int) or parent_id not in self:
            raise KeyError(parent_id)
        page = self._page(parent_id - 1, 1)
        return page[0][1]

    def get(self, parent_id: int, default: Any = None) -> Any:
        try:
            return self[parent_id]
        except KeyError:
            return default

    def __repr__(self) -> str:
        return "<ParentResults of task %d>" % self.task_id
