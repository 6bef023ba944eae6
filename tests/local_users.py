"""A throwaway second local user for the tests that prove what another user on the host
can and cannot do (wake-up directories, claim files, the hub, the dashboard). Tests run as
root; without root they skip.

Python lives where such a user may not read it (/root), so its process starts as root,
imports what it needs, and then becomes the other user for good (groups, gid, uid) before
it does anything else."""
import os
import pwd
import subprocess
import sys
import uuid

import pytest

from conftest import process_env


@pytest.fixture
def other_user():
    """A fresh local user (a pwd entry, with a group of its own), removed afterwards even
    when the test fails."""
    if os.geteuid() != 0:
        pytest.skip("needs root to add a throwaway user")
    name = "trw%s" % uuid.uuid4().hex[:8]
    subprocess.run(["useradd", "--no-create-home", "--user-group", "--shell",
                    "/usr/sbin/nologin", name], check=True)
    try:
        yield pwd.getpwnam(name)
    finally:
        subprocess.run(["userdel", "-r", name], check=False, capture_output=True)


def become(imports=""):
    """Python source that imports `imports` as root, then drops to $BECOME_UID/GID."""
    return ("import os, sys\n%s\nos.setgroups([])\nos.setgid(int(os.environ['BECOME_GID']))\n"
            "os.setuid(int(os.environ['BECOME_UID']))\nassert os.geteuid() != 0\n" % imports)


def as_user(user, code, argv=(), imports="import json, socket, time", env=None):
    """(argv, Popen/run keyword arguments) of `code` run by `user`, after `imports`."""
    environ = process_env(dict(env or {}, BECOME_UID=str(user.pw_uid),
                               BECOME_GID=str(user.pw_gid), PYTHONDONTWRITEBYTECODE="1"))
    environ.pop("XDG_RUNTIME_DIR", None)
    return [sys.executable, "-c", become(imports) + code] + list(argv), dict(env=environ,
                                                                             cwd="/")


def run_as(user, code, *argv, timeout=60, **kwargs):
    """Run `code` as `user` to completion; the CompletedProcess (text), which must exit 0."""
    args, options = as_user(user, code, argv, **kwargs)
    done = subprocess.run(args, capture_output=True, text=True, timeout=timeout, check=False,
                          **options)
    assert done.returncode == 0, done.stderr
    return done
