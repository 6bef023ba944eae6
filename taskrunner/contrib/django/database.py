"""The taskrunner database URL of one of Django's ``DATABASES`` entries, so that the tasks
live in the application's own database and commit with its transactions."""
import os
from urllib.parse import quote, urlencode

from ...errors import ConfigError

ENGINES = {"sqlite3": "sqlite", "postgresql": "postgresql", "mysql": "mysql"}
# Connection options of Django's settings that mean the same to taskrunner's drivers; any
# other (a pool, an isolation level, init commands) is Django's own business.
PASSED_OPTIONS = {"postgresql": ("sslmode", "sslrootcert", "sslcert", "sslkey"),
                  "mysql": ()}


def url_of(settings_dict, alias="default"):
    """``sqlite:////abs/path``, ``postgresql://user:password@host:port/name`` or
    ``mysql://...`` for a Django database's settings; ConfigError for an engine taskrunner
    does not speak or a SQLite database that is not a file (the runners are other
    processes: an in-memory database is not theirs to reach)."""
    engine = str(settings_dict.get("ENGINE", "")).rsplit(".", 1)[-1]
    backend = ENGINES.get(engine)
    if backend is None:
        raise ConfigError("DATABASES[%r]: engine %r is not one taskrunner uses (SQLite, "
                          "PostgreSQL or MySQL)" % (alias, settings_dict.get("ENGINE")))
    name = str(settings_dict.get("NAME") or "")
    if backend == "sqlite":
        if not name or name == ":memory:" or "mode=memory" in name:
            raise ConfigError("DATABASES[%r] is an in-memory SQLite database: runners in other "
                              "processes cannot reach it (for tests, set TEST NAME to a file)"
                              % alias)
        return "sqlite:///" + os.path.abspath(name)
    user = quote(str(settings_dict.get("USER") or ""), safe="")
    password = quote(str(settings_dict.get("PASSWORD") or ""), safe="")
    host = str(settings_dict.get("HOST") or "")
    query = {}
    if host.startswith("/"):        # a Unix socket's directory
        query["host"], host = host, ""
    elif ":" in host:
        host = "[%s]" % host
    port = str(settings_dict.get("PORT") or "")
    userinfo = user + (":" + password if password else "") + ("@" if user else "")
    options = settings_dict.get("OPTIONS") or {}
    query.update((key, options[key]) for key in PASSED_OPTIONS[backend]
                 if isinstance(options.get(key), str))
    return "%s://%s%s%s/%s%s" % (backend, userinfo, host, ":" + port if port else "",
                                 quote(name, safe=""),
                                 "?" + urlencode(query) if query else "")
