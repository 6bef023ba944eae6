"""Searching tasks by their data, ``KEY=VALUE``: the condition the dashboard's task list
(summaries.find_tasks) and the CLI's ``tasks --data`` (records.tasks_query) share.

A key indexed by ``taskrunner index add KEY`` (store/data_index.py) is read off its index,
however long the history; any other key is evaluated on the JSON of the most recent
`WINDOW` task ids only (no index serves it), and the faces say so.
"""
import re
from typing import Any, Tuple

import peewee as pw

from ..errors import InputError
from ..masking import is_secret
from ..store import data_index

# A key of the task data a search may name: top level, no quoting needed in a JSON path.
# (A key that may be indexed is a stricter subset: data_index.KEY.)
KEY = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
# Task ids an unindexed search reads at most a page: 0.14 to 0.3 s a page on SQLite, where
# one search over a million tasks took 1.7 to 2.8 s (bench/dashboard.py fills such a history).
WINDOW = 100_000


def parse(store: Any, text: str) -> Tuple[str, str]:
    """``key=value`` as a data search; InputError for anything else, and for a secret key
    (``[task] secret_keys``): what the pages mask cannot be found by guessing it either."""
    key, equals, value = text.strip().partition("=")
    key = key.strip()
    if not equals or not KEY.match(key):
        raise InputError("invalid data search %r: expected KEY=VALUE, e.g. order_id=44 (a "
                         "top-level key of letters, digits, _ and -)" % text[:80])
    if is_secret(key, store.config.task.secret_keys):
        raise InputError("data key %r is secret ([task] secret_keys): it cannot be searched"
                         % key)
    return key, value.strip()


def indexed(store: Any, key: str) -> bool:
    """Whether `key` has a ready index (one read of the database's catalog)."""
    return data_index.indexable(key) and data_index.indexed_keys(store).get(key, False)


def condition(store: Any, key: str, value: str, by_index: bool = False) -> Any:
    """Tasks whose JSON data has `key` at the top level with a scalar (string, number,
    boolean) whose text is `value` (a string unquoted, a number as written, ``true``):
    ``order_id=44`` finds 44 and "44". Objects and arrays never match, so a secret key
    nested in one cannot be tested by guessing the whole value.

    `by_index`: `key` is indexed, and the condition names the index's expression first;
    the exact test after it runs on the rows the index finds."""
    Task = store.Task
    exact = _scalar_is(store, Task, key, value)
    if not by_index:
        return exact
    if store.backend != "sqlite":
        value = value[:data_index.PREFIX_CHARS]
    # SQLite and MariaDB give a JSON boolean as 1 or 0 where the exact test says true/false.
    texts = [value] + ([{"true": "1", "false": "0"}[value]]
                       if value in ("true", "false") and store.backend != "postgresql" else [])
    return pw.SQL(data_index.expression(store.backend, key)).in_(texts) & exact


def _scalar_is(store: Any, Task: Any, key: str, value: str) -> Any:
    if store.backend == "postgresql":
        # NULL where jsonb would refuse the JSON text (data_index.NO_NUL): never an error.
        extracted = pw.Case(None, ((pw.SQL(data_index.NO_NUL), Task.data.cast("jsonb")),))
        return ((pw.fn.jsonb_typeof(pw.NodeList((extracted, pw.SQL("->"), key)))
                 .in_(["string", "number", "boolean"]))
                & (pw.NodeList((extracted, pw.SQL("->>"), key)) == value))
    path = '$."%s"' % key       # KEY: nothing to quote
    if store.backend == "mysql":
        found = pw.fn.JSON_EXTRACT(Task.data, path)
        return (pw.fn.JSON_TYPE(found).in_(["STRING", "INTEGER", "UNSIGNED INTEGER", "DOUBLE",
                                            "DECIMAL", "BOOLEAN"])
                & (pw.fn.JSON_UNQUOTE(found) == value))
    kind = pw.fn.json_type(Task.data, path)
    # json_extract gives a boolean as 1 or 0: its text is said as the other databases say it.
    text = pw.Case(kind, (("true", "true"), ("false", "false")),
                   pw.fn.json_extract(Task.data, path).cast("TEXT"))
    return kind.in_(["text", "integer", "real", "true", "false"]) & (text == value)


def newest_id(store: Any) -> int:
    Task = store.Task
    return int(Task.select(pw.fn.MAX(Task.id)).scalar() or 0)


def unindexed_note(key: str) -> str:
    """What the faces say of a search by a key that has no index."""
    how = ("`taskrunner index add %s` indexes it" % key if data_index.indexable(key)
           else "only keys of letters, digits and _ can be indexed")
    return ("data key %r is not indexed: a search reads the %d most recent tasks only (%s)"
            % (key, WINDOW, how))
