"""Prometheus metrics: a collector that reads the database at scrape time (through the read
functions), so every figure, counters included, comes from what the database holds and
survives any restart of the process serving it.

Whoever adds tasks picks queue names, and whoever defines periodic tasks their names: the
per-queue and per-periodic-task series are the configured ones and up to ``[dashboard]
metrics_series`` more (the busiest queues; the periodic tasks failing most, then due
soonest), the rest summed under the name ``(other)`` (`summaries.queue_figures`,
`summaries.periodic_figures`), so a scrape stays small whatever they pick.

The run counters and the duration histogram are totals over the runs in the database,
which the dashboard keeps between scrapes and brings up to date from the runs finished
since (`summaries.RunTotals`): they count a run about ten seconds after it ended. A
restarted dashboard reads them again from the database (the same figures, less what
rotation deleted meanwhile, which Prometheus' ``rate()`` treats as a counter reset).
"""
from typing import Any, Iterator, Optional

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                    HistogramMetricFamily)

from ..config import DEFAULT_QUEUE
from ..reads import records as reads, summaries, versions
from .html import now


class StoreCollector:
    """Every metric of one store, read when Prometheus scrapes."""

    def __init__(self, store: Any, totals: Optional[summaries.RunTotals] = None,
                 succeeded: Optional[int] = None):
        self.store, self.succeeded = store, succeeded
        # The dashboard keeps its totals between scrapes; `taskrunner metrics` reads all.
        self.totals = totals or summaries.RunTotals(margin=0.0)

    def collect(self) -> Iterator[Any]:
        store = self.store
        tasks = GaugeMetricFamily("taskrunner_tasks", "Tasks by status.", labels=["status"])
        for status, n in summaries.status_counts(store, self.succeeded).items():
            tasks.add_metric([status], n)
        yield tasks

        ended = CounterMetricFamily("taskrunner_runs_ended", "Runs ended, by handler and final "
                                    "status (runs in the database).", labels=["handler", "status"])
        ended_runs, histograms = self.totals.refresh(store)
        for handler, status, n in ended_runs:
            ended.add_metric([handler, status], n)
        yield ended

        duration = HistogramMetricFamily("taskrunner_run_duration_seconds", "Duration of the "
                                         "finished runs, by handler.", labels=["handler"])
        for h in histograms:
            buckets = [(repr(float(b)), n) for b, n in zip(summaries.DURATION_BUCKETS,
                                                            h.buckets)]
            duration.add_metric([h.handler], buckets + [("+Inf", h.count)], h.total_seconds)
        yield duration

        yield GaugeMetricFamily("taskrunner_queue_lag_seconds", "Seconds since the oldest "
                                "due run of a queue not paused was due (0 when none waits).",
                                value=summaries.queue_lag(store))

        per_queue = [GaugeMetricFamily("taskrunner_queue_%s" % name, text, labels=["queue"])
                     for name, text in (
                         ("scheduled", "Tasks scheduled in a queue, due or not (as "
                          "taskrunner tasks --status scheduled --queue NAME counts them)."),
                         ("running", "Runs of a queue running now."),
                         ("lag_by_queue_seconds", "Seconds since a queue's oldest waiting "
                          "run was due (0 when none waits or it is paused)."),
                         ("paused", "1 if the queue is paused (on every host); for "
                          "(other), how many are."),
                         ("paused_seconds", "Seconds since the queue was paused (0 when it "
                          "is not; for (other), the longest)."))]
        limit = store.config.dashboard.metrics_series
        named = sorted(set(store.config.queues) | {DEFAULT_QUEUE})
        for q in summaries.queue_figures(store, named, limit):
            for family, value in zip(per_queue, (q.scheduled, q.running, q.lag, q.paused,
                                                 q.paused_seconds)):
                family.add_metric([q.name], value)
        yield from per_queue

        rates = [GaugeMetricFamily("taskrunner_rate_%s" % name, text, labels=["kind", "name"])
                 for name, text in (
                     ("limit_per_second", "A queue's or a rate key's rate limit, per second."),
                     ("allowance", "Tokens in a rate limit's bucket now: runs that may start "
                      "at once."),
                     ("throttled_runs", "Runs waiting that an empty bucket holds back."))]
        for b in reads.rate_limits(store)["buckets"]:
            for family, value in zip(rates, (b["rate"], b["allowance"], b["throttled"])):
                family.add_metric([b["kind"], b["name"]], value)
        yield from rates
        yield GaugeMetricFamily("taskrunner_tasks_debouncing", "Tasks whose debounce window "
                                "is open: a later enqueue of their debounce key lands in them.",
                                value=summaries.debouncing(store))
        tenants = GaugeMetricFamily("taskrunner_queue_tenants_waiting", "Tenants with a run "
                                    "waiting in a queue with fair_by.", labels=["queue"])
        for q in reads.queue_stats(store):
            if q.tenants_waiting is not None:
                tenants.add_metric([q.name], q.tenants_waiting)
        yield tenants

        alive = GaugeMetricFamily("taskrunner_runners_alive", "Runners registered running, "
                                  "by host.", labels=["host"])
        rss = GaugeMetricFamily("taskrunner_runners_rss_bytes", "Resident memory of the "
                                "running runners, by host.", labels=["host"])
        busy = GaugeMetricFamily("taskrunner_runners_busy", "Runners executing a run now, "
                                 "by host (alive minus busy: idle runners).", labels=["host"])
        hosts: dict = {}
        for r in reads.running_runners(store):
            if r.kind == "runner":
                count, working, memory = hosts.get(r.host, (0, 0, 0.0))
                hosts[r.host] = (count + 1, working + (r.run_id is not None),
                                 memory + (r.rss_mb or 0.0) * 1048576)
        for host, (count, working, memory) in sorted(hosts.items()):
            alive.add_metric([host], count)
            busy.add_metric([host], working)
            rss.add_metric([host], memory)
        yield alive
        yield busy
        yield rss

        open_tasks = GaugeMetricFamily("taskrunner_code_version_open_tasks", "Durable tasks "
                                       "not ended, by the code version they started under "
                                       "(the newest versions not drained; older ones summed "
                                       "under (other)).", labels=["code_version"])
        on_version = GaugeMetricFamily("taskrunner_code_version_runners", "Runners running, "
                                       "by the version of the handler code they run.",
                                       labels=["code_version"])
        for version, (tasks_open, running) in versions.metric_figures(
                versions.code_versions(store)).items():
            open_tasks.add_metric([version], tasks_open)
            on_version.add_metric([version], running)
        yield open_tasks
        yield on_version

        until = GaugeMetricFamily("taskrunner_periodic_seconds_until_due", "Seconds until a "
                                  "periodic task is next due (negative: overdue).",
                                  labels=["name"])
        failures = GaugeMetricFamily("taskrunner_periodic_consecutive_failures", "Failed runs "
                                     "in a row of a periodic task's tasks (for (other), the "
                                     "most).", labels=["name"])
        enabled = GaugeMetricFamily("taskrunner_periodic_enabled", "1 if the periodic task is "
                                    "enabled; for (other), how many are.", labels=["name"])
        at = now()
        for p in summaries.periodic_figures(store, limit):
            if p.enabled and p.nextrun is not None:
                until.add_metric([p.name], (p.nextrun - at).total_seconds())
            failures.add_metric([p.name], p.consecutive_failures)
            enabled.add_metric([p.name], p.enabled)
        yield until
        yield failures
        yield enabled


def exposition(store: Any, totals: Optional[summaries.RunTotals] = None,
               succeeded: Optional[int] = None) -> bytes:
    """The metrics of `store` in the Prometheus text format."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StoreCollector(store, totals, succeeded))  # type: ignore[arg-type]
    return generate_latest(registry)
