"""Runtime directories (wake-up sockets, claim files) that no other user can abuse.

A runtime directory has a name anyone can compute, in a base directory others may write
(/tmp; the README's setgid group directory, shared on purpose). Whoever makes the name
first could make it a symlink to a directory of ours (whose files a sender would take for
dead sockets and remove), or a directory of their own (which would hear our wake-ups and
hold our claim files, mapped in our runners' memory). So a runtime directory is checked
once, on what was opened, and then used only through that descriptor:

- it is opened with ``O_NOFOLLOW | O_DIRECTORY`` (a symlink is refused) and must be this
  user's own and closed to everyone else (0700); in a shared base (setgid: its group shares
  on purpose) it may belong to a member of the base's group, must have the base's group and
  stay closed to others. Anything else is refused (`RefusedDirectory`).
- its entries are listed, examined (no symlink followed), renamed and removed relative to
  the descriptor, and its sockets are reached through ``/proc/self/fd/N/NAME``, which names
  the directory opened whatever its path has become since (and has no length limit).
- an entry is used or removed only when it is what it should be (a socket, a regular file)
  and its owner is trusted: this user, root, or in a shared base a member of its group.

The files kept beside a SQLite database (the host lock, group commit's counters) sit in the
database's directory, which others may write too: each is opened with `open_own_file`,
which checks what was opened likewise and refuses a file or link planted by someone else.
"""
import errno
import functools
import os
import pwd
import stat

PROC_FD = "/proc/self/fd"
# Without /proc (not Linux), sockets are reached by path: still safe where the base is
# sticky or the user's own, since nobody else can rename what was checked.
HAVE_PROC_FD = os.path.isdir(PROC_FD)
_DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)


class RefusedDirectory(OSError):
    """A runtime directory that another user could control: not used."""


class RefusedFile(OSError):
    """A file beside a database that another user could control: not used."""


def open_own_file(path, flags, mode=0o600):
    """A descriptor of the file `path` beside a database (created with `mode` if missing),
    checked on what was opened: a symbolic link is refused (``O_NOFOLLOW``), and so is
    anything but a regular file with one link of a trusted user, closed to everyone else —
    this user's or root's; in a setgid directory (a group shares it on purpose, see
    `RuntimeDir`) also a group member's, with that group. So a file another user planted
    (which they could lock for ever, read, rewrite or shrink under a mapping: SIGBUS), a hard
    link to a file of ours elsewhere or a FIFO (``O_NONBLOCK``: the open never waits) is
    never used. RefusedFile (an OSError) says why; nothing was written."""
    try:
        fd = os.open(path, flags | os.O_CREAT | os.O_CLOEXEC | os.O_NONBLOCK
                     | getattr(os, "O_NOFOLLOW", 0), mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise RefusedFile(exc.errno, "a symbolic link, refused", path) from None
        raise
    try:
        info = os.fstat(fd)
        base = os.stat(os.path.dirname(os.path.abspath(path)))  # the operator's: followed
        uid = os.geteuid()
        if base.st_mode & stat.S_ISGID:
            safe = (info.st_uid in (uid, 0) or member(info.st_uid, base.st_gid)) \
                and info.st_gid == base.st_gid and not info.st_mode & 0o007
        else:
            safe = info.st_uid in (uid, 0) and not info.st_mode & 0o077
        if not (safe and stat.S_ISREG(info.st_mode) and info.st_nlink == 1):
            raise RefusedFile(errno.EPERM, "not this user's own file (owner uid %d, group %d, "
                              "mode %04o, %d link(s)), refused" % (
                                  info.st_uid, info.st_gid, stat.S_IMODE(info.st_mode),
                                  info.st_nlink), path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def everyone_may_write(directory):
    """Whether every user may create entries in `directory` (/tmp: sticky or not — in a
    sticky directory they cannot remove ours, but can take a name first)."""
    try:
        return bool(os.stat(directory).st_mode & 0o002)
    except OSError:
        return False


# Cached for the process's life: a change of a group's members counts from the next start.
@functools.lru_cache(maxsize=256)
def member(uid, gid):
    """Whether the user `uid` belongs to the group `gid` (primary or supplementary)."""
    try:
        user = pwd.getpwuid(uid)
        return gid in os.getgrouplist(user.pw_name, user.pw_gid)
    except (KeyError, OSError):
        return False


def _base_of(path):
    """The directory `path` is in. Worked out only once `path` is there to check (or about
    to be made): a sender finding no directory — nobody listens, the common case, after
    every run a runner ends (wake_waiters) — pays the one failed open alone."""
    return os.path.dirname(os.path.abspath(path))


def _mode_in(base):
    """(the mode of a runtime directory made in `base`, the gid it is shared with or None):
    0700, or in a setgid base the base's group bits too."""
    info = os.stat(base)
    if info.st_mode & stat.S_ISGID:
        return 0o700 | (info.st_mode & 0o070), info.st_gid
    return 0o700, None


class RuntimeDir:
    """An open runtime directory, checked (see the module's docstring). `path` is what it
    was opened as, for messages and for other processes to find; `group` is the gid it is
    shared with, or None."""

    def __init__(self, fd, path, group):
        self.fd, self.path, self.group = fd, path, group
        self.uid = os.geteuid()

    @classmethod
    def open(cls, path, create=False):
        """The directory `path`, made (with `create`) if it is missing. OSError when it
        cannot be opened: FileNotFoundError when it is missing (one failed open: what a
        sender pays when nobody listens), RefusedDirectory when it is not safe to use."""
        made = False
        if create:
            mode, _ = _mode_in(_base_of(path))
            try:
                os.mkdir(path, mode)
                made = True
            except FileExistsError:
                pass
        try:
            fd = os.open(path, _DIRECTORY)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                raise RefusedDirectory(exc.errno, "not a directory (a symbolic link?), "
                                       "refused", path) from None
            raise
        directory = cls(fd, path, None)
        try:
            # The base is the operator's choice (a symlink to it is theirs): followed.
            mode, directory.group = _mode_in(_base_of(path))
            if made:    # the umask must not narrow a shared directory
                os.chmod(fd, mode | (stat.S_ISGID if directory.group is not None else 0))
            directory._check(os.fstat(fd))
        except OSError:
            directory.close()
            raise
        return directory

    def _check(self, info):
        if self.group is None:
            safe = info.st_uid == self.uid and not info.st_mode & 0o077
        else:
            safe = self.trusted(info.st_uid) and info.st_gid == self.group \
                and not info.st_mode & 0o007
        if not safe:
            raise RefusedDirectory(errno.EPERM, "not this user's own (owner uid %d, group %d, "
                                   "mode %04o), refused" % (info.st_uid, info.st_gid,
                                                           stat.S_IMODE(info.st_mode)),
                                   self.path)

    def trusted(self, uid):
        """Whether files of the user `uid` may be used and removed here."""
        return uid == self.uid or uid == 0 or (self.group is not None
                                               and member(uid, self.group))

    def address(self, name):
        """The path of the entry `name` of the directory opened, for a socket's bind,
        connect or sendto."""
        if HAVE_PROC_FD:
            return "%s/%d/%s" % (PROC_FD, self.fd, name)
        return os.path.join(self.path, name)

    def entry(self, name, kind=None):
        """The lstat of the entry `name` if it exists, is of `kind` (stat.S_ISSOCK, ...)
        and belongs to a trusted user; else None."""
        try:
            info = os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        except OSError:
            return None
        if (kind is not None and not kind(info.st_mode)) or not self.trusted(info.st_uid):
            return None
        return info

    def sockets(self):
        """The names of the sockets of trusted users in the directory, hidden names
        (temporary ones) apart."""
        return [name for name in os.listdir(self.fd)
                if not name.startswith(".") and self.entry(name, stat.S_ISSOCK) is not None]

    def remove(self, name, kind=stat.S_ISSOCK):
        """Remove the entry `name` if it is of `kind` and a trusted user's; whether it was."""
        if self.entry(name, kind) is None:
            return False
        try:
            os.unlink(name, dir_fd=self.fd)
        except OSError:
            return False
        return True

    def chmod(self, name, mode):
        """Set the mode of this user's own socket `name` (just bound): through a descriptor
        of the entry itself, so that a symlink put in its place is never followed."""
        if not HAVE_PROC_FD:
            os.chmod(os.path.join(self.path, name), mode)
            return
        fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self.fd)
        try:
            info = os.fstat(fd)
            if not stat.S_ISSOCK(info.st_mode) or info.st_uid != self.uid:
                raise RefusedDirectory(errno.EPERM, "replaced while it was made", name)
            os.chmod("%s/%d" % (PROC_FD, fd), mode)
        finally:
            os.close(fd)

    def rename(self, old, new):
        os.rename(old, new, src_dir_fd=self.fd, dst_dir_fd=self.fd)

    def remove_if_empty(self):
        """Remove the directory if it is empty and still at its path."""
        try:
            here, there = os.fstat(self.fd), os.stat(self.path, follow_symlinks=False)
            if (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino):
                os.rmdir(self.path)
        except OSError:
            pass     # not empty (another listener), or gone already

    def identity(self):
        """What tells this directory apart from one made again at its path, and when its
        listing last changed: ((device, inode, mtime in ns), mtime in s)."""
        info = os.fstat(self.fd)
        return (info.st_dev, info.st_ino, info.st_mtime_ns), info.st_mtime

    def close(self):
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
