"""The child side of :mod:`clusterlm.tasks.sandbox`: the harness that runs one program in a fresh interpreter.

:func:`clusterlm.tasks.sandbox.execute_program` starts ``python -I -c <this file's source> PAYLOAD NONCE_FD
VERDICT_FD`` (it imports nothing of clusterlm, so any Python can run it). The harness, in order:

1. reads the secret token from the ``NONCE_FD`` pipe (then closes it) and the payload (program, test, entry point,
   limits) from ``PAYLOAD``, a file in the working directory that it deletes;
2. sets its resource limits (soft = hard, so the program cannot raise them): CPU seconds, address space and data
   segment, file size, open files, processes, no core dumps;
3. compiles the program and the test, then installs the guard (:func:`install_guard`): an audit hook, which
   cannot be removed, and replacements of the few functions audit events do not cover;
4. writes ``ready`` to ``VERDICT_FD``, runs the program, then the test, then calls the test's own ``check`` (the
   code object compiled from the test, checked by identity) on the entry point;
5. only when that call returns writes ``<token>:passed`` to ``VERDICT_FD``, and ends with ``os._exit`` (no atexit
   handler, finalizer or thread of the program runs after the verdict). Any exception, ``SystemExit`` included,
   writes ``failed:<exception>`` instead.

The token exists only as a local of :func:`main`, whose frame the guard keeps out of reach (no ``sys._getframe``,
traceback/generator/coroutine frames, trace or profile functions, ``gc`` object walks or ``ctypes``; no reading
``/proc/*/mem``). This defeats a program that exits early, prints ``passed``, replaces ``check`` or sets a trace
function; it is not a boundary against a program that finds another way into the interpreter's memory (the audit
hooks of Python are not a security mechanism): the operating-system limits of the parent are.
"""

import os
import sys

READY = b"ready\n"
BLOCKED_EVENTS = (
    "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty", "subprocess.Popen",
    "os.kill", "os.killpg", "resource.setrlimit", "resource.prlimit", "sys.settrace", "sys.setprofile",
    "sys._current_frames", "gc.get_objects", "gc.get_referrers", "gc.get_referents", "os.chroot", "os.setxattr",
    "os.removexattr", "os.chflags", "os.lchflags", "webbrowser.open", "sys.remote_exec",
)
BLOCKED_PREFIXES = ("socket.", "ctypes.", "_winapi.", "winreg.")
FRAME_ATTRIBUTES = ("tb_frame", "gi_frame", "cr_frame", "ag_frame", "f_back")
BLOCKED_MODULES = ("posix", "_posixsubprocess", "_signal", "_ctypes")  # made again, they would be unguarded
PATH_EVENTS = {  # event -> (indices of path arguments, index of the dir_fd argument(s) or None)
    "os.remove": ((0,), (1,)), "os.rmdir": ((0,), (1,)), "os.mkdir": ((0,), (2,)), "os.rename": ((0, 1), (2, 3)),
    "os.link": ((0, 1), (2, 3)), "os.symlink": ((1,), (2,)), "os.chmod": ((0,), (2,)), "os.chown": ((0,), (3,)),
    "os.truncate": ((0,), ()), "os.utime": ((0,), (3,)), "shutil.rmtree": ((0,), (1,)), "shutil.chown": ((0,), ()),
    "shutil.copyfile": ((1,), ()), "shutil.copymode": ((1,), ()), "shutil.copystat": ((1,), ()),
    "shutil.copytree": ((1,), ()), "shutil.move": ((1,), ()), "shutil.make_archive": ((0,), ()),
}
UNIX_FAMILY = 1  # socket.AF_UNIX
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
WRITABLE_DEVICES = ("/dev/null",)
READABLE_DEVICES = ("/dev/null", "/dev/zero", "/dev/random", "/dev/urandom", "/dev/stdin", "/dev/stdout",
                    "/dev/stderr", "/dev/fd", "/dev/shm")


def read_all(fd):
    chunks = []
    while True:
        chunk = os.read(fd, 65536)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


def set_limits(limits):
    """Soft = hard resource limits (a process may lower a hard limit, never raise it back)."""
    try:
        import resource
    except ImportError:  # not POSIX: nothing to set
        return
    for name, value in limits.items():
        which = getattr(resource, name, None)
        if which is None or value is None:
            continue
        try:
            resource.setrlimit(which, (value, value))
        except (ValueError, OSError):  # e.g. RLIMIT_AS on macOS
            pass


class PathRules:
    """Is a path inside the working directory? Resolved with functions taken before the program runs."""

    def __init__(self, workdir):
        import posix
        self.lstat, self.readlink, self.getcwd, self.fspath = posix.lstat, posix.readlink, posix.getcwd, os.fspath
        self.is_link = __import__("stat").S_ISLNK
        self.root = self.resolve(workdir)

    def resolve(self, path, depth=0):
        path = self.fspath(path)
        if isinstance(path, bytes):
            path = path.decode("utf-8", "surrogateescape")
        if not path.startswith("/"):
            path = self.getcwd() + "/" + path
        parts, done = [p for p in path.split("/") if p not in ("", ".")], []
        while parts:
            part = parts.pop(0)
            if part == "..":
                done = done[:-1]
                continue
            here = "/" + "/".join([*done, part])
            try:
                link = self.is_link(self.lstat(here).st_mode) and depth < 40
            except OSError:
                link = False
            if link:
                target = self.readlink(here)
                resolved = self.resolve(target if target.startswith("/") else "/" + "/".join([*done, target]),
                                        depth + 1)
                done = [p for p in resolved.split("/") if p]
            else:
                done.append(part)
        return "/" + "/".join(done)

    def inside(self, path):
        p = self.resolve(path)
        return p == self.root or p.startswith(self.root + "/")

    def readable(self, path):
        p = self.resolve(path)
        if p.startswith("/proc/"):
            return p.rsplit("/", 1)[-1] not in ("mem", "environ", "pagemap", "kcore")
        return not p.startswith("/dev/") or p.startswith(READABLE_DEVICES)


def refuse(what):
    raise PermissionError(f"sandbox: {what} is not allowed")


def check_open(rules, args):
    path, mode, flags = (list(args) + [None, None, None])[:3]
    if isinstance(path, int):
        return
    writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
        isinstance(flags, int) and flags & WRITE_FLAGS)
    if writes and not (rules.inside(path) or rules.resolve(path) in WRITABLE_DEVICES):
        refuse(f"writing {path!r} (outside the working directory)")
    if not writes and not rules.readable(path):
        refuse(f"reading {path!r}")


def check_paths(rules, event, args):
    paths, dir_fds = PATH_EVENTS[event]
    for i in dir_fds:
        if i < len(args) and args[i] not in (None, -1):
            refuse(f"{event} relative to a directory descriptor")
    for i in paths:
        if i < len(args) and args[i] is not None and not isinstance(args[i], int) and not rules.inside(args[i]):
            refuse(f"{event} on {args[i]!r} (outside the working directory)")


def make_hook(rules):
    def hook(event, args):
        if event == "socket.__new__" and len(args) > 1 and args[1] == UNIX_FAMILY:
            return  # socketpair (asyncio's self-pipe); connect, bind and send are refused
        if event in BLOCKED_EVENTS or event.startswith(BLOCKED_PREFIXES):
            refuse(event)
        if event == "open":
            check_open(rules, args)
        elif event in PATH_EVENTS:
            check_paths(rules, event, args)
        elif event == "sys._getframe":
            raise ValueError("call stack is not deep enough")  # what callers of sys._getframe already handle
        elif event == "object.__getattr__" and len(args) > 1 and args[1] in FRAME_ATTRIBUTES:
            refuse(f"reading .{args[1]}")
        elif event == "import" and args and args[0] in BLOCKED_MODULES:
            refuse(f"importing {args[0]} again")
    return hook


def install_guard(workdir):
    """The reliability guard: refuse process creation, signals to other processes, sockets, ctypes, frame
    walking, trace functions, writes and deletions outside ``workdir``; most through an audit hook, the rest by
    replacing the functions (``os.open`` with ``dir_fd``, ``_posixsubprocess.fork_exec``, re-creating blocked
    built-in modules through ``_imp``)."""
    import _imp
    import builtins
    import faulthandler
    faulthandler.disable()
    rules = PathRules(workdir)
    blocked = set(BLOCKED_MODULES)

    def no_process(*args, **kwargs):
        refuse("starting a process")

    def wrap_create(create):
        def guarded(spec, *rest):
            if getattr(spec, "name", None) in blocked:
                refuse(f"creating the module {spec.name} again")
            return create(spec, *rest)
        return guarded

    original_open = os.open

    def guarded_open(path, flags, mode=0o777, *, dir_fd=None):
        if dir_fd is not None:
            refuse("os.open relative to a directory descriptor")
        return original_open(path, flags, mode)

    try:  # imported now, so that importing subprocess works and its fork_exec is the refusing one
        import _posixsubprocess
        _posixsubprocess.fork_exec = no_process
    except ImportError:
        pass

    import _signal
    current = _signal.getsignal

    def no_handler(signalnum, handler):
        """Install nothing (a Python handler is called with the interrupted frame): the handler stays."""
        return current(signalnum)

    _signal.signal = no_handler
    if "posix" in sys.modules:
        sys.modules["posix"].open = guarded_open
    os.open = guarded_open
    _imp.create_builtin = wrap_create(_imp.create_builtin)
    _imp.create_dynamic = wrap_create(_imp.create_dynamic)
    builtins.help = None  # pydoc's pager starts a process
    sys.addaudithook(make_hook(rules))


def check_code(test_code):
    """The code object of ``def check`` in the compiled test (None: the test defines none)."""
    for const in test_code.co_consts:
        if getattr(const, "co_name", None) == "check":
            return const
    return None


def describe(error):
    try:
        text = f"{type(error).__name__}: {error}".rstrip(": ")
    except BaseException:  # a program's exception whose __str__ fails
        text = "an exception whose message cannot be shown"
    return text[:2000]


def run(payload, codes, exec_, function_type):
    """Run the program, the test and, when the test defines ``check``, ``check(entry_point)``; raises whatever
    they raise. A test without ``check`` is its own check (asserts at its top level, MBPP style).

    ``check`` is made afresh from the code object compiled from the test (the program's names as its globals), so
    a program that rebinds ``check`` in its namespace changes nothing; ``exec_`` and ``function_type`` were taken
    before the program ran (it may rebind the built-ins)."""
    program_code, test_code, checker_code = codes
    entry = payload.get("entry_point")
    namespace = {"__name__": "__sandbox__" if test_code is not None else "__main__", "__builtins__": __builtins__}
    exec_(program_code, namespace)
    if test_code is None:
        return
    exec_(test_code, namespace)
    if checker_code is None:
        return
    if not entry or entry not in namespace:
        raise NameError(f"the entry point {entry!r} is not defined")
    candidate = namespace[entry]
    function_type(checker_code, namespace)(candidate)


def main():
    payload_path, nonce_fd, verdict_fd = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    write, exit_now = os.write, os._exit
    nonce = read_all(nonce_fd)
    os.close(nonce_fd)
    import json
    with open(payload_path, "rb") as f:
        payload = json.loads(f.read().decode("utf-8"))
    os.remove(payload_path)
    if payload.get("unshare_net") and hasattr(os, "unshare"):  # Python >= 3.12, privileged: no network
        try:
            os.unshare(os.CLONE_NEWNET)
        except OSError:
            pass
    set_limits(payload["limits"])
    try:
        program_code = compile(payload["program"], "<program>", "exec")
        test = payload.get("test")
        test_code = compile(test, "<test>", "exec") if test is not None else None
    except BaseException as e:  # SyntaxError, or a program too deep to compile
        write(verdict_fd, b"failed:" + describe(e).encode("utf-8", "replace"))
        exit_now(1)
    codes = (program_code, test_code, check_code(test_code) if test_code is not None else None)
    exec_, function_type = exec, type(main)
    if payload.get("guard", True):
        install_guard(os.getcwd())
    write(verdict_fd, READY)
    try:
        run(payload, codes, exec_, function_type)
    except BaseException as e:
        try:
            write(verdict_fd, b"failed:" + describe(e).encode("utf-8", "replace"))
        finally:
            exit_now(1)
    write(verdict_fd, nonce + b":passed\n")
    exit_now(0)


if __name__ == "__main__":
    main()
