"""``taskrunner runner --reload``, for development: the runner watches the files of the
modules it has imported from outside the Python installation (your task modules and what
they import; the standard library and installed packages are left alone) and, when one
changes on disk, stops as on HUP — its current run finished, nothing more claimed — and
starts again in the same process (exec), so that every task runs the code on disk. A module
imported after the runner started is watched from its import on."""
import os
import sys
import sysconfig


def _library_roots():
    paths = sysconfig.get_paths()
    roots = {os.path.realpath(paths[key]) for key in ("stdlib", "platstdlib", "purelib", "platlib")
             if key in paths}
    return tuple(root + os.sep for root in roots)


class CodeWatch:
    """The modification times of the watched modules' files, as first seen."""

    def __init__(self):
        self.libraries = _library_roots()
        self.seen = {}          # module name -> (file, mtime)
        self.changed()

    def changed(self):
        """The first watched file that changed since it was first seen, or None."""
        for name, module in list(sys.modules.items()):
            if name in self.seen:
                path, mtime = self.seen[name]
                if _mtime(path) != mtime:
                    return path
                continue
            path = getattr(module, "__file__", None)
            if not path or not path.endswith(".py"):
                continue
            path = os.path.realpath(path)
            if not path.startswith(self.libraries):
                self.seen[name] = (path, _mtime(path))
        return None


def _mtime(path):
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return None        # removed (or being replaced): a change too, once it differs


def restart():
    """Replace this process with the command that started it, as it was typed (a console
    script, ``python -m taskrunner`` or ``python manage.py taskrunner``)."""
    import psutil
    sys.stdout.flush()
    sys.stderr.flush()
    command = psutil.Process().cmdline()
    os.execv(sys.executable, [sys.executable] + command[1:])
