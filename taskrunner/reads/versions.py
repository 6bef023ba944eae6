"""Code versions for the operator (docs: "Changing durable code under running work"): per
version, the runners running it and the durable tasks still open that started under it — an
old version has drained when neither is left. Read by ``taskrunner versions``, ``status``,
the dashboard's runners page and the metrics."""
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Dict, List, Optional

import peewee as pw

from .records import Record, aware
from ..store.models import RUNNER, RUNNING

# Versions the metrics label (the newest first); the older ones' open tasks are summed under
# "(other)", so a scrape stays small however many deploys the rows remember.
METRIC_VERSIONS = 10
OTHER = "(other)"


@dataclass(frozen=True)
class VersionInfo(Record):
    """One code version: its runners running now, its durable tasks not ended, and when a
    runner first and last started with it (over the runner rows kept: [rotation]
    keep_runners). ``drained``: no runner runs it and no task it started is open."""
    code_version: str
    runners: int
    open_tasks: int
    first_started_on: Optional[datetime]
    last_started_on: Optional[datetime]
    drained: bool


def code_versions(store: Any) -> List[VersionInfo]:
    """Every version that runner rows or open tasks name, the most recently started first
    (versions only open tasks name, whose runner rows were rotated away, last)."""
    Runner = store.Runner
    seen: Dict[str, List[Any]] = {}
    for version, first, last, running in Runner.select(
            Runner.code_version, pw.fn.MIN(Runner.started_on), pw.fn.MAX(Runner.started_on),
            pw.fn.SUM(pw.Case(None, [(Runner.status == RUNNING, 1)], 0))).where(
            Runner.code_version.is_null(False) & (Runner.kind == RUNNER)).group_by(
            Runner.code_version).tuples():
        seen[version] = [int(running or 0), 0, aware(first), aware(last)]
    for version, count in open_tasks_by_version(store).items():
        seen.setdefault(version, [0, 0, None, None])[1] = count
    infos = [VersionInfo(code_version=version, runners=runners, open_tasks=tasks,
                         first_started_on=first, last_started_on=last,
                         drained=not runners and not tasks)
             for version, (runners, tasks, first, last) in seen.items()]
    return sorted(infos, key=lambda v: (v.last_started_on is not None,
                                        v.last_started_on or datetime.min, v.code_version),
                  reverse=True)


def open_tasks_by_version(store: Any) -> Dict[str, int]:
    """{version: durable tasks not ended that started under it}."""
    Task = store.Task
    return {version: int(count) for version, count in Task.select(
        Task.code_version, pw.fn.COUNT(Task.id)).where(
        Task.finished_on.is_null() & Task.code_version.is_null(False)).group_by(
        Task.code_version).tuples()}


def metric_figures(versions: List[VersionInfo]) -> Dict[str, Any]:
    """{version: (open tasks, runners)} for the metrics: the METRIC_VERSIONS newest versions
    not drained, the others summed under OTHER."""
    live = [v for v in versions if not v.drained]
    figures: Dict[str, Any] = {v.code_version: (v.open_tasks, v.runners)
                               for v in live[:METRIC_VERSIONS]}
    rest = live[METRIC_VERSIONS:]
    if rest:
        figures[OTHER] = (sum(v.open_tasks for v in rest), sum(v.runners for v in rest))
    return figures
