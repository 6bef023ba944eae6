"""Flow control in the claim (issue 27): rate limits per queue and per key kept by the
database's token buckets, round-robin fairness between tenants, priority aging — on all three
databases, with the time injected (the accuracy with real processes: test_flow_accuracy.py)."""
from datetime import timedelta

import pytest

from conftest import ALL_BACKENDS, Database
from taskrunner import Config
from taskrunner.errors import ConfigError, InputError
from taskrunner.fleet import liveness
from taskrunner.runner.loop import Runner
from taskrunner.runs import enqueue, flow, lifecycle
from taskrunner.runs import sql as runs_sql
from taskrunner.store.models import utcnow

from test_queue import _Statements

ECHO = "taskrunner.handlers.Echo"


def _claims(store, runner_id, queues, now, count):
    """Up to `count` claims in turn at `now`: the task ids claimed (None for a claim that
    found nothing)."""
    out = []
    for _ in range(count):
        claimed = lifecycle.claim(store, runner_id, queues, now=now)
        out.append(None if claimed is None else claimed.task_id)
    return out


def test_queue_rate_allows_the_burst_then_one_token_per_interval(database):
    queue = database.queue(queues={"api": {"rate": "10/s", "burst": 3}})
    store = queue.store
    ids = [queue.add_task(ECHO, queue="api") for _ in range(10)]
    runner_id = liveness.register(store, serving=("api",)).id
    flow.prepare(store, ["api"])
    t0 = utcnow()
    # A full bucket: the burst at once, then nothing until the next token.
    assert _claims(store, runner_id, ["api"], t0, 4) == ids[:3] + [None]
    assert flow.throttled_for(store, ["api"], now=t0) == pytest.approx(0.1, abs=0.01)
    assert _claims(store, runner_id, ["api"], t0 + timedelta(seconds=0.05), 1) == [None]
    assert _claims(store, runner_id, ["api"], t0 + timedelta(seconds=0.11), 2) == [ids[3], None]
    # A long quiet spell refills the bucket only up to its burst.
    later = t0 + timedelta(seconds=60)
    assert _claims(store, runner_id, ["api"], later, 4) == ids[4:7] + [None]
    [bucket] = flow.buckets(store, now=later)
    assert (bucket["kind"], bucket["name"], bucket["limit"]) == ("queue", "api", "10/s")
    assert bucket["allowance"] < 1 and bucket["throttled"] == 3
    queue.close()


def test_a_throttled_key_never_delays_runs_without_it(database):
    queue = database.queue()
    store = queue.store
    queue.set_rate_limit("api:stripe", "1/min", burst=1)
    keyed = [queue.add_task(ECHO, rate_key="api:stripe") for _ in range(5)]
    plain = [queue.add_task(ECHO) for _ in range(3)]
    other = queue.add_task(ECHO, rate_key="api:unlimited")
    runner_id = liveness.register(store).id
    flow.prepare(store, ["default"])
    assert store.flow_keys
    t0 = utcnow()
    assert _claims(store, runner_id, ["default"], t0, 6) == [keyed[0]] + plain + [other, None]
    wait = flow.throttled_for(store, ["default"], now=t0)
    assert 59 < wait < 61
    assert _claims(store, runner_id, ["default"], t0 + timedelta(seconds=61), 2) == [keyed[1],
                                                                                    None]
    queue.close()


def test_an_idle_runners_look_is_one_read_and_sees_a_key_limit_set_meanwhile(database):
    """An idle runner woken for a new run makes one read before its claim, flow control or
    not: whether any rate key has a limit comes with the claim order (it was a second read
    on every look, 0.2-0.4 ms more pickup latency on SQLite). A limit set meanwhile by
    another process is seen by that same read."""
    queue = database.queue()
    queue.add_task(ECHO)
    runner = database.queue()            # a store of its own, as a runner process has
    worker = Runner(runner.store, install_signals=False, memory_limit=False)
    with _Statements() as statements:
        assert worker._look()
    assert len(statements.sent) == 1, statements.sent
    assert runner.store.flow_keys is False
    queue.set_rate_limit("api:stripe", "1/min")
    queue.add_task(ECHO, rate_key="api:stripe")
    with _Statements() as statements:
        assert worker._look()
    assert len(statements.sent) == 1, statements.sent
    assert runner.store.flow_keys is True
    runner.close()
    queue.close()


def test_key_limits_by_prefix_give_each_key_a_bucket_and_set_overrides_the_config(database):
    queue = database.queue(rate_limits={"tenant:*": "2/min", "tenant:big": {"rate": "10/min",
                                                                          "burst": 3}})
    store = queue.store
    a = [queue.add_task(ECHO, rate_key="tenant:a") for _ in range(3)]
    b = [queue.add_task(ECHO, rate_key="tenant:b") for _ in range(3)]
    big = [queue.add_task(ECHO, rate_key="tenant:big") for _ in range(4)]
    runner_id = liveness.register(store).id
    flow.prepare(store, ["default"])
    t0 = utcnow()
    claimed = _claims(store, runner_id, ["default"], t0, 8)
    # Each key its own bucket: a's and b's burst of 1 (a tenth of 2/min, at least 1), big's 3.
    assert claimed == [a[0], b[0]] + big[:3] + [None, None, None]
    # Set at run time: the prefix's new limit applies to the live tasks' keys at once.
    assert set(queue.set_rate_limit("tenant:*", "600/min", burst=5)) >= {"tenant:a", "tenant:b"}
    limits = {row["pattern"]: row for row in queue.rate_limits()["limits"]}
    assert limits["tenant:*"]["source"] == "set" and limits["tenant:*"]["limit"] == "600/min"
    assert limits["tenant:big"]["source"] == "config"
    later = t0 + timedelta(seconds=1)
    assert _claims(store, runner_id, ["default"], later, 5) == a[1:] + b[1:] + [None]
    queue.clear_rate_limit("tenant:*")
    with pytest.raises(InputError):
        queue.clear_rate_limit("tenant:*")
    with pytest.raises(InputError):
        queue.set_rate_limit("tenant:*", "fast")
    with pytest.raises(InputError):
        queue.set_rate_limit("a*b", "1/s")
    queue.close()


@pytest.mark.timeout(300)
def test_a_fair_queue_starts_a_small_tenant_behind_a_large_backlog_early(database):
    queue = database.queue(queues={"fair": {"fair_by": "tenant"}})
    store = queue.store
    big = queue.add_tasks([{"handler": ECHO, "queue": "fair", "tenant": "A"}
                           for _ in range(10000)])
    small = queue.add_tasks([{"handler": ECHO, "queue": "fair", "tenant": "B"}
                             for _ in range(10)])
    runner_id = liveness.register(store, serving=("fair",)).id
    claimed = _claims(store, runner_id, ["fair"], utcnow(), 30)
    assert set(small) <= set(claimed), claimed
    # FIFO within priority inside each tenant.
    assert [t for t in claimed if t in set(small)] == small
    assert [t for t in claimed if t not in set(small)] == big[:20]
    assert flow.tenants_waiting(store, "fair") == 1
    queue.close()


def test_a_fair_queue_also_runs_tasks_without_a_tenant(database):
    queue = database.queue(queues={"fair": {"fair_by": "tenant"}})
    store = queue.store
    plain = queue.add_task(ECHO, queue="fair")
    acme = queue.add_task(ECHO, queue="fair", tenant="acme")
    runner_id = liveness.register(store, serving=("fair",)).id
    assert _claims(store, runner_id, ["fair"], utcnow(), 3) == [acme, plain, None]
    queue.close()


def _aging_stream(queue, added_per_claim, backlog=5):
    """A priority-0 task, then a stream of priority-10 tasks (`added_per_claim` per claim,
    after a `backlog`), a claim a second with the maintenance pass's aging before each:
    how many claims before the priority-0 task's."""
    store = queue.store
    runner_id = liveness.register(store, serving=("aged",)).id
    t0 = utcnow()
    low = enqueue.add_task(store, ECHO, now=t0, queue="aged", priority=0)
    enqueue.add_tasks(store, [{"handler": ECHO, "queue": "aged", "priority": 10}] * backlog,
                      now=t0)
    for step in range(300):
        now = t0 + timedelta(seconds=step)
        enqueue.add_tasks(store, [{"handler": ECHO, "queue": "aged", "priority": 10}]
                          * added_per_claim, now=now)
        flow._AGED_AT.clear()
        flow.age_runs(store, now=now)
        if _claims(store, runner_id, ["aged"], now, 1)[0] == low:
            return step
    raise AssertionError("the priority-0 task never started")


def test_aging_starts_a_low_priority_task_under_a_stream_of_high_ones(database):
    """The documented bound: a priority-p task under a steady stream of priority-P tasks
    starts within (P - p) x aging (it is then the oldest of priority P); under a backlog
    that grows (the stream's tasks age too) within (aging_max - p) x aging."""
    queue = database.queue(queues={"aged": {"aging": "10s", "limit": 2}})
    assert 100 <= _aging_stream(queue, added_per_claim=1) <= 101
    queue.close()
    capped = database.queue(queues={"aged": {"aging": "10s", "aging_max": 12, "limit": 2}})
    capped.store.Run.delete().execute()
    capped.store.Task.delete().execute()
    assert _aging_stream(capped, added_per_claim=2) <= 121
    capped.close()


def test_no_flow_configured_claims_with_todays_statement(sqlite_db):
    """Without flow control a queue is claimed by the plain statement, unchanged."""
    queue = sqlite_db.queue(queues={"api": {"limit": 1}})
    assert flow.claim_flow(queue.store, "api") is None
    assert flow.claim_flow(queue.store, "default") is None
    queue.close()


@pytest.mark.parametrize("given,message", [
    ({"queues": {"api": {"rate": "fast"}}}, "[queues.api] rate: expected a rate"),
    ({"queues": {"api": {"rate": "0/s"}}}, "[queues.api] rate"),
    ({"queues": {"api": {"burst": 0.5}}}, "[queues.api] burst"),
    ({"queues": {"api": {"fair_by": "user"}}}, "[queues.api] fair_by"),
    ({"rate_limits": {"a": "1/fortnight"}}, "[rate_limits] 'a'"),
    ({"rate_limits": {"a*b": "1/s"}}, "[rate_limits] 'a*b'"),
    ({"rate_limits": []}, "[rate_limits] must be a table"),
])
def test_flow_settings_are_checked(given, message):
    with pytest.raises(ConfigError) as info:
        Config.from_dict(given)
    assert message in str(info.value)


def test_rates_parse_per_second_minute_and_hour():
    from taskrunner.config import default_burst, parse_rate
    assert parse_rate("100/s") == 100 and parse_rate("6000/min") == 100
    assert parse_rate("36/h") == pytest.approx(0.01)
    assert default_burst(50) == 5 and default_burst(2) == 1


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_migration_0021_keeps_existing_tasks_and_their_runs_claimable(backend, tmp_path):
    db = Database(backend, tmp_path, empty=True)
    try:
        store = db.store_at("0018_consecutive_crashes_and_stopping_since",
                            queues={"default": {"rate": "5/s", "fair_by": "tenant"}})
        store.db.execute_sql(
            "INSERT INTO task_queue (queued_on, scheduled_on, handler, data, priority, "
            "last_status, max_retries, runs_failed, run_count, run_timeout, updated_on) "
            "VALUES ('2026-01-01 00:00:00', '2026-01-01 00:00:00', 'x.Y', '{}', 0, "
            "'scheduled', 5, 0, 1, 60, '2026-01-01 00:00:00')")
        store.db.execute_sql(
            "INSERT INTO task_runs (task_id, created_on, updated_on, status, attempt, "
            "active_task_id, priority, scheduled_on, percent_completed) VALUES "
            "(1, '2026-01-01 00:00:00', '2026-01-01 00:00:00', 'scheduled', 1, 1, 0, "
            "'2026-01-01 00:00:00', 0)")
        store.migrate()
        assert [(t.rate_key, t.tenant) for t in store.Task.select()] == [(None, None)]
        runner_id = liveness.register(store).id
        flow.prepare(store, ["default"])
        claimed = lifecycle.claim(store, runner_id, ["default"])
        assert claimed is not None and claimed.task_id == 1
        store.close()
    finally:
        db.drop()


def test_flow_statements_are_built_for_every_combination():
    for backend in ALL_BACKENDS:
        for rate in (False, True):
            for keys in (False, True):
                for fair in (False, True):
                    assert runs_sql.flow_claim_statements(backend, rate, keys, fair)


def test_rate_cli_sets_lists_and_clears_limits_and_status_shows_them(sqlite_db, tmp_path):
    import json
    from conftest import taskrunner, usage_error
    config = sqlite_db.write_config(tmp_path / "c.toml", '[queues.api]\nrate = "20/s"\n'
                                    'fair_by = "tenant"\naging = "30s"\n')
    out = taskrunner("rate", "set", "api:stripe", "25/s", "--burst", "5", config=config,
                     check=True).stdout
    assert "rate limit of 'api:stripe': 25/s" in out
    taskrunner("add", ECHO, "--rate-key", "api:stripe", "--tenant", "acme", "--queue", "api",
               config=config, check=True)
    listed = json.loads(taskrunner("rate", "list", "--json", config=config, check=True).stdout)
    assert [(r["pattern"], r["limit"], r["burst"], r["source"]) for r in listed["limits"]] == [
        ("api:stripe", "25/s", 5.0, "set")]
    assert [(b["kind"], b["name"], b["allowance"]) for b in listed["buckets"]] == [
        ("key", "api:stripe", 5.0)]
    text = taskrunner("rate", "list", config=config, check=True).stdout
    assert "api:stripe" in text and "ALLOWANCE" in text
    status = json.loads(taskrunner("status", "--json", config=config, check=True).stdout)
    [api] = [q for q in status["queues"] if q["name"] == "api"]
    assert (api["fair_by"], api["tenants_waiting"], api["aging"]) == ("tenant", 1, 30.0)
    assert status["rate_limits"][0]["name"] == "api:stripe"
    table = taskrunner("queue", "list", config=config, check=True).stdout
    assert "TENANTS WAITING" in table and "RATE" in table
    assert "cleared" in taskrunner("rate", "clear", "api:stripe", config=config,
                                   check=True).stdout
    usage_error(taskrunner("rate", "clear", "api:stripe", config=config), "no rate limit set")
    usage_error(taskrunner("rate", "set", "k", "fast", config=config), "expected a rate")
    usage_error(taskrunner("rate", "set", "k", "1/s", "--burst", "0.5", config=config),
                "--burst")
    usage_error(taskrunner("add", ECHO, "--tenant", "", config=config), "tenant")


def test_async_rate_limit_verbs(sqlite_db):
    import asyncio
    queue = sqlite_db.queue()

    async def main():
        await queue.set_rate_limit_async("k", "2/s")
        found = await queue.rate_limits_async()
        await queue.clear_rate_limit_async("k")
        return found
    found = asyncio.run(main())
    assert found["limits"][0]["pattern"] == "k" and queue.rate_limits()["limits"] == []
    queue.close()


def test_dashboard_and_metrics_show_limits_allowance_throttled_runs_and_tenants(sqlite_db,
                                                                             tmp_path):
    from prometheus_client.parser import text_string_to_metric_families
    from conftest import taskrunner
    from dashboard_helpers import Served, fetch
    config = sqlite_db.write_config(tmp_path / "c.toml", '[queues.api]\nrate = "1/min"\n'
                                    'fair_by = "tenant"\n')
    queue = sqlite_db.queue(queues={"api": {"rate": "1/min", "fair_by": "tenant"}})
    store = queue.store
    queue.set_rate_limit("api:stripe", "1/h")
    for tenant in ("acme", "globex"):
        queue.add_task(ECHO, queue="api", tenant=tenant)
    queue.add_task(ECHO, rate_key="api:stripe")
    queue.add_task(ECHO, rate_key="api:stripe")
    runner_id = liveness.register(store).id
    flow.prepare(store, ["api", "default"])
    assert _claims(store, runner_id, ["api", "default"], utcnow(), 4)[:2] != [None, None]
    text = taskrunner("metrics", config=config, check=True).stdout
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples[("taskrunner_rate_limit_per_second",
                    (("kind", "key"), ("name", "api:stripe")))] == pytest.approx(1 / 3600)
    assert samples[("taskrunner_rate_allowance", (("kind", "queue"), ("name", "api")))] < 1
    assert samples[("taskrunner_rate_throttled_runs", (("kind", "queue"), ("name", "api")))] == 1
    assert samples[("taskrunner_rate_throttled_runs",
                    (("kind", "key"), ("name", "api:stripe")))] == 1
    assert samples[("taskrunner_queue_tenants_waiting", (("queue", "api"),))] == 1
    served = Served(store)
    try:
        page = fetch(served.url + "/")[1]
    finally:
        served.stop()
    assert 'id="flow"' in page and "api:stripe" in page and "Tenants waiting" in page
    queue.close()
