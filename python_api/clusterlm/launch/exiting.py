"""Ending a process of the job as the interpreter would, without its teardown of every module.

A Python process that imported torch and transformers spends 0.5-1.2 s after its last line in the interpreter's
finalization (freeing every module, every object, torch's and transformers' included) before the shell, a pipe
reader or the launching process sees it end. Nothing in that teardown is the job's: the files are closed, the
processes it started have ended. The command-line entries (``clusterlm``, ``python -m clusterlm``,
``python -m clusterlm.train``) and the launch agent end with :func:`run_and_exit`, which does what the interpreter's
own exit does first — waits for the threads that are not daemons, runs the ``atexit`` handlers (logging's flush,
multiprocessing's clean-up, a reporter's), flushes the standard streams — and then ends the process
(``os._exit``) with the same status. An uncaught exception other than ``SystemExit`` takes the interpreter's usual
path (its traceback, then the teardown), and so does a process that multiprocessing started (a rank forked by the
launch agent's fork server runs the command's module): multiprocessing ends it itself, after it has handed the
rank's result to torch's launcher, which waits for it.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import sys
import threading
from collections.abc import Callable
from typing import NoReturn

__all__ = ["exit_now", "exit_status", "run_and_exit"]


def exit_status(code: object) -> int:
    """The exit status ``sys.exit(code)`` gives: None is 0, an integer itself, anything else is printed to stderr
    and gives 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr, flush=True)
    return 1


def exit_now(status: int) -> NoReturn:
    """End this process with ``status`` after what the interpreter's exit does first (threads that are not daemons
    joined, ``atexit`` handlers, standard streams flushed), without the teardown of its modules."""
    # What the interpreter's exit does first, and what multiprocessing does before it ends a child with os._exit: the
    # threading module's exit callbacks (concurrent.futures tells its idle workers to stop), then the threads that are
    # not daemons joined. Joining those alone would wait for ever on a thread pool's idle workers.
    threading._shutdown()
    atexit._run_exitfuncs()  # each handler once, last registered first, as at the interpreter's exit
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):  # closed or replaced: nothing left to write
            pass
    os._exit(status & 0xFF)


def run_and_exit(main: Callable[[], object]) -> NoReturn:
    """``sys.exit(main())``, ended by :func:`exit_now` (a ``SystemExit`` raised inside ``main``, argparse's for
    instance, gives its status the same way); in a process that multiprocessing started, ``sys.exit(main())``."""
    if multiprocessing.parent_process() is not None:
        sys.exit(main())
    try:
        code = main()
    except SystemExit as e:
        code = e.code
    exit_now(exit_status(code))
