"""The code version of a runner process (docs: "Changing durable code under running work"):
recorded on its row (``task_runners.code_version``) when it registers, and by a durable task
it starts on the task (runs/durable.py), so that operators see which runs are still open
under old code and handlers can branch on it (``run.patched``, ``run.code_version``).

``[runner] code_version`` (or ``$TASKRUNNER_CODE_VERSION``, config.py) names it; ""
computes it: ``src-`` and 12 hex digits of a SHA-256 over the source files of the
application — the modules and packages ``[handlers] allow`` names, or, without an
allow-list, the packages and modules of the directories on ``sys.path`` that are not the
standard library's or site-packages' (the application's own). The source, not a file's time:
a deploy that rewrites files unchanged keeps the version, one that changes a handler changes
it. Computed once per process: a runner runs the code it imported, and one forked after a HUP
computes its own.
"""
import hashlib
import importlib.util
import logging
import os
import sys
import sysconfig

log = logging.getLogger("taskrunner.runner")

PREFIX = "src-"
# Files hashed at most: a sys.path entry that is a home directory must not stall a start.
MOST_FILES = 20000
GLOB = "*?["

_computed = {}      # pid -> version: a forked child computes its own
_unnamed, _warned = set(), set()    # pids whose version hashed no source; warned of it


def code_version(config):
    """This process's code version: the configured one, else the digest of its source."""
    if config.runner.code_version:
        return config.runner.code_version
    pid = os.getpid()
    if pid not in _computed:
        _computed[pid] = digest(_roots(config.handlers.allow))
    return _computed[pid]


def digest(roots):
    """``src-`` + 12 hex digits of SHA-256 over the .py files under `roots` (files or
    package directories), each with its path relative to its root, in sorted order."""
    sha, count = hashlib.sha256(), 0
    for root in sorted(set(roots)):
        for relative, path in _sources(root):
            if count >= MOST_FILES:
                log.warning("code version: more than %d source files under %s; set [runner] "
                            "code_version to name versions yourself", MOST_FILES, root)
                return PREFIX + sha.hexdigest()[:12]
            count += 1
            try:
                with open(path, "rb") as fh:
                    content = fh.read()
            except OSError:
                continue
            sha.update(relative.encode("utf-8", "surrogateescape") + b"\0")
            sha.update(hashlib.sha256(content).digest())
    if not count:
        _unnamed.add(os.getpid())
    return PREFIX + sha.hexdigest()[:12]


def warn_if_unnamed():
    """Once per process, when its first durable run starts: say so when its version hashed
    no source at all (an application installed into site-packages, run without [handlers]
    allow), as every deploy would then get that same version and `run.patched` could not
    tell old code from new. Plain tasks never read a version: they are not warned about."""
    pid = os.getpid()
    if pid in _unnamed and pid not in _warned:
        _warned.add(pid)
        log.warning("code version: no application source found to hash (it is not on "
                    "sys.path outside site-packages, and [handlers] allow names no module); "
                    "set [runner] code_version, or [handlers] allow, so that a deploy "
                    "changes the version")


def _sources(root):
    """(path relative to root's parent, path) of each .py file of a module or package."""
    if os.path.isfile(root):
        yield os.path.basename(root), root
        return
    base = os.path.dirname(root)
    for directory, subdirectories, files in os.walk(root):
        subdirectories[:] = sorted(d for d in subdirectories if os.path.isfile(
            os.path.join(directory, d, "__init__.py")))
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(directory, name)
                yield os.path.relpath(path, base), path


def _roots(allow):
    """The files and package directories of the application's modules."""
    if allow:
        return [root for pattern in allow for root in _module_roots(pattern)]
    return [root for entry in _application_paths() for root in _top_level(entry)]


def _module_roots(pattern):
    """The module (or package) a handler pattern such as ``myapp.tasks.*`` lies in: its
    longest importable dotted prefix before any glob character."""
    cut = min([pattern.index(c) for c in GLOB if c in pattern] + [len(pattern)])
    parts = [p for p in pattern[:cut].split(".") if p]
    if cut < len(pattern) and parts and not pattern[:cut].endswith("."):
        parts.pop()        # "myapp.ta*": the glob is inside a name
    while parts:
        try:
            spec = importlib.util.find_spec(".".join(parts))
        except (ImportError, ValueError):
            spec = None
        if spec is not None and spec.origin not in (None, "built-in", "frozen"):
            locations = spec.submodule_search_locations
            return list(locations) if locations else [spec.origin]
        parts.pop()
    return []


def _application_paths():
    """The directories on sys.path that are not the interpreter's own or installed
    packages ('' is the current directory)."""
    paths = sysconfig.get_paths()
    excluded = {os.path.realpath(p) for p in (paths.get("stdlib"), paths.get("platstdlib"),
                                              paths.get("purelib"), paths.get("platlib")) if p}
    for entry in sys.path:
        entry = os.path.realpath(entry or os.getcwd())
        if not os.path.isdir(entry) or entry in excluded or os.path.basename(entry) in (
                "site-packages", "dist-packages") or entry.startswith(tuple(
                os.path.join(p, "") for p in excluded)):
            continue
        yield entry


def _top_level(directory):
    """The modules and packages Python would import from `directory`."""
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return []
    return [os.path.join(directory, name) for name in names
            if (name.endswith(".py") and name.isascii()) or os.path.isfile(
                os.path.join(directory, name, "__init__.py"))]
