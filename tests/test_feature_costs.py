"""A feature that a job does not use costs that job nothing: a runner draining plain jobs
(a class handler, no options) runs no code of a feature's modules per job but the one check
that tells whether the job uses it. Counted, not timed: the calls of each function in a
runner's drain of N and of 3N plain jobs, under cProfile in a real `taskrunner runner
--burst` process (what a module does once per runner, at start or exit, is not per job)."""
import collections
import os
import pstats
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench import common  # noqa: E402
from bench.backlog import add_backlog  # noqa: E402

pytestmark = pytest.mark.timeout(300)

# The modules of features a plain job does not use (paths under taskrunner/).
FEATURES = {
    "tracing.py": "OpenTelemetry traces",
    "chunks.py": "chunks (batch consumption)",
    "runner/chunks.py": "chunks (batch consumption)",
    "runs/debounce.py": "debounce",
    "runner/versions.py": "durable code versions",
    "runs/durable.py": "checkpoints and steps",
    "runs/graph.py": "task graphs",
    "runs/flow.py": "rate limits and fairness",
    "store/data_index.py": "the data-search index",
    "periodic/scheduler.py": "periodic tasks",
    "periodic/timers.py": "periodic tasks",
}
# The one check per job that a feature may cost a job that does not use it: whether this
# process traces, whether the run's handler takes chunks, whether its queue's claim is a
# flow claim (a rate limit, fairness). Each is a few lookups, no statement.
CHECKS = {("tracing.py", "active"), ("runner/chunks.py", "_chunk_handler"),
          ("runs/flow.py", "claim_flow")}


def calls_by_function(tmp_path, tasks):
    """{(module path under taskrunner/, function name): calls} of a runner that drains
    `tasks` plain jobs."""
    directory = tmp_path / str(tasks)
    directory.mkdir()
    url = "sqlite:///%s" % (directory / "q.db")
    env = common.child_env()
    subprocess.run([sys.executable, "-m", "taskrunner", "--database", url, "init-db"],
                   env=env, check=True, capture_output=True)
    add_backlog(url, tasks, common.NOOP, None)
    profile = directory / "profile"
    done = subprocess.run([sys.executable, "-m", "cProfile", "-o", str(profile), "-m",
                           "taskrunner", "--database", url, "--log-level", "warning", "runner",
                           "--burst"], env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    counts = collections.Counter()
    for (filename, _line, name), (_, calls, _, _, _) in pstats.Stats(str(profile)).stats.items():
        parts = filename.replace(os.sep, "/").rsplit("/taskrunner/", 1)
        if len(parts) == 2:
            counts[parts[1], name] += calls
    return counts


def test_a_plain_job_runs_no_feature_code_but_one_check_each(tmp_path):
    few, many = calls_by_function(tmp_path, 30), calls_by_function(tmp_path, 90)
    # A refresh on a timer (the rate keys' limits, every few seconds) happens once or twice
    # more in the longer drain: below half a call per job, it is not per job.
    per_job = {key: (many[key] - few[key]) / 60 for key in set(few) | set(many)
               if key[0] in FEATURES and (many[key] - few[key]) / 60 >= 0.5}
    checks = {key: n for key, n in per_job.items() if key in CHECKS}
    assert checks and max(checks.values()) <= 1, checks
    others = {key: n for key, n in per_job.items() if key not in CHECKS}
    assert others == {}, "calls per plain job into a feature's code: %s" % ", ".join(
        "%s:%s (%s) %.2f" % (path, name, FEATURES[path], n)
        for (path, name), n in sorted(others.items()))
