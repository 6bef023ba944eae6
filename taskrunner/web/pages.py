"""The dashboard's pages, each built from the read functions only (`reads`, `summaries`).

A page is ``(title, body)``; the parts of it that refresh by themselves are functions of
their own (``*_live``) that the page embeds in an element with an id, and that
``/api/parts`` serves again as JSON for the page's script to swap in.
"""
import json
from collections import OrderedDict
from datetime import datetime, timezone
from typing import Any, Dict, Mapping, Optional, Tuple

from ..reads import data_search, records as reads, summaries, versions, workflows
from ..errors import InputError
from ..masking import masked
from ..store.models import LARGEST_ID
from .html import (H, ago, csrf_form, e, minute_chart, pretty, progress, query, short, span, status,
                   status_bar, table, when)
from .html import now as utcnow

PAGE_SIZE = 50
GRAPH_SHOWN = 1000             # tasks of a workflow drawn on its page
AFTER_SHOWN = 20               # parents linked from each (a fan-in's: the first ones)


class View:
    """What every page needs: the store, the CSRF token, whether actions are offered."""

    def __init__(self, store: Any, csrf: str, read_only: bool,
                 succeeded: Optional[Any] = None):
        self.store, self.csrf, self.read_only = store, csrf, read_only
        # () -> the recent count of succeeded tasks the server keeps, or None
        self.succeeded = succeeded or (lambda: None)

    def action(self, path: str, button: str, fields: Optional[dict] = None, css: str = "") -> str:
        return "" if self.read_only else csrf_form(path, self.csrf, button, fields, css)

    def shown(self, value: Any) -> Any:
        """Task data or results as a page shows them: secret keys masked (masking.py)."""
        return masked(value, self.store.config.task.secret_keys)


def _time_param(params: Mapping[str, str], name: str) -> Optional[datetime]:
    text = params.get(name, "").strip()
    if not text:
        return None
    try:
        value = datetime.fromisoformat(text[:-1] + "+00:00" if text.endswith("Z") else text)
        # In UTC here, where a time near the calendar's ends cannot be moved there (the
        # queries compare in UTC).
        return value.astimezone(timezone.utc) if value.tzinfo \
            else value.replace(tzinfo=timezone.utc)
    except (ValueError, OverflowError):
        raise InputError("invalid %s time %r: expected ISO 8601, e.g. 2026-01-31T08:00"
                         % (name, text)) from None


def id_param(text: str, what: str) -> int:
    """A task id given in a URL; InputError (400) for anything no task can have."""
    text = text.strip()
    if not (text.isascii() and text.isdigit()) or not 0 < int(text) <= LARGEST_ID:
        raise InputError("invalid %s %r: expected a task id" % (what, text[:40]))
    return int(text)


def task_filter(store: Any, params: Mapping[str, str]) -> summaries.TaskFilter:
    """The tasks filter named by the URL's status, handler, queue, error, since, until,
    periodic and data (``key=value``)."""
    periodic = params.get("periodic", "").strip()
    data = params.get("data", "").strip()
    return summaries.TaskFilter(
        status=params.get("status") or None, handler=params.get("handler", "").strip() or None,
        since=_time_param(params, "since"), until=_time_param(params, "until"),
        periodic_task_id=summaries.periodic_task_id(store, periodic) if periodic else None,
        error_code=params.get("error", "").strip() or None,
        queue=params.get("queue", "").strip() or None,
        data=data_search.parse(store, data) if data else None)


def filter_params(params: Mapping[str, str]) -> Dict[str, str]:
    return {k: params[k] for k in ("status", "handler", "queue", "error", "since", "until",
                                   "periodic", "data") if params.get(k)}


# -- overview -------------------------------------------------------------------------------

def overview_live(view: View, params: Mapping[str, str]) -> str:
    store = view.store
    counts = summaries.status_counts(store, view.succeeded())
    tiles = H("").join(
        H('<a class="tile tile-%s" href="/tasks%s"><span class="n">%d</span><span>%s</span></a>')
        % (e(name), e(query(status=name)), n, e(name))
        for name, n in counts.items())
    minutes = summaries.runs_per_minute(store)
    done = sum(m.succeeded for m in minutes), sum(m.failed for m in minutes)
    lag = summaries.queue_lag(store)
    hosts: Dict[str, list] = OrderedDict()
    for runner in reads.running_runners(store):
        hosts.setdefault(runner.host, []).append(runner)
    host_rows = [[e(host), H("%d") % sum(r.kind == "runner" for r in rows),
                  H("%d") % sum(r.run_id is not None for r in rows),
                  "yes" if any(r.kind == "overseer" for r in rows) else "no"]
                 for host, rows in hosts.items()]
    return (H('<section class="tiles">%s</section>%s'
            '<div class="cols"><section class="card wide"><h2>Runs finished per minute, last '
            'hour <small>%d succeeded · %d failed</small></h2>%s</section>'
            '<section class="card"><h2>Queue lag</h2><p class="big" id="queue-lag">%s</p>'
            '<p class="muted">age of the oldest due run (paused queues left out)</p>'
            '<h2>Runners alive</h2>%s</section>'
            '</div>%s') % (tiles, status_bar(counts), done[0], done[1], minute_chart(minutes),
                          span(lag) if lag else "none", table(
                              ["Host", "Runners", "Busy", "Overseer"], host_rows,
                              "no runner is running"), queues_card(view)))


def queues_card(view: View) -> str:
    """Each queue: paused or active, its host limit, its tasks scheduled (as the tasks
    filter counts them), runs due, tasks running, the runners serving it, its lag; a
    Pause / Resume button."""
    rows = []
    for q in reads.queue_stats(view.store):
        toggle = view.action(H("/queues/%s") % ("resume" if q.paused else "pause"),
                             "Resume" if q.paused else "Pause", {"name": q.name},
                             css="" if q.paused else "danger")
        rows.append([H('<a href="/tasks%s">%s</a>') % (e(query(queue=q.name)), e(q.name)),
                     status("paused" if q.paused else "active"),
                     limit_cell(view, q),
                     H('<a href="/tasks%s">%d</a>') % (e(query(queue=q.name, status="scheduled")),
                                                    q.scheduled),
                     H("%d") % q.due,
                     H('<a href="/tasks%s">%d</a>') % (e(query(queue=q.name, status="running")),
                                                       q.running), H("%d") % q.runners,
                     H('<span class="muted">paused %s</span>') % span(q.paused_for) if q.paused
                     else span(q.lag) if q.lag else H('<span class="muted">none</span>'), toggle])
    return H('<section class="card" id="queues"><h2>Queues</h2>%s</section>') % table(
        ["Queue", "State", "Host limit", "Scheduled", "Due", "Running", "Runners", "Lag", ""],
        rows, "no queue is used yet", css="queues") + rates_card(view)


def limit_cell(view: View, q: Any) -> str:
    """A queue's host limit in force and where it comes from (stored by `queue limit`, or
    the config's); for a queue with a [queues.NAME] table, a form that stores another on
    every host, and Reset (back to the config's) while one is stored."""
    if q.limit is None:
        return H('<span class="muted">-</span>')
    shown = H('%d <span class="muted">(%s)</span>') % (q.limit, q.limit_source)
    if view.read_only:
        return shown
    form = H('<form method="post" action="/queues/limit" class="inline"><input type="hidden" '
             'name="csrf" value="%s"><input type="hidden" name="name" value="%s"><input '
             'type="number" name="limit" min="1" step="1" value="%d" aria-label="host limit of '
             '%s" class="limit"><button type="submit">Set</button></form>') % (
        view.csrf, q.name, q.limit, q.name)
    if q.limit_source == "stored":
        form += view.action("/queues/limit", "Reset", {"name": q.name, "reset": "1"})
    return shown + form


def rates_card(view: View) -> str:
    """Flow control: each rate-limited queue's and key's bucket (limit, allowance now, runs
    throttled) and the fair queues' tenants waiting; nothing when none is configured."""
    limits = reads.rate_limits(view.store)["buckets"]
    fair = [q for q in reads.queue_stats(view.store) if q.fair_by or q.aging]
    if not limits and not fair:
        return ""
    rows = [[e(b["kind"]), e(b["name"]), e(b["limit"]), H("%g") % b["burst"],
             H("%.1f") % b["allowance"], H("%d") % b["throttled"]] for b in limits]
    tenants = [[e(q.name), e(q.fair_by or "-"),
                H("%d") % q.tenants_waiting if q.tenants_waiting is not None else "-",
                span(q.aging) if q.aging else "-"] for q in fair]
    return (H('<section class="card" id="flow"><h2>Flow control</h2>%s%s</section>') % (
        table(["Kind", "Name", "Limit", "Burst", "Allowance", "Throttled runs"], rows,
              "no rate limit", css="rates"),
        table(["Queue", "Fair by", "Tenants waiting", "Aging"], tenants, "no fair queue",
              css="fair") if tenants else ""))


def overview(view: View, params: Mapping[str, str]) -> str:
    due = [p for p in reads.list_periodic(view.store, with_stats=False)
           if p.enabled and p.nextrun]
    due.sort(key=lambda p: p.nextrun or datetime.max.replace(tzinfo=timezone.utc))
    at = utcnow()
    rows = [[H('<a href="/tasks%s">%s</a>') % (e(query(periodic=p.name)), e(p.name)), e(p.timer),
             when(p.nextrun), e(ago(p.nextrun, at))] for p in due[:10]]
    return (H('<div id="overview-live" data-live>%s</div><section class="card"><h2>Next periodic '
            'tasks due</h2>%s</section>') % (overview_live(view, params), table(
                ["Periodic task", "Timer", "Next due", ""], rows,
                "no enabled periodic task is due")))


# -- runners --------------------------------------------------------------------------------

def runners_live(view: View, params: Mapping[str, str]) -> str:
    at = utcnow()
    hosts: Dict[str, list] = OrderedDict()
    for r in reads.running_runners(view.store):
        hosts.setdefault(r.host, []).append(r)
    if not hosts:
        return H('<p class="muted empty">no runner or overseer is running</p>')
    served = summaries.runner_queues(view.store)
    parts = []
    for host, rows in hosts.items():
        cells = []
        for r in rows:
            elapsed = ""
            if r.run_id is not None:
                run = next((x for x in reads.runs_of(view.store, r.task_id) if x.id == r.run_id),
                           None)
                if run is not None and run.started_on is not None:
                    elapsed = span((at - run.started_on).total_seconds())
                task = reads.get_task(view.store, r.task_id)
                current = H('<a href="/tasks/%d">task %d</a> run %d') % (r.task_id, r.task_id,
                                                                      r.run_id)
                handler = e(task.handler)
            else:
                current, handler = H('<span class="muted">idle</span>'), ""
            state = status("stopping" if r.state != "running" else r.state)
            if r.stopping_reason is not None:
                state += H('<br><small class="muted">%s, since %s</small>') % (
                    e(r.stopping_reason), when(r.stopping_since))
            cells.append([e(r.id), e(r.kind), e(r.pid), state,
                          H(" ").join(H('<a class="queue" href="/tasks%s">%s</a>') % (
                              e(query(queue=name)), e(name)) for name in served.get(r.id, ())),
                          current, handler,
                          progress(r.progress), elapsed,
                          H("%s MB") % e(r.rss_mb) if r.rss_mb is not None else "",
                          e(r.runs_done), e(ago(r.heartbeat_on, at)), e(r.code_version or "")])
        parts.append(H('<section class="card"><h2>%s</h2>%s</section>') % (e(host), table(
            ["ID", "Kind", "PID", "State", "Queues", "Current run", "Handler", "Progress",
             "Elapsed", "RSS", "Runs done", "Heartbeat", "Code version"], cells,
            css="runners")))
    return H("").join(parts) + code_versions_card(view)


def code_versions_card(view: View) -> str:
    """Per code version: runners running it, durable tasks still open that started under
    it, drained or not (`taskrunner versions`)."""
    rows = [[e(v.code_version), e(v.runners), e(v.open_tasks), when(v.first_started_on),
             when(v.last_started_on), "yes" if v.drained else "no"]
            for v in versions.code_versions(view.store)]
    return H('<section class="card"><h2>Code versions</h2>%s</section>') % table(
        ["Code version", "Runners", "Open tasks", "First started", "Last started", "Drained"],
        rows, "no runner has recorded a code version", css="versions")


def runners(view: View, params: Mapping[str, str]) -> str:
    return H('<div id="runners-live" data-live>%s</div>') % runners_live(view, params)


# -- tasks ----------------------------------------------------------------------------------

def _filter_form(params: Mapping[str, str]) -> str:
    options = H("").join(H('<option value="%s"%s>%s</option>') % (
        e(s), " selected" if params.get("status") == s else "", e(s))
        for s in ("",) + summaries.STATUS_FILTERS)
    field = H('<label>%s <input name="%s" value="%s" placeholder="%s"%s></label>')
    return (H('<form method="get" action="/tasks" class="filters" id="task-filters">'
            '<label>Status <select name="status">%s</select></label>%s%s%s%s%s%s%s'
            '<button type="submit">Filter</button> <a href="/tasks">clear</a></form>') % (
                options,
                field % ("Data contains", "data", e(params.get("data", "")), "order_id=44",
                         H(' size="16"')),
                field % ("Handler", "handler", e(params.get("handler", "")),
                         "taskrunner.handlers.Echo", H(' size="28"')),
                field % ("Queue", "queue", e(params.get("queue", "")), "default",
                         H(' size="10"')),
                field % ("Error code", "error", e(params.get("error", "")), "code",
                         H(' size="12"')),
                field % ("Queued since", "since", e(params.get("since", "")),
                         "2026-01-31T08:00 (UTC)", H(' size="20"')),
                field % ("until", "until", e(params.get("until", "")), "ISO 8601 (UTC)",
                         H(' size="20"')),
                field % ("Periodic task", "periodic", e(params.get("periodic", "")), "name",
                         H(' size="16"'))))


def task_row(t: Any) -> list:
    outcome = ""
    if t.last_error_code:
        outcome = H('<span class="err">%s</span> %s') % (e(t.last_error_code),
                                                      short(t.last_error_message or "", 60))
    elif t.status == "waiting":
        outcome = _waiting(t)
    elif t.blocked_by:
        outcome = e("; ".join(b["text"] for b in t.blocked_by))
    return [H('<a href="/tasks/%d">%d</a>') % (t.id, t.id), e(t.handler),
            H('<a href="/tasks%s">%s</a>') % (e(query(queue=t.queue)), e(t.queue)),
            status(t.status),
            H("%d / %d") % (t.runs_failed, t.max_retries), H("%d") % t.runs,
            when(t.scheduled_on), when(t.next_run_on), when(t.finished_on), outcome]


def tasks(view: View, params: Mapping[str, str]) -> str:
    chosen = task_filter(view.store, params)
    before = params.get("before", "").strip()
    result = summaries.find_tasks(view.store, chosen, id_param(before, "before")
                                  if before else None, PAGE_SIZE)
    rows = [task_row(t) for t in result.tasks]
    more = (H('<a class="older" href="/tasks%s">Older →</a>') % e(query(
        before=result.next_before, **filter_params(params)))) if result.next_before else ""
    newest = H('<a href="/tasks%s">← Newest</a>') % e(query(**filter_params(params))) \
        if before else ""
    if result.searched_from is not None and result.next_before == result.searched_from:
        newest += H(' <span class="muted">data searched in tasks from id %d on; Older → '
                    'searches the tasks before it</span>') % result.searched_from
    bounded = "" if result.searched_from is None or chosen.data is None else H(
        '<p class="muted" id="search-bounded">%s</p>') % data_search.unindexed_note(
            chosen.data[0])
    bulk = ""
    if not view.read_only and result.tasks:
        fields = filter_params(params)
        bulk = (H('<div class="bulk">Every task matching this filter: %s %s</div>')
                % (view.action("/tasks/bulk", "Retry all…", dict(fields, action="retry")),
                   view.action("/tasks/bulk", "Cancel all…", dict(fields, action="cancel"),
                               css="danger") + " " +
                   view.action("/tasks/bulk", "Delete all ended…", dict(fields, action="delete"),
                               css="danger")))
    return H('%s%s%s%s<p class="pager">%s %s</p>') % (
        _filter_form(params), bounded, bulk,
        table(["Task", "Handler", "Queue", "Status", "Failures", "Runs", "Scheduled",
               "Next run", "Finished", "Error / why waiting"], rows, "no task matches this filter",
              css="tasks", labelled=True),
        newest, more)


def confirm_bulk(view: View, params: Mapping[str, str], count: int, limit: int) -> str:
    action = params["action"]
    fields = dict(filter_params(params), action=action, confirm="yes")
    described = H(", ").join(H("%s %s") % (k, v) for k, v in filter_params(params).items()) \
        or "no filter: every task"
    capped = H(" (the newest %d at a time)") % limit if count >= limit else ""
    return (H('<section class="card confirm"><p>%s <strong>%d</strong> task(s)%s matching: %s?'
            '</p><p>Tasks that cannot be %s (wrong state) are left as they are.</p>%s '
            '<a href="/tasks%s">Back</a></section>') % (
                e(action.capitalize()), count, e(capped), e(described),
                {"retry": "retried", "cancel": "cancelled",
                 "delete": "deleted (not ended)"}[action],
                view.action("/tasks/bulk", H("Yes, %s %d task(s)") % (action, count), fields,
                            css="" if action == "retry" else "danger"),
                e(query(**filter_params(params)))))


def confirm_delete(view: View, task_id: int) -> str:
    return (H('<section class="card confirm"><p>Delete task %d and its runs? This cannot be '
            'undone; a task that has not ended is left as it is.</p>%s <a href="/tasks/%d">'
            'Back</a></section>') % (task_id, view.action(
                H("/tasks/%d/delete") % task_id, H("Yes, delete task %d") % task_id,
                {"confirm": "yes"}, css="danger"), task_id))


def _waiting(t: Any) -> str:
    """What a waiting task waits for: its parents, an event (until its timeout), or a
    sleep's end."""
    if t.status != "waiting":
        return ""
    if t.waiting_parents:
        return reads.parents_text(t.waiting_parents)
    if t.waiting_for:
        return H("event <code>%s</code>%s") % (e(t.waiting_for), H(" until %s") % when(
            t.waiting_until) if t.waiting_until else "")
    return H("until %s") % when(t.waiting_until)


def _blocked(t: Any) -> str:
    """Why a task that has not ended is not running (reads.blocked_by), one reason a line."""
    return H("<br>").join(H('<span class="why why-%s">%s</span>') % (b["reason"], b["text"])
                          for b in t.blocked_by or [])


def steps_table(view: View, steps: Any) -> str:
    rows = [[e(s.name), e(s.kind), status(s.status), e(s.run_id), e(s.attempt),
             when(s.finished_on), span(s.duration),
             pretty(view.shown(s.result)) if s.result is not None else ""] for s in steps]
    return H('<h2>Steps</h2>%s') % table(["Step", "Kind", "Status", "Run", "Attempt", "Finished",
                                        "Duration", "Result"], rows, "no step", css="steps")


def task_live(view: View, params: Mapping[str, str], task_id: int) -> str:
    t = reads.get_task(view.store, task_id, with_steps=True)
    runs = reads.runs_of(view.store, task_id)
    facts = [("Status", status(t.status)), ("Waiting because", _blocked(t)),
             ("Handler", e(t.handler)),
             ("Queue", H('<a href="/tasks%s">%s</a>') % (e(query(queue=t.queue)), e(t.queue))),
             ("Priority", e(t.priority)),
             ("Queued", H("%s by %s") % (when(t.queued_on), e(t.queued_by or "-"))),
             ("Scheduled", when(t.scheduled_on)), ("Next run", when(t.next_run_on)),
             ("Finished", when(t.finished_on)),
             ("Runs", H("%d, %d failed in a row of %d allowed, %d crashed in a row (%d crashes "
                      "in all)") % (t.runs, t.runs_failed, t.max_retries, t.runs_crashed,
                                   t.crash_count)),
             ("Run timeout", span(t.run_timeout)), ("Max runtime", span(t.max_runtime)),
             ("Unique key", e(t.unique_key)),
             ("Debounce key", H("%s <small class=\"muted\">%d enqueue%s landed in it</small>") % (
                 t.debounce_key, t.debounce_enqueues, "" if t.debounce_enqueues == 1 else "s")
              if t.debounce_key is not None else ""),
             ("Periodic task", e(t.periodic_task_id)),
             ("Last error", H('<span class="err">%s</span> %s') % (
                 e(t.last_error_code), e(t.last_error_message)) if t.last_error_code else ""),
             ("Waiting for", _waiting(t)),
             ("Workflow", H('<a href="/workflows/%d">workflow %d</a>') % (
                 t.workflow_id, t.workflow_id) if t.workflow_id is not None else ""),
             ("Code version", e(t.code_version or "")),
             ("Checkpoint", H("%s<small class=\"muted\">stored %s</small>") % (
                 pretty(view.shown(t.checkpoint)), when(t.checkpoint_on))
              if t.checkpoint_on is not None else "")]
    facts_html = H("").join(H("<dt>%s</dt><dd>%s</dd>") % (k, v) for k, v in facts if v)
    rows = []
    # Newest first: the latest run with a traceback shows it; older runs with the same one
    # are listed under it (a task retried 20 times for one cause shows it once).
    by_traceback: Dict[str, list] = OrderedDict()
    for r in reversed(runs):
        error = ""
        if r.error_code:
            error = H('<span class="err">%s</span><pre class="error">%s</pre>') % (
                e(r.error_code), e(r.error_message))
        if r.traceback:
            by_traceback.setdefault(r.traceback, []).append(r)
            error += H('<a href="#traceback-%d">traceback ↓</a>') % by_traceback[r.traceback][0].id
        # A run being stopped (cancelled; timed out, its handler not returned yet) shows as
        # stopping, why and since when, until its runner is done with it.
        shown_run = status(reads.STOPPING) + H('<br><small class="muted">%s, since %s</small>') % (
            e(r.stopping_reason), when(r.stopping_since)) if r.stopping_reason \
            else status(r.status)
        rows.append([e(r.attempt), e(r.id), shown_run, e(r.runner_id),
                     progress(r.percent_completed), when(r.created_on), when(r.started_on),
                     when(r.finished_on), span(r.duration),
                     pretty(view.shown(r.results)) if r.results is not None else "", error])
    tracebacks = []
    for text, same in by_traceback.items():
        latest = same[0]
        repeats = (H('<p class="muted">The same traceback in %d earlier run%s: attempt%s %s.</p>')
                   % (len(same) - 1, "" if len(same) == 2 else "s", "" if len(same) == 2
                      else "s", H(", ").join(H("%d") % r.attempt for r in reversed(same[1:])))
                   if len(same) > 1 else "")
        tracebacks.append(H('<section class="card" id="traceback-%d"><h3>Run %d (attempt %d): '
                          '<span class="err">%s</span></h3><pre class="traceback">%s</pre>%s'
                          '</section>') % (latest.id, latest.id, latest.attempt,
                                          e(latest.error_code), e(text), repeats))
    return (H('<dl class="facts">%s</dl><h2>Runs</h2>%s%s%s') % (facts_html, table(
        ["Attempt", "Run", "Status", "Runner", "Progress", "Created", "Started", "Finished",
         "Duration", "Results", "Error"], rows, "no run yet", css="runs"),
        steps_table(view, t.steps) if t.steps else "",
        H('<h2>Tracebacks</h2>%s') % H("").join(tracebacks) if tracebacks else ""))


def task(view: View, params: Mapping[str, str], task_id: int) -> str:
    t = reads.get_task(view.store, task_id)
    actions = ""
    if t.status in ("retrying", "given-up"):
        actions += view.action(H("/tasks/%d/retry") % t.id, "Retry")
    if t.finished_on is None and t.status != "cancelled":
        actions += view.action(H("/tasks/%d/cancel") % t.id, "Cancel", css="danger")
    if t.finished_on is not None:
        actions += view.action(H("/tasks/%d/delete") % t.id, "Delete…", css="danger")
    return (H('<p class="actions">%s</p><div id="task-live" data-live>%s</div>%s<h2>Data</h2>%s')
            % (actions, task_live(view, params, task_id), rerun_part(view, t),
               pretty(view.shown(t.data))))


def rerun_part(view: View, t: Any) -> str:
    """Under a durable task that succeeded or gave up: a form to run it again from one of its
    steps, with a reason; and the re-runs asked for so far."""
    reruns = reads.reruns_of(view.store, t.id)
    done = table(["Requested", "By", "From step", "Steps dropped", "Run", "Reason"],
                 [[when(r.requested_on), e(r.requested_by), e(r.from_step), e(r.steps_dropped),
                   e(r.run_id), e(r.reason)] for r in reruns], "", css="reruns") \
        if reruns else ""
    steps = reads.steps_of(view.store, t.id, known=True) \
        if t.status in ("success", "given-up") and not view.read_only else []
    form = H('<form method="post" action="/tasks/%d/rerun" class="rerun"><input type="hidden" '
             'name="csrf" value="%s"><label>From step <select name="step">%s</select></label> '
             '<label>Reason <input name="reason" maxlength="1000" size="40"></label> '
             '<button type="submit">Re-run from step</button></form>'
             '<p class="muted">The steps before it keep their results; it and the later ones '
             'run again, as a new run of this task.</p>') % (
        t.id, view.csrf, H("").join(H('<option value="%s">%s</option>') % (s.name, s.name)
                                    for s in steps)) if steps else ""
    return H("<h2>Re-run from a step</h2>%s%s") % (form, done) if form or done else ""


# -- workflows ------------------------------------------------------------------------------

STATE_ORDER = ("waiting", "scheduled", "running", "retrying", "success", "given-up",
               "cancelled")


def _levels(tasks: Any) -> Dict[int, int]:
    """Each task's level in the graph: 0 for a task that runs after none of those shown,
    else one more than its deepest parent's."""
    level = {t.id: 0 for t in tasks}
    changed, passes = True, 0
    while changed and passes <= len(level):
        changed, passes = False, passes + 1
        for t in tasks:
            deepest = max((level[p] + 1 for p in t.after if p in level), default=0)
            if deepest != level[t.id]:
                level[t.id], changed = deepest, True
    return level


def workflow_graph(tasks: Any) -> str:
    """The graph as a nested list: a level per item, each task with its state and links to
    the tasks it runs after."""
    level = _levels(tasks)
    by_level: Dict[int, list] = OrderedDict()
    for t in sorted(tasks, key=lambda t: (level[t.id], t.id)):
        by_level.setdefault(level[t.id], []).append(t)
    items = []
    for depth, members in by_level.items():
        rows = H("").join(
            H('<li class="wf-task" id="wf-task-%d"><a href="/tasks/%d">task %d</a> %s '
            '<small class="muted">%s</small>%s%s</li>') % (
                t.id, t.id, t.id, status(t.state), e(t.handler),
                H(' <span class="err">%s</span>') % e(t.error_code) if t.error_code else "",
                H('<br><small>after %s%s</small>') % (H(", ").join(
                    H('<a href="/tasks/%d">%d</a>') % (p, p) for p in t.after[:AFTER_SHOWN]),
                    H(" and %d more") % (len(t.after) - AFTER_SHOWN)
                    if len(t.after) > AFTER_SHOWN else "") if t.after else "")
            for t in members)
        items.append(H('<li class="level"><span class="level-name">level %d · %d task%s</span>'
                     '<ol class="tasks">%s</ol></li>') % (depth + 1, len(members),
                                                         "" if len(members) == 1 else "s", rows))
    return H('<ol class="graph">%s</ol>') % H("").join(items)


def workflow_live(view: View, params: Mapping[str, str], workflow_id: int) -> str:
    info = workflows.workflow_info(view.store, workflow_id, graph=False)
    tasks = workflows.workflow_tasks(view.store, workflow_id, GRAPH_SHOWN)
    order = [w for w in STATE_ORDER if w in info.counts] + sorted(
        w for w in info.counts if w not in STATE_ORDER)
    tiles = H("").join(H('<div class="tile tile-%s"><span class="n">%d</span><span>%s</span></div>')
                    % (e(w), info.counts[w], e(w)) for w in order)
    facts = [("Name", e(info.name or "")), ("Outcome", status(info.outcome)),
             ("Progress", H("%s %d of %d final") % (progress(int(info.progress * 100)),
                                                 info.finished, info.total)),
             ("Created", when(info.created_on))]
    shown = (H('<p class="muted">the first %d of %d tasks</p>') % (len(tasks), info.total)
             if info.total > len(tasks) else "")
    return (H('<section class="tiles" id="workflow-counts">%s</section>%s'
            '<dl class="facts">%s</dl><section class="card" id="workflow-graph"><h2>Graph '
            '<small>each task after the ones it runs after</small></h2>%s%s</section>') % (
                tiles, status_bar({w: info.counts[w] for w in order}),
                H("").join(H("<dt>%s</dt><dd>%s</dd>") % (k, v) for k, v in facts if v),
                shown, workflow_graph(tasks)))


def _cancel_workflow(view: View, info: Any) -> str:
    """The Cancel button of a workflow that has not ended (`workflow cancel ID`)."""
    return "" if info.done else view.action(H("/workflows/%d/cancel") % info.id, "Cancel",
                                            css="danger")


def workflow(view: View, params: Mapping[str, str], workflow_id: int) -> str:
    info = workflows.workflow_info(view.store, workflow_id, graph=False)
    return H('<p class="actions">%s</p><div id="workflow-live" data-live>%s</div>') % (
        _cancel_workflow(view, info), workflow_live(view, params, workflow_id))


def workflows_list(view: View, params: Mapping[str, str]) -> str:
    """Workflows newest first: name, outcome, progress, counts per state, created; a Cancel
    button on each that has not ended."""
    before = params.get("before", "").strip()
    infos, next_before = workflows.list_workflows(
        view.store, id_param(before, "before") if before else None, PAGE_SIZE)
    rows = []
    for info in infos:
        order = [w for w in STATE_ORDER if w in info.counts] + sorted(
            w for w in info.counts if w not in STATE_ORDER)
        rows.append([H('<a href="/workflows/%d">%d</a>') % (info.id, info.id),
                     e(info.name or ""), status(info.outcome),
                     H("%s %d of %d final") % (progress(int(info.progress * 100)),
                                               info.finished, info.total),
                     H(" · ").join(H('%d <span class="status status-%s">%s</span>')
                                   % (info.counts[w], w, w) for w in order),
                     when(info.created_on), _cancel_workflow(view, info)])
    more = (H('<a class="older" href="/workflows%s">Older →</a>') % e(query(
        before=next_before))) if next_before else ""
    newest = H('<a href="/workflows">← Newest</a>') if before else ""
    return H('%s<p class="pager">%s %s</p>') % (table(
        ["Workflow", "Name", "Outcome", "Progress", "Tasks", "Created", ""], rows,
        "no workflow yet", css="workflows"), newest, more)


# -- failures and periodic tasks ---------------------------------------------------------------

def failures(view: View, params: Mapping[str, str]) -> str:
    handler = params.get("handler", "").strip() or None
    groups = summaries.failure_groups(view.store, handler)
    rows = [[e(g.handler), H('<span class="err">%s</span>') % e(g.error_code or "-"),
             H('<a href="/tasks%s">%d</a>') % (e(query(status="given-up", handler=g.handler,
                                                   error=g.error_code)), g.given_up),
             H('<a href="/tasks%s">%d</a>') % (e(query(status="retrying", handler=g.handler,
                                                   error=g.error_code)), g.retrying),
             H('<a href="/tasks/%d">task %d</a> %s') % (g.latest_task_id, g.latest_task_id,
                                                     when(g.latest_on)),
             H('<pre class="error">%s</pre>%s') % (e(g.latest_error_message), (
                 H('<details><summary>traceback</summary><pre class="traceback">%s</pre>'
                 '</details>') % e(g.latest_traceback)) if g.latest_traceback else "")]
            for g in groups]
    form = (H('<form method="get" action="/failures" class="filters"><label>Handler <input '
            'name="handler" value="%s" size="28"></label><button type="submit">Filter</button>'
            ' <a href="/failures">clear</a></form>') % e(handler or ""))
    return form + table(["Handler", "Error code", "Given up", "Retrying", "Latest",
                         "Latest error"], rows, "no failed task", css="failures")


def _stats(p: Any) -> str:
    """Its lifetime counts; the times and durations of the runs rotation has kept."""
    st = p.stats
    submitted = H("%d submitted, %d skipped") % (p.submitted, p.skipped)
    if st is None or not p.run_count:
        return H('<span class="muted">no run yet</span><br><small>%s</small>') % submitted
    parts = [H('%d run%s: <span class="ok">%d ok</span>')
             % (p.run_count, "" if p.run_count == 1 else "s", p.success_count)]
    if p.error_count:
        parts.append(H('<span class="err">%d failed</span>') % p.error_count)
    if p.crash_count:
        parts.append(H('<span class="err">%d crashed</span>') % p.crash_count)
    timing = H("avg %s · p95 %s") % (span(st.avg_duration), span(st.p95_duration)) \
        if st.avg_duration is not None else ""
    success = H("last success %s") % ago(st.last_success) if st.last_success else "never succeeded"
    return H('<span class="nowrap">%s</span><br><small>%s%s<br>%s</small>') % (
        H(" · ").join(parts), e(timing) + H("<br>") if timing else "", e(success), submitted)


def _alter_form(view: View, p: Any) -> str:
    """A periodic task's "Alter" form: a field left empty keeps its value. Nothing is
    filled in: the data shown is masked, and sent back it would overwrite the real one. A
    periodic task from the config file takes its next start alone."""
    if view.read_only:
        return ""
    fields = [("next_start", "Next start", "ISO 8601, e.g. 2026-01-31T08:00Z")]
    if p.source != "config":
        fields = [("timer", "Timer", p.timer), fields[0],
                  ("priority", "Priority", str(p.priority)),
                  ("max_retries", "Max retries", str(p.max_retries or "")),
                  ("max_runtime", "Max runtime", str(p.max_runtime or "")),
                  ("queue", "Queue", p.queue),
                  ("jitter", "Jitter", "%gs" % p.jitter if p.jitter else "none, e.g. 5min"),
                  ("data", "Data (JSON)", "unchanged")]
    inputs = H("").join(H('<label>%s <input name="%s" placeholder="%s"></label>')
                        % (label, key, hint) for key, label, hint in fields)
    if p.source != "config":
        inputs += H("").join(
            H('<label>%s <select name="%s"><option value="">unchanged</option><option value="on">'
              'on</option><option value="off">off</option></select></label>') % (label, key)
            for key, label in (("enabled", "Enabled"), ("resume", "Resume from checkpoint")))
    return H('<details class="alter"><summary>Alter</summary><form method="post" '
             'action="/periodic/alter"><input type="hidden" name="csrf" value="%s"><input '
             'type="hidden" name="name" value="%s">%s<button type="submit">Alter</button></form>'
             '</details>') % (view.csrf, p.name, inputs)


def _backfill_form(view: View, p: Any) -> str:
    """A periodic task's "Backfill" form: `taskrunner periodic backfill NAME --from --to`."""
    if view.read_only or p.timer.lower().startswith("after "):
        return ""
    return H('<details class="alter"><summary>Backfill</summary><form method="post" '
             'action="/periodic/backfill"><input type="hidden" name="csrf" value="%s"><input '
             'type="hidden" name="name" value="%s"><label>From <input name="from" placeholder='
             '"ISO 8601, e.g. 2026-01-31T00:00Z" required></label><label>To <input name="to" '
             'placeholder="ISO 8601, e.g. 2026-02-01T00:00Z" required></label><button '
             'type="submit">Backfill</button></form></details>') % (view.csrf, p.name)


def backfill_range(form: Mapping[str, str]) -> Tuple[datetime, datetime]:
    """The Backfill form's from and to; InputError for one missing or not a time."""
    start, end = _time_param(form, "from"), _time_param(form, "to")
    if start is None or end is None:
        raise InputError("backfill needs a from and a to time")
    return start, end


def alter_changes(form: Mapping[str, str]) -> Dict[str, Any]:
    """What the "Alter" form asks to change, as alter_periodic takes it: the fields filled
    in; InputError for one that is not what it should be."""
    changes: Dict[str, Any] = {}
    for key in ("timer", "queue", "max_runtime", "jitter"):
        if form.get(key, "").strip():
            changes[key] = form[key].strip()
    for key in ("priority", "max_retries"):
        text = form.get(key, "").strip()
        if text:
            try:
                changes[key] = int(text)
            except ValueError:
                raise InputError("%s must be an integer, not %r" % (key, text)) from None
    if form.get("data", "").strip():
        try:
            changes["data"] = json.loads(form["data"])
        except ValueError as exc:
            raise InputError("data: invalid JSON: %s" % exc) from None
    for key in ("enabled", "resume"):
        if form.get(key) in ("on", "off"):
            changes[key] = form[key] == "on"
    next_start = _time_param(form, "next_start")
    if next_start is not None:
        changes["next_start"] = next_start
    return changes


def periodic(view: View, params: Mapping[str, str]) -> str:
    at = utcnow()
    group = params.get("group", "").strip()
    every = reads.list_periodic(view.store)
    groups = sorted({p.group for p in every if p.group} | ({group} if group else set()))
    rows = []
    for p in every:
        if group and p.group != group:
            continue
        toggle = view.action("/periodic/run", "Run now", {"name": p.name}) + view.action(
            H("/periodic/%s") % ("disable" if p.enabled else "enable"),
            "Disable" if p.enabled else "Enable", {"name": p.name},
            css="danger" if p.enabled else "") + _alter_form(view, p) + _backfill_form(view, p)
        name = H('<a class="nowrap" href="/tasks%s">%s</a>') % (e(query(periodic=p.name)),
                                                             e(p.name))
        if p.subject:
            name += H('<br><small class="muted">%s</small>') % e(p.subject)
        name += H('<br><small class="muted">%s</small>') % e(p.handler)
        # At 1280 px the table fits: the handler under the name, the last run's status with
        # its time, the enabled state as the next due time ("disabled") and the toggle.
        rows.append([name,
                     H('<a href="/periodic%s">%s</a>') % (e(query(group=p.group)), e(p.group))
                     if p.group else "",
                     H('<code class="wrap">%s</code>%s%s') % (
                         e(p.timer), H('<br><small class="muted">%s</small>') % e(p.timezone)
                         if p.timezone else "",
                         H('<br><small class="muted">jitter %s</small>') % span(p.jitter)
                         if p.jitter else ""),
                     H("%s <small>%s</small>") % (when(p.nextrun), e(ago(p.nextrun, at)))
                     if p.enabled else H('<span class="muted">disabled</span>'),
                     H("%s<br>%s") % (status(p.last_status), when(p.last_run)) if p.last_run
                     else H('<span class="muted">never</span>'),
                     H("%d%s") % (p.consecutive_failures, H(" (%d crashed)") % p.consecutive_crashes
                               if p.consecutive_crashes else ""),
                     _stats(p), toggle])
    options = H("").join(H('<option value="%s"%s>%s</option>') % (
        e(g), " selected" if g == group else "", e(g) or "every group") for g in [""] + groups)
    form = (H('<form method="get" action="/periodic" class="filters" id="periodic-filters">'
            '<label>Group <select name="group">%s</select></label><button type="submit">'
            'Filter</button> <a href="/periodic">clear</a></form>') % options)
    return form + table(["Name", "Group", "Timer", "Next due", "Last run",
                         "Failures in a row", "Runs", ""],
                        rows, "no periodic task" + (H(" in group %s") % group if group else ""),
                        css="periodic")


LIVE = {"overview": overview_live, "runners": runners_live}


def live_parts(view: View, params: Mapping[str, str]) -> Dict[str, str]:
    """The live parts of a page, by element id, for ``/api/parts?page=...``."""
    name = params.get("page", "")
    if name == "task":
        task_id = id_param(params.get("id", ""), "task id")
        return {"task-live": task_live(view, params, task_id)}
    if name == "workflow":
        workflow_id = id_param(params.get("id", ""), "workflow id")
        return {"workflow-live": workflow_live(view, params, workflow_id)}
    if name not in LIVE:
        raise InputError("no live parts for page %r" % name)
    return {"%s-live" % name: LIVE[name](view, params)}
