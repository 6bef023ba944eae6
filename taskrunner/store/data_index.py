"""Indexes of task data keys, declared by the operator (``taskrunner index add KEY``): one
index per top-level key of ``task_queue.data`` that the dashboard's and the CLI's data
search (reads/summaries.py) then read instead of a bounded window of recent tasks.

Opt-in and explicit, not a config key applied by every command's migration: building one
on a table of millions of tasks takes a while, and should be started once, by someone
watching, not by whichever process starts first. Each is built without holding writers
off for long: PostgreSQL ``CREATE INDEX CONCURRENTLY`` (outside a transaction), MariaDB a
virtual generated column (instant) and an ``ALGORITHM=INPLACE, LOCK=NONE`` index, SQLite a
plain ``CREATE INDEX`` (its one writer waits while it builds).

The database's own catalog says which keys are indexed (no table of ours to disagree with
it): the index is named ``task_queue_data_key_KEY``. The key goes into DDL, so it is
checked against `KEY` and never quoted from unchecked text.

What an index holds is the key's value as text (a JSON string unquoted, a number as
written): ``order_id=44`` finds ``{"order_id": 44}`` and ``{"order_id": "44"}`` alike,
as the unindexed search does. At most `PREFIX_CHARS` characters of it on PostgreSQL and
MariaDB (a b-tree entry has a size limit a long value must not make an insert fail on);
the search compares the whole value again on the rows the index finds.
"""
import re
from typing import Any, Dict, List

from ..errors import InputError
from ..masking import is_secret

# A key that may be indexed: a safe identifier (letters, digits, _; not starting with a
# digit), short enough that the index's name stays within every database's 63 characters.
KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,42}$")
INDEX_PREFIX = "task_queue_data_key_"
# MariaDB's generated column holding the key's value (it has no index on an expression).
COLUMN_PREFIX = "data_key_"
PREFIX_CHARS = 255
# PostgreSQL: jsonb refuses a NUL character (``\u0000`` in the JSON text) that JSON allows;
# such a task has no entry (NULL) instead of failing its insert. A value holding the text
# ``\u0000`` escaped (``\\u0000``) has no entry either: such a task is not found by the
# indexed search, the one cost of a guard that never fails.
NO_NUL = "strpos(data, '\\u0000') = 0"


def check_key(key: str) -> str:
    """`key` if it may be indexed, else InputError naming what is allowed."""
    if not isinstance(key, str) or not KEY.match(key):
        raise InputError("invalid data key %r to index: expected letters, digits and _, not "
                         "starting with a digit, at most 43 characters" % str(key)[:80])
    return key


def indexable(key: str) -> bool:
    return bool(KEY.match(key))


def index_name(key: str) -> str:
    return INDEX_PREFIX + check_key(key)


def column_name(key: str) -> str:
    """MariaDB: the virtual column that holds `key`'s value."""
    return COLUMN_PREFIX + check_key(key)


def expression(backend: str, key: str) -> str:
    """The SQL of what the index of `key` holds (on MariaDB, its column): a query must say
    exactly this for the database to read the index."""
    key = check_key(key)
    if backend == "postgresql":
        return "(CASE WHEN %s THEN left(data::jsonb ->> '%s', %d) END)" % (
            NO_NUL, key, PREFIX_CHARS)
    if backend == "mysql":
        return "`%s`" % column_name(key)
    return "CAST(json_extract(data, '$.\"%s\"') AS TEXT)" % key


def indexed_keys(store: Any) -> Dict[str, bool]:
    """Every indexed key, and whether its index is ready (False: PostgreSQL is still
    building it, or its build failed; `add` again builds it anew)."""
    db = store.db
    if store.backend == "postgresql":
        rows = db.execute_sql(
            "SELECT c.relname, i.indisvalid FROM pg_index i "
            "JOIN pg_class c ON c.oid = i.indexrelid JOIN pg_class t ON t.oid = i.indrelid "
            "WHERE t.relname = 'task_queue' AND t.relnamespace = current_schema()::regnamespace "
            "AND c.relname LIKE %s", [INDEX_PREFIX.replace("_", "\\_") + "%"]).fetchall()
    elif store.backend == "mysql":
        rows = [(name, True) for (name,) in db.execute_sql(
            "SELECT DISTINCT index_name FROM information_schema.statistics "
            "WHERE table_schema = DATABASE() AND table_name = 'task_queue' "
            "AND index_name LIKE %s", [INDEX_PREFIX.replace("_", "\\_") + "%"]).fetchall()]
    else:
        rows = [(name, True) for (name,) in db.execute_sql(
            "SELECT name FROM sqlite_master WHERE type = 'index' AND tbl_name = 'task_queue' "
            "AND name LIKE ? ESCAPE '\\'", [INDEX_PREFIX.replace("_", "\\_") + "%"]).fetchall()]
    return {name[len(INDEX_PREFIX):]: bool(ready) for name, ready in sorted(rows)}


def add(store: Any, key: str) -> bool:
    """Index `key`; False if it was indexed and ready already. Refused (InputError) for a
    key that is not `KEY`, a secret one (``[task] secret_keys``: no search may name it), or
    one that differs only by case from an indexed one (MariaDB's column names and SQLite's
    index names ignore case)."""
    key = check_key(key)
    if is_secret(key, store.config.task.secret_keys):
        raise InputError("data key %r is secret ([task] secret_keys): it cannot be searched, "
                         "so it is not indexed" % key)
    found = indexed_keys(store)
    if found.get(key):
        return False
    for other in found:
        if other != key and other.lower() == key.lower():
            raise InputError("data key %r differs only by case from the indexed key %r: index "
                             "names ignore case, drop %r first" % (key, other, other))
    name, db = index_name(key), store.db
    if store.backend == "postgresql":
        if key in found:    # a build that failed left an invalid index behind
            db.execute_sql('DROP INDEX CONCURRENTLY IF EXISTS "%s"' % name)
        db.execute_sql('CREATE INDEX CONCURRENTLY IF NOT EXISTS "%s" ON task_queue (%s, id)'
                       % (name, expression("postgresql", key)))
        # The planner learns the values' spread, so a rare value is read off the index.
        db.execute_sql("ANALYZE task_queue")
    elif store.backend == "mysql":
        db.execute_sql(
            "ALTER TABLE task_queue ADD COLUMN IF NOT EXISTS `%s` VARCHAR(%d) COLLATE utf8mb4_bin "
            "AS (LEFT(JSON_VALUE(data, '$.\"%s\"'), %d)) VIRTUAL, ALGORITHM=INSTANT"
            % (column_name(key), PREFIX_CHARS, key, PREFIX_CHARS))
        db.execute_sql("CREATE INDEX IF NOT EXISTS `%s` ON task_queue (`%s`) "
                       "ALGORITHM=INPLACE LOCK=NONE" % (name, column_name(key)))
    else:
        db.execute_sql('CREATE INDEX IF NOT EXISTS "%s" ON task_queue (%s)'
                       % (name, expression("sqlite", key)))
    return True


def drop(store: Any, key: str) -> bool:
    """Drop `key`'s index; False if it had none."""
    key = check_key(key)
    if key not in indexed_keys(store):
        return False
    name, db = index_name(key), store.db
    if store.backend == "postgresql":
        db.execute_sql('DROP INDEX CONCURRENTLY IF EXISTS "%s"' % name)
    elif store.backend == "mysql":
        db.execute_sql("ALTER TABLE task_queue DROP INDEX IF EXISTS `%s`, ALGORITHM=NOCOPY, "
                       "LOCK=NONE" % name)
        db.execute_sql("ALTER TABLE task_queue DROP COLUMN IF EXISTS `%s`, ALGORITHM=INSTANT"
                       % column_name(key))
    else:
        db.execute_sql('DROP INDEX IF EXISTS "%s"' % name)
    return True


def describe(store: Any) -> List[Dict[str, Any]]:
    """The indexed keys as the CLI's ``index list --json`` prints them."""
    return [{"key": key, "index": INDEX_PREFIX + key, "ready": ready}
            for key, ready in indexed_keys(store).items()]
