"""The child side of :mod:`clusterlm.tasks.sandbox`: the harness that runs one program in a fresh interpreter.

:func:`clusterlm.tasks.sandbox.execute_program` starts ``python -I -c <this file's source> PAYLOAD NONCE_FD
VERDICT_FD`` (it imports nothing of clusterlm, so any Python can run it). The harness, in order:

1. reads the secret token from the ``NONCE_FD`` pipe (then closes it) and the payload (program, test, entry point,
   limits) from ``PAYLOAD``, a file in the working directory that it deletes;
2. sets its resource limits (soft = hard, so the program cannot raise them): CPU seconds, address space and data
   segment, file size, open files, processes, no core dumps;
3. compiles the program and the test, then installs the guard (:func:`install_guard`): an audit hook, which
   cannot be removed, and replacements of the few functions audit events do not cover;
4. writes ``ready`` to ``VERDICT_FD``, runs the program, then the test, then calls ``check`` (a function made
   afresh from the code object compiled from the test, so rebinding or patching the program's ``check`` changes
   nothing) on the entry point;
5. only when that call returns writes ``<token>:passed`` to ``VERDICT_FD``, and ends with ``os._exit`` (no atexit
   handler, finalizer or thread of the program runs after the verdict). Any exception, ``SystemExit`` included,
   writes ``failed:<exception>`` instead.

The token exists only as a local of :func:`main`, whose frame the guard keeps out of reach: no ``sys._getframe``
(it raises ValueError, which its callers handle), no traceback, generator, coroutine or async-generator frames, no
trace or profile functions, no Python signal handlers (they receive the interrupted frame: installing one does
nothing), no ``gc`` object walks, no ``ctypes``, no reading ``/proc/*/mem``, no native module that the program
wrote. The guard itself depends on nothing the program can change: the harness's module leaves ``sys.modules``
before the program starts, the builtins it calls were taken before, and the functions it puts in place keep what
they need in keyword defaults that the audit hook refuses to show.

This defeats a program that exits early, prints ``passed``, writes to the verdict pipe, replaces ``check``, rebinds
builtins or sets a trace function. It is not a boundary against a program that reaches the interpreter's memory by
a way not listed here (crafted bytecode, a race between threads; Python's audit hooks are not a security
mechanism): the operating-system limits of the parent are.
"""

import os
import sys

# The builtins the guard calls, taken before the program runs (it may rebind the builtins module's names); the
# runner's module is taken out of sys.modules before the program starts, so these stay out of its reach.
_len, _isinstance, _any, _list, _bytes, _int, _str = len, isinstance, any, list, bytes, int, str
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
PATH_EVENTS = {  # event -> (indices of its path arguments, indices of its dir_fd arguments)
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
        if _isinstance(path, _bytes):
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
    path, mode, flags = (_list(args) + [None, None, None])[:3]
    if _isinstance(path, _int):
        return
    if mode is None and not rules.fspath(path).startswith("/" if _isinstance(path, _str) else b"/"):
        # os.open: the audit event does not say whether dir_fd is given, so a relative path is refused
        refuse(f"os.open of the relative path {path!r} (give an absolute path)")
    writes = (_isinstance(mode, _str) and _any(c in mode for c in "wax+")) or (
        _isinstance(flags, _int) and flags & WRITE_FLAGS)
    if writes and not (rules.inside(path) or rules.resolve(path) in WRITABLE_DEVICES):
        refuse(f"writing {path!r} (outside the working directory)")
    if not writes and not rules.readable(path):
        refuse(f"reading {path!r}")


def check_paths(rules, event, args):
    paths, dir_fds = PATH_EVENTS[event]
    for i in dir_fds:
        if i < _len(args) and args[i] not in (None, -1):
            refuse(f"{event} relative to a directory descriptor")
    for i in paths:
        if i >= _len(args) or args[i] is None:
            continue
        if _isinstance(args[i], _int):  # a descriptor: only one opened for writing (inside) can be truncated
            if event != "os.truncate":
                refuse(f"{event} on a file descriptor")
        elif not rules.inside(args[i]):
            refuse(f"{event} on {args[i]!r} (outside the working directory)")


def make_hook(rules, wrappers):
    """The audit hook (it cannot be removed; nothing the program can reach refers to it or to ``rules``)."""
    def hook(event, args):
        if event == "socket.__new__" and _len(args) > 1 and args[1] == UNIX_FAMILY:
            return  # socketpair (asyncio's self-pipe); connect, bind and send are refused
        if event in BLOCKED_EVENTS or event.startswith(BLOCKED_PREFIXES):
            refuse(event)
        if event == "open":
            check_open(rules, args)
        elif event in PATH_EVENTS:
            check_paths(rules, event, args)
        elif event == "sys._getframe":
            raise ValueError("call stack is not deep enough")  # what callers of sys._getframe already handle
        elif event == "object.__getattr__" and _len(args) > 1:
            if args[1] in FRAME_ATTRIBUTES:
                refuse(f"reading .{args[1]}")
            if args[1] in ("__defaults__", "__kwdefaults__") and _any(args[0] is w for w in wrappers):
                refuse("reading the guard's own functions")
        elif event == "import" and args:
            if args[0] in BLOCKED_MODULES:
                refuse(f"importing {args[0]} again")
            if _len(args) > 1 and _isinstance(args[1], _str) and rules.inside(args[1]):
                refuse(f"loading the native module {args[1]!r} (written by the program)")
    return hook


# The functions the guard puts in place of others. They run in a namespace of their own and keep what they need
# in keyword defaults (whose reading the audit hook refuses for them), never in closures, which any program could
# read (``__closure__`` is not audited), or in globals it could rebind.
WRAPPERS = """
def make(create_builtin, create_dynamic, getsignal, blocked):
    class Spec:
        __slots__ = ("name", "loader", "origin", "submodule_search_locations", "cached", "parent",
                     "has_location")

        def __init__(self, name, loader, origin):
            self.name, self.loader, self.origin = name, loader, origin
            self.submodule_search_locations = self.cached = self.parent = None
            self.has_location = origin is not None

    def no_process(*args, **kwargs):
        raise PermissionError("sandbox: starting a process is not allowed")

    def no_handler(signalnum, handler, *, _current=getsignal):
        # a Python handler is called with the interrupted frame: install nothing, the handler stays
        return _current(signalnum)

    def guarded_builtin(spec, *, _create=create_builtin, _spec=Spec, _blocked=blocked, _str=str, _type=type,
                        _error=PermissionError):
        name, loader, origin = spec.name, spec.loader, spec.origin  # each read once: the copy is what is made
        if _type(name) is not _str or name in _blocked:
            raise _error("sandbox: creating that module again is not allowed")
        return _create(_spec(name, loader, origin))

    def guarded_dynamic(spec, *rest, _create=create_dynamic, _spec=Spec, _blocked=blocked, _str=str, _type=type,
                        _error=PermissionError):
        name, loader, origin = spec.name, spec.loader, spec.origin
        if _type(name) is not _str or name in _blocked or (origin is not None and _type(origin) is not _str):
            raise _error("sandbox: creating that module again is not allowed")
        return _create(_spec(name, loader, origin), *rest)

    return no_process, no_handler, guarded_builtin, guarded_dynamic
"""


def install_guard(workdir):
    """The reliability guard: refuse process creation, signals to other processes, sockets, ctypes, frame
    walking, trace functions, signal handlers, writes and deletions outside ``workdir``; most through an audit
    hook, the rest by replacing functions that raise no audit event (``_posixsubprocess.fork_exec``,
    ``_signal.signal``, re-creating built-in modules through ``_imp``)."""
    import _imp
    import _signal
    import builtins
    import faulthandler
    faulthandler.disable()
    try:  # imported now, so that importing subprocess works and its fork_exec is the refusing one
        import _posixsubprocess
    except ImportError:
        _posixsubprocess = None
    space = {"__builtins__": builtins}
    exec(WRAPPERS, space)
    wrappers = space.pop("make")(_imp.create_builtin, _imp.create_dynamic, _signal.getsignal,
                                 frozenset(BLOCKED_MODULES))
    space.clear()  # nothing but the builtins, which calls need
    space["__builtins__"] = builtins
    no_process, no_handler, guarded_builtin, guarded_dynamic = wrappers
    if _posixsubprocess is not None:
        _posixsubprocess.fork_exec = no_process
    _signal.signal = no_handler
    _imp.create_builtin, _imp.create_dynamic = guarded_builtin, guarded_dynamic
    builtins.help = None  # pydoc's pager starts a process
    sys.addaudithook(make_hook(PathRules(workdir), wrappers))


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
        sys.modules["__main__"] = type(sys)("__main__")  # the runner's globals out of the program's reach
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
