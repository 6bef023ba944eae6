"""The documentation cannot rot: every code example of the README and the docs runs as
written (tests/docs_runner.py, one fresh directory per page), and the generated references
cover everything the code declares."""
import glob
import json
import os
import re
import subprocess
import sys

import pytest

from conftest import REPO_DIR, TESTS_DIR, process_env

sys.path.insert(0, os.path.join(REPO_DIR, "docs"))
import gen_reference  # noqa: E402  (docs/gen_reference.py: the references' generator)

PAGES = ["README.md"] + sorted(
    os.path.relpath(p, REPO_DIR) for p in glob.glob(os.path.join(REPO_DIR, "docs", "**", "*.md"),
                                                    recursive=True))
FENCE = re.compile(r"^```([\w-]*)(.*)$")
SKIP = re.compile(r"^<!-- example: skip \((.+)\) -->$")
TITLE = re.compile(r'title="([^"]+)"')
# What a fenced block may be: code the runner executes or checks, or text it leaves alone
# (a program's output, a unit file, a config of another program, a diagram).
RUN = {"python", "sh", "bash", "toml", "ini", "yaml"}
TEXT = {"text", "systemd", "supervisord"}


def code_blocks(page):
    """[(language, title, code, line, skip reason)] of a Markdown page's fenced blocks."""
    lines = open(os.path.join(REPO_DIR, page), encoding="utf-8").read().split("\n")
    blocks, i = [], 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if match:
            start = i
            end = lines.index("```", i + 1)
            title = TITLE.search(match.group(2))
            skip = SKIP.match(lines[start - 1]) if start else None
            blocks.append((match.group(1), title.group(1) if title else None,
                           "\n".join(lines[start + 1:end]) + "\n", start + 1,
                           skip.group(1) if skip else None))
            i = end
        i += 1
    return blocks


def test_every_block_is_run_or_says_why_not():
    """A block in a language the runner does not know would silently never run."""
    for page in PAGES:
        for lang, title, _code, line, skip in code_blocks(page):
            where = "%s:%d" % (page, line)
            assert lang in RUN | TEXT, "%s: a ``` block needs a known language, not %r" % (
                where, lang)
            if lang in TEXT:
                assert skip is None, "%s: a %s block is never run; drop the skip" % (where, lang)


@pytest.mark.parametrize("page", PAGES)
def test_examples_run(page, tmp_path):
    plan = [{"lang": lang, "title": title, "code": code, "where": "%s:%d" % (page, line)}
            for lang, title, code, line, skip in code_blocks(page)
            if lang in RUN and skip is None]
    if not plan:
        return
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    # `taskrunner` in a shell block is this checkout's, whatever is installed, and `python`
    # the interpreter running the tests (a venv's, not on PATH when the README's command
    # calls .venv/bin/python): as in the reader's activated virtualenv.
    bin_dir = tmp_path / ".bin"
    bin_dir.mkdir()
    for name, argv in (("taskrunner", ' -m taskrunner'), ("python", ""), ("python3", "")):
        (bin_dir / name).write_text('#!/bin/sh\nexec "%s"%s "$@"\n' % (sys.executable, argv))
        (bin_dir / name).chmod(0o755)
    work = tmp_path / "work"
    work.mkdir()
    env = process_env({"PATH": "%s%s%s" % (bin_dir, os.pathsep, os.environ["PATH"])})
    env["PYTHONPATH"] = os.pathsep.join([str(work), REPO_DIR])
    result = subprocess.run([sys.executable, os.path.join(TESTS_DIR, "docs_runner.py"),
                             str(tmp_path / "plan.json")], cwd=work, env=env,
                            capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr


def test_configuration_reference_describes_every_key():
    from taskrunner import config
    declared = {(section, key) for section, keys in config.SCHEMA.items() for key in keys}
    assert declared == set(config.DESCRIPTIONS)
    assert set(config.QUEUE_SCHEMA) == set(config.QUEUE_DESCRIPTIONS)
    page = gen_reference.config_markdown()
    for section, key in declared:
        assert "## [%s]" % section in page and "| `%s` |" % key in page


def test_periodic_keys_described_are_the_ones_accepted():
    from taskrunner.config import PERIODIC_DESCRIPTIONS, Config
    from taskrunner.errors import InputError
    from taskrunner.periodic.definitions import definition
    config = Config.from_dict({})
    base = {"name": "n", "handler": "taskrunner.handlers.Echo", "timer": "hourly"}
    values = {"data": {}, "priority": 1, "enabled": True, "catch_up": "skip",
              "max_runtime": "1min", "min_spacing": "1min", "timebox": "half",
              "tolerance": "1s", "max_retries": 2, "owner": "o", "submitter": "s",
              "subject": "s", "group": "g", "queue": "q", "resume": True, "jitter": "5min"}
    for key in PERIODIC_DESCRIPTIONS:
        spec = dict(base, **({key: values[key]} if key in values else {}))
        if key == "timebox" or key == "tolerance":
            spec["timer"] = "every 1h"
        definition(config, spec, "[[periodic]]", import_handler=False)
    with pytest.raises(InputError, match="unknown key"):
        definition(config, dict(base, undescribed=1), "[[periodic]]", import_handler=False)


def test_cli_reference_has_every_command():
    from taskrunner.cli.commands import build_parser
    page = gen_reference.cli_markdown()
    for name, sub in gen_reference._subcommands(build_parser()).items():
        assert "\n## %s\n" % name in page
        for action in gen_reference._subcommands(sub):
            assert "\n### %s %s\n" % (name, action) in page


def test_metrics_named_in_the_docs_exist():
    """Alert rules and dashboards in the docs must name metrics that are exposed."""
    pytest.importorskip("prometheus_client")
    exposed = set()
    for name, kind, _text, _labels in gen_reference.metric_families():
        exposed.add(name)
        if kind == "histogram":
            exposed.update(name + suffix for suffix in ("_bucket", "_sum", "_count"))
    named = set()
    for page in PAGES:
        text = open(os.path.join(REPO_DIR, page), encoding="utf-8").read()
        named.update(re.findall(r"\btaskrunner_[a-z_]+[a-z]\b", text))
    named -= {"taskrunner_migrations", "taskrunner_verify_effects"}     # tables, not metrics
    assert named and named <= exposed, sorted(named - exposed)


def test_install_messages_name_this_distribution(tmp_path):
    """`taskrunner` on PyPI is another project: what the CLI tells a user to install must be
    this distribution, by the name in pyproject.toml."""
    from taskrunner.config import tomllib
    with open(os.path.join(REPO_DIR, "pyproject.toml"), "rb") as fh:
        name = tomllib.load(fh)["project"]["name"]
    assert name != "taskrunner"
    # A missing driver or prometheus-client, as on a machine without the extra.
    script = ("import sys; sys.modules[%r] = None\n"
              "from taskrunner.cli import main\n"
              "sys.exit(main(sys.argv[1:]))\n")
    for module, argv, extra in (
            ("prometheus_client", ["--database", "sqlite:///%s/t.db" % tmp_path, "metrics"], "web"),
            ("psycopg", ["--database", "postgresql://u@127.0.0.1:1/db", "status"], "postgres"),
            ("pymysql", ["--database", "mysql://u@127.0.0.1:1/db", "status"], "mysql")):
        result = subprocess.run([sys.executable, "-c", script % module] + argv, cwd=tmp_path,
                                env=process_env(), capture_output=True, text=True, timeout=60)
        assert result.returncode == 2, result.stderr
        assert "pip install '%s[%s]'" % (name, extra) in result.stderr, result.stderr
    for page in PAGES:
        text = open(os.path.join(REPO_DIR, page), encoding="utf-8").read()
        assert not re.search(r"pip install '?taskrunner\[", text), page


def test_layout_sections_name_every_package():
    """The README's and the architecture page's Layout tables follow the package."""
    package = os.path.join(REPO_DIR, "taskrunner")
    names = {name for name in os.listdir(package)
             if os.path.isfile(os.path.join(package, name, "__init__.py"))}
    names |= {name[:-3] for name in os.listdir(package)
              if name.endswith(".py") and not name.startswith("__")}
    for page, heading in (("README.md", "## Layout"),
                          ("docs/explanation/architecture.md", "## Layout")):
        text = open(os.path.join(REPO_DIR, page), encoding="utf-8").read()
        section = text[text.index(heading):]
        section = section[:section.find("\n## ", 1)]
        missing = sorted(n for n in names if not re.search(r"`%s[/`]" % n, section))
        assert not missing, "%s's Layout does not name %s" % (page, missing)


def test_the_deploy_page_shows_the_shipped_supervisord_conf_not_a_copy():
    """A copy drifted from the file that tests/test_deploy.py runs; the page now includes it."""
    page = open(os.path.join(REPO_DIR, "docs", "how-to", "deploy.md"), encoding="utf-8").read()
    assert "<!-- generated: supervisord -->" in page
    assert "[program:" not in page
    shipped = open(os.path.join(REPO_DIR, "supervisord.conf"), encoding="utf-8").read()
    block = gen_reference.supervisord_markdown()
    assert shipped[shipped.index("[program:taskrunner]"):].strip() in block
    assert block.startswith("```ini\n") and block.endswith("\n```\n")


def test_the_readme_and_the_docs_home_give_the_same_measured_detection_time():
    """They said "within milliseconds" and "within seconds"; the benchmark's p99 (the
    performance page's "kill → timeout") is what both say now."""
    claims = []
    for page in ("README.md", os.path.join("docs", "index.md")):
        text = " ".join(open(os.path.join(REPO_DIR, page), encoding="utf-8").read().split())
        claims.append(re.search(r"a runner killed with `kill -9` is marked dead [^.]*\.", text)
                      .group(0))
    assert claims[0] == claims[1]
    assert "50 ms" in claims[0]


def test_the_pages_speak_to_users_not_about_the_projects_history():
    """The README becomes the package index's page: no issue numbers, no "the seeds" (the
    systems the design started from); name a system when it matters (In-Portal, Celery).
    how-to/periodic.md is rewritten with the periodic scheduler's work."""
    history = re.compile(r"\bissues? \d+|\bseeds?\b|#\d{2,}\b", re.IGNORECASE)
    for page in PAGES:
        if page == os.path.join("docs", "how-to", "periodic.md"):
            continue
        text = open(os.path.join(REPO_DIR, page), encoding="utf-8").read()
        found = history.findall(text)
        assert not found, "%s: %s" % (page, found)
