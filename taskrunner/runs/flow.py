"""Flow control, decided inside the claim (DESIGN "Flow control"): rate limits per queue and
per key enforced by the database for every host at once, round-robin fairness between the
tenants of a queue, and opt-in priority aging.

Rate limits are token buckets, one row each in ``task_rate_buckets``: a queue's
(``[queues.NAME] rate``) and one per rate key that has a limit (``[rate_limits]`` in the
config, or ``taskrunner rate set`` / `TaskQueue.set_rate_limit` at run time, by key or key
prefix). A bucket holds up to ``burst`` tokens and gains ``rate`` a second; the claim of a
run refills and spends its queue's and its key's in the claim's own statement (PostgreSQL)
or transaction (SQLite, MySQL), on the database's clock, so every host draws from the same
bucket. A run whose key has no token is passed over (the claim takes the next one: a
throttled key never delays runs without it); a queue without a token claims nothing, and
its idle runners sleep until the bucket's next token (`throttled_for`), never polling
faster.

Fairness (``[queues.NAME] fair_by = "tenant"``): the claim serves the queue's tenant served
longest ago that has a run waiting (``task_tenants.served``, a sequence per queue), FIFO
within priority inside the tenant.

Aging (``[queues.NAME] aging``): the maintenance pass raises a scheduled run's priority to
its task's priority plus one for each `aging` it has waited (up to ``aging_max``); the claim
itself is unchanged.

A queue without any of these is claimed by the plain statement, exactly as before.
"""
import time
from datetime import timedelta

import peewee as pw

from . import sql
from ..config import check_rate_pattern, rate_limit
from ..errors import InputError, check_text
from ..store.models import SCHEDULED, run_status_is

QUEUE, KEY = "queue", "key"
# Sleeping until a bucket's next token, a runner adds this much: the token is there when
# it claims, whatever the rounding of the two clocks' arithmetic.
WAKE_MARGIN = 0.002


# -- which claim a queue takes ----------------------------------------------------------------

def claim_flow(store, queue):
    """(rate, keys, fair) of the claim of `queue`, or None for the plain claim."""
    configured = store.config.queues.get(queue)
    rate = configured is not None and configured.per_second is not None
    fair = configured is not None and configured.fair_by == "tenant"
    if rate or fair or store.flow_keys:
        return rate, store.flow_keys, fair
    return None


def keys_limited(store):
    """Whether any rate key has a limit, as an expression: the runner's look reads it in
    the claim order's statement (`queues.claim_order`'s `also`), so an idle runner woken for
    a new run still makes one read before its claim."""
    Bucket = store.RateBucket
    return pw.fn.EXISTS(Bucket.select(Bucket.kind).where(Bucket.kind == KEY))


def prepare(store, queues, limited=None):
    """With the claim order (an idle runner's look, and every check_interval): the buckets
    of the queues in `queues` with a configured rate, made or brought to the config's rate
    and burst; and whether any rate key has a limit (`Store.flow_keys`): `limited` when the
    caller read `keys_limited` with the claim order, else read here."""
    for queue in queues:
        configured = store.config.queues.get(queue)
        if configured is not None and configured.per_second is not None:
            _ensure_bucket(store, QUEUE, queue, configured.per_second, configured.burst)
    if limited is None:
        Bucket = store.RateBucket
        limited = Bucket.select().where(Bucket.kind == KEY).exists()
    store.flow_keys = bool(limited)


def _ensure_bucket(store, kind, name, rate, burst, now=None):
    """The bucket (kind, name) with `rate` and `burst`: created full, or its limit changed
    (its tokens kept, up to the new burst)."""
    Bucket = store.RateBucket
    row = Bucket.select(Bucket.rate, Bucket.burst).where(
        (Bucket.kind == kind) & (Bucket.name == name)).first()
    if row is not None and row.rate == rate and row.burst == burst:
        return
    at = store.database_time(now)

    def step():
        if row is None:
            Bucket.insert(kind=kind, name=name, rate=rate, burst=burst, tokens=burst,
                          stamp=sql.epoch_seconds(at), updated_on=at).on_conflict_ignore(
            ).execute()
        else:
            Bucket.update(rate=rate, burst=burst, updated_on=at).where(
                (Bucket.kind == kind) & (Bucket.name == name)).execute()
            Bucket.update(tokens=burst).where((Bucket.kind == kind) & (Bucket.name == name)
                                              & (Bucket.tokens > burst)).execute()
    store.write(step)


# -- rate keys --------------------------------------------------------------------------------

def limit_of(key, rules):
    """The (rate, burst, text) of `key` under `rules` ({pattern: (rate, burst, text)}): its
    own pattern, else the longest prefix (``PREFIX*``) it starts with; None: no limit."""
    if key in rules:
        return rules[key]
    prefixes = [p for p in rules if p.endswith("*") and key.startswith(p[:-1])]
    return rules[max(prefixes, key=len)] if prefixes else None


def rules(store):
    """Every key limit: the config's ``[rate_limits]``, overridden pattern by pattern by
    those set at run time."""
    found = dict(store.config.rate_limits)
    RateLimit = store.RateLimit
    rows = RateLimit.select(RateLimit.pattern, RateLimit.rate, RateLimit.burst,
                            RateLimit.text).tuples()
    found.update({pattern: (rate, burst, text) for pattern, rate, burst, text in rows})
    return found


_INSERT_IGNORE = {"sqlite": "INSERT OR IGNORE INTO", "postgresql": "INSERT INTO",
                  "mysql": "INSERT IGNORE INTO"}


def _insert_ignore(backend, table, names):
    marks = ", ".join(["?" if backend == "sqlite" else "%s"] * len(names))
    return "%s %s (%s) VALUES (%s)%s" % (
        _INSERT_IGNORE[backend], table, ", ".join(names), marks,
        " ON CONFLICT DO NOTHING" if backend == "postgresql" else "")


def record_rows(store, rows, execute=None):
    """Inside the caller's transaction, for tasks being added: the bucket of each rate key
    not seen before that has a limit, and the ``task_tenants`` row of each (queue, tenant).
    Returns what to remember after the commit (`remember`); nothing is read or written for
    tasks without a rate key or a tenant, nor for keys and tenants this store wrote already.
    `execute`: the caller's connection for the writes (the limits are read through the
    store's: they are committed rows)."""
    keys = {row["rate_key"] for row in rows if row.get("rate_key")} - store.known_rate_keys
    tenants = {(row["queue"], row["tenant"]) for row in rows
               if row.get("tenant") is not None} - store.known_tenants
    if not keys and not tenants:
        return (), ()
    execute = execute or store.db.execute_sql
    backend, at = store.backend, store.database_time()
    stamp = at.isoformat(" ") if backend == "sqlite" else at
    if keys:
        known = rules(store)
        statement = _insert_ignore(backend, "task_rate_buckets", (
            "kind", "name", "rate", "burst", "tokens", "stamp", "updated_on"))
        for key in sorted(keys):
            limit = limit_of(key, known)
            if limit is not None:
                execute(statement, (KEY, key, limit[0], limit[1], limit[1],
                                    sql.epoch_seconds(at), stamp))
    statement = _insert_ignore(backend, "task_tenants", ("queue", "tenant", "served"))
    for queue, tenant in sorted(tenants):
        execute(statement, (queue, tenant, 0))
    return keys, tenants


def remember(store, recorded):
    """After the commit of `record_rows`' transaction: its keys and tenants need nothing
    again (a key without a limit too: `set_rate_limit` makes buckets of live tasks' keys)."""
    keys, tenants = recorded
    if not store.db.in_transaction():
        store.known_rate_keys.update(keys)
        store.known_tenants.update(tenants)


def check_task_options(rate_key, tenant):
    """InputError for a bad `rate_key` or `tenant` of add_task."""
    check_text("rate_key", rate_key, empty=False)
    check_text("tenant", tenant, empty=False)


def set_rate_limit(store, pattern, rate, burst=0, now=None):
    """The rate limit of the key `pattern` (or of every key starting with PREFIX, for
    ``PREFIX*``) on every host, from now on: `rate` as ``"25/s"``, ``"/min"`` or ``"/h"``;
    `burst` 0 for a tenth of a second of it. Overrides the config's for that pattern. Returns
    the keys whose bucket it made or changed. InputError on bad input."""
    check_rate_pattern(pattern)
    try:
        per_second, burst, text = rate_limit({"rate": rate, "burst": burst})
    except ValueError as exc:
        raise InputError("rate limit of %r: %s" % (pattern, exc)) from None
    RateLimit = store.RateLimit
    at = store.database_time(now)

    def step():
        RateLimit.insert(pattern=pattern, rate=per_second, burst=burst, text=text,
                         updated_on=at).on_conflict_replace().execute() \
            if store.backend != "postgresql" else \
            RateLimit.insert(pattern=pattern, rate=per_second, burst=burst, text=text,
                             updated_on=at).on_conflict(
                conflict_target=[RateLimit.pattern],
                update={RateLimit.rate: per_second, RateLimit.burst: burst,
                        RateLimit.text: text, RateLimit.updated_on: at}).execute()
    store.write(step)
    return _apply(store, pattern, now)


def clear_rate_limit(store, pattern, now=None):
    """Remove the run-time limit of `pattern` (the config's, if any, applies again). Returns
    whether there was one. InputError for a pattern that has none."""
    check_rate_pattern(pattern)
    RateLimit = store.RateLimit
    if not store.write(lambda: RateLimit.delete().where(RateLimit.pattern == pattern).execute()):
        raise InputError("no rate limit set for %r (`taskrunner rate list` shows them)"
                         % pattern)
    _apply(store, pattern, now)
    return True


def _apply(store, pattern, now=None):
    """The buckets of the keys `pattern` matches (those with a bucket, and those of tasks
    not finished) brought to the limits in force: made, changed, or removed."""
    Bucket, Task = store.RateBucket, store.Task
    prefix = pattern[:-1] if pattern.endswith("*") else None
    matches = (lambda key: key.startswith(prefix)) if prefix is not None \
        else (lambda key: key == pattern)
    keys = {b.name for b in Bucket.select(Bucket.name).where(Bucket.kind == KEY)}
    keys |= {t.rate_key for t in Task.select(Task.rate_key).distinct().where(
        Task.rate_key.is_null(False) & Task.finished_on.is_null())}
    known, changed = rules(store), []
    for key in sorted(k for k in keys if matches(k)):
        limit = limit_of(key, known)
        if limit is None:
            store.write(lambda: Bucket.delete().where(
                (Bucket.kind == KEY) & (Bucket.name == key)).execute())
        else:
            _ensure_bucket(store, KEY, key, limit[0], limit[1], now)
        changed.append(key)
    store.flow_keys = Bucket.select().where(Bucket.kind == KEY).exists()
    return changed


SYNC_EVERY = 30.0      # seconds between two sync_keys of one store
_SYNCED_AT = {}        # id(store) -> monotonic time of its last sync_keys


def sync_keys(store, now=None):
    """The maintenance pass, at most every SYNC_EVERY: every key bucket at the limit the
    rules give it now (a config changed since it was made; a key whose limit is gone loses
    its bucket)."""
    last = _SYNCED_AT.get(id(store))
    if last is not None and time.monotonic() - last < SYNC_EVERY:
        return
    _SYNCED_AT[id(store)] = time.monotonic()
    Bucket = store.RateBucket
    buckets = list(Bucket.select(Bucket.name, Bucket.rate, Bucket.burst).where(
        Bucket.kind == KEY).tuples())
    if not buckets:
        return
    known = rules(store)
    for name, rate, burst in buckets:
        limit = limit_of(name, known)
        if limit is None:
            store.write(lambda: Bucket.delete().where(
                (Bucket.kind == KEY) & (Bucket.name == name)).execute())
        elif (limit[0], limit[1]) != (rate, burst):
            _ensure_bucket(store, KEY, name, limit[0], limit[1], now)


# -- idle runners -----------------------------------------------------------------------------

def throttled_for(store, queues, now=None):
    """Seconds until the next token of the buckets holding back runs of `queues` (those with
    less than a token now: their queue's, and any key's), or 0 when none is empty — then a
    claim that found nothing lost a race, and claims again. An idle runner whose look found
    runs waiting sleeps this long (at most poll_interval): it never polls a throttled queue
    faster than its rate, and wakes when the token comes."""
    Bucket = store.RateBucket
    named = [q for q in queues if claim_flow(store, q)]
    if not named:
        return 0.0
    condition = (Bucket.kind == QUEUE) & Bucket.name.in_(named)
    if store.flow_keys:
        condition |= Bucket.kind == KEY
    e = sql.epoch_seconds(store.database_time(now))
    waits = [(1 - _tokens(tokens, burst, rate, stamp, e)) / rate
             for tokens, burst, rate, stamp in Bucket.select(
                 Bucket.tokens, Bucket.burst, Bucket.rate, Bucket.stamp).where(condition).tuples()
             if _tokens(tokens, burst, rate, stamp, e) < 1]
    return min(waits) + WAKE_MARGIN if waits else 0.0


def _tokens(tokens, burst, rate, stamp, e):
    return min(burst, tokens + max(0.0, e - stamp) * rate)


# -- aging ------------------------------------------------------------------------------------

_AGED_AT = {}        # (id(store), queue) -> monotonic time of its last aging pass


def age_runs(store, now=None, batch=1000):
    """Priority aging of the queues with ``aging`` (the maintenance pass, at most every
    quarter of `aging`): each scheduled run that has waited at least one `aging` gets its
    task's priority plus one per `aging` waited, up to ``aging_max`` (a run never loses
    priority). Reads the runs below aging_max off the claim index. Returns how many changed."""
    Run, Task = store.Run, store.Task
    at, changed = store.database_time(now), 0
    for queue, configured in sorted(store.config.queues.items()):
        if not configured.aging:
            continue
        last = _AGED_AT.get((id(store), queue))
        if last is not None and time.monotonic() - last < configured.aging / 4:
            continue
        _AGED_AT[(id(store), queue)] = time.monotonic()
        rows = (Run.select(Run.id, Run.priority, Run.scheduled_on, Task.priority.alias("base"))
                .join(Task, on=(Run.task_id == Task.id))
                .where(run_status_is(Run, SCHEDULED) & (Run.queue == queue)
                       & (Run.priority < configured.aging_max)
                       & (Run.scheduled_on <= at - timedelta(seconds=configured.aging)))
                .limit(batch).tuples())
        raised = {}
        for run_id, priority, scheduled_on, base in rows:
            steps = int((at - scheduled_on).total_seconds() // configured.aging)
            target = min(configured.aging_max, base + steps)
            if target > priority:
                raised.setdefault(target, []).append(run_id)
        for target, ids in raised.items():
            changed += store.write(lambda: Run.update(priority=target).where(
                Run.id.in_(ids) & run_status_is(Run, SCHEDULED)
                & (Run.priority < target)).execute())
    return changed


# -- what operators read ----------------------------------------------------------------------

def buckets(store, now=None):
    """Every bucket: dicts of kind, name, limit (as written, else per second), rate, burst,
    allowance (tokens now) and runs held back (``throttled``: scheduled runs of a queue whose
    bucket is empty, or with a key whose bucket is)."""
    Bucket, Run = store.RateBucket, store.Run
    e = sql.epoch_seconds(store.database_time(now))
    known = rules(store)
    out = []
    for kind, name, rate, burst, tokens, stamp in Bucket.select(
            Bucket.kind, Bucket.name, Bucket.rate, Bucket.burst, Bucket.tokens,
            Bucket.stamp).order_by(Bucket.kind.desc(), Bucket.name).tuples():
        allowance = _tokens(tokens, burst, rate, stamp, e)
        throttled = 0
        if allowance < 1:
            column = Run.queue if kind == QUEUE else Run.rate_key
            throttled = Run.select().where(run_status_is(Run, SCHEDULED)
                                           & (column == name)).count()
        if kind == QUEUE:
            configured = store.config.queues.get(name)
            text = configured.rate if configured is not None and configured.rate else None
        else:
            limit = limit_of(name, known)
            text = limit[2] if limit is not None else None
        out.append({"kind": kind, "name": name, "limit": text or "%g/s" % rate, "rate": rate,
                    "burst": burst, "allowance": round(allowance, 3), "throttled": throttled})
    return out


def empty_buckets(store, queues, keys, now=None):
    """{(kind, name): seconds until its next token} of the buckets of `queues` and `keys`
    that have less than a token now (one query; the others are left out)."""
    Bucket = store.RateBucket
    condition = None
    for kind, names in ((QUEUE, sorted(set(queues))), (KEY, sorted(set(keys)))):
        if names:
            named = (Bucket.kind == kind) & Bucket.name.in_(names)
            condition = named if condition is None else condition | named
    if condition is None:
        return {}
    e = sql.epoch_seconds(store.database_time(now))
    out = {}
    for kind, name, rate, burst, tokens, stamp in Bucket.select(
            Bucket.kind, Bucket.name, Bucket.rate, Bucket.burst, Bucket.tokens,
            Bucket.stamp).where(condition).tuples():
        allowance = _tokens(tokens, burst, rate, stamp, e)
        if allowance < 1:
            out[(kind, name)] = round((1 - allowance) / rate, 3)
    return out


def held_by_keys(store, keys):
    """{queue: scheduled runs with one of `keys`} (the keys whose bucket is empty)."""
    if not keys:
        return {}
    Run = store.Run
    return dict(Run.select(Run.queue, pw.fn.COUNT(Run.id)).where(
        run_status_is(Run, SCHEDULED) & Run.rate_key.in_(list(keys))).group_by(Run.queue)
        .tuples())


def tenants_waiting(store, queue):
    """How many tenants of `queue` have a run waiting."""
    Tenant, Run = store.Tenant, store.Run
    waiting = Run.select(Run.id).where(run_status_is(Run, SCHEDULED) & (Run.queue == queue)
                                       & (Run.tenant == Tenant.tenant))
    return Tenant.select().where((Tenant.queue == queue) & pw.fn.EXISTS(waiting)).count()


def limits(store):
    """The key limits in force: dicts of pattern, limit, rate, burst, source (``config`` or
    ``set``, a run-time one overriding the config's)."""
    RateLimit = store.RateLimit
    found = {pattern: dict(pattern=pattern, limit=text, rate=rate, burst=burst,
                           source="config")
             for pattern, (rate, burst, text) in store.config.rate_limits.items()}
    for row in RateLimit.select().order_by(RateLimit.pattern):
        found[row.pattern] = dict(pattern=row.pattern, limit=row.text, rate=row.rate,
                                  burst=row.burst, source="set")
    return [found[p] for p in sorted(found)]
