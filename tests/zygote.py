"""A process that has imported torch once and forks one `tfdoctor` command per request, so that a test of
the command does not pay 2-3 s of imports in the command's worker (tests/helpers.py starts one per pytest
process; it forks the command's worker in turn: tests/forked_worker.py, put in the supervisor's seam).

It is started as a fresh interpreter, never forked from pytest: a child of it holds none of pytest's state
(warning filters, log handlers, faulthandler, signal handlers, modules imported from fixtures/, RNG draws).
It draws no random numbers and starts no thread, so each child begins as a fresh `tfdoctor` would, except
that torch, Typer, Rich and tfdoctor are already imported.

Protocol: one JSON request per line on stdin, {"argv", "cwd", "env", "stdin", "stdout", "stderr"} (the
three streams as file paths, stdin possibly null); on the reply descriptor (argv[1]) one line
{"pid": PID} when the command has started, then {"code": EXIT_CODE} when it has ended.
"""

import atexit
import json
import os
import sys
import tempfile
import threading
import traceback


def preload() -> None:
    import torch  # noqa: F401
    import torch._dynamo  # noqa: F401  (torch.optim's first step imports it)
    import torch.optim  # noqa: F401

    import forked_worker  # tests/, this file's folder: sys.path[0]
    import tfdoctor.cli  # noqa: F401
    import tfdoctor.process.worker  # noqa: F401
    from tfdoctor.process import supervisor

    supervisor.start_worker = forked_worker.start  # every command forked from here forks its worker too


def exit_code(error: SystemExit) -> int:
    """The code Python exits with for an uncaught SystemExit."""
    if error.code is None:
        return 0
    if isinstance(error.code, int):
        return error.code & 0xFF
    print(error.code, file=sys.stderr)
    return 1


def command(request: dict, reply_fd: int) -> None:
    """In the child: become `tfdoctor ARGS` run from request["cwd"] with request["env"], and exit."""
    os.close(reply_fd)
    os.close(0)  # the request pipe: a child must not hold it open
    streams = [request["stdin"] or os.devnull, request["stdout"], request["stderr"]]
    for fd, (path, flags) in enumerate(zip(streams, (os.O_RDONLY, os.O_WRONLY, os.O_WRONLY))):
        opened = os.open(path, flags)
        if opened != fd:
            os.dup2(opened, fd)
            os.close(opened)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    tempfile.tempdir = None
    sys.argv = list(request["argv"])
    sys.path[0] = os.path.dirname(sys.argv[0])  # a console script's folder comes first
    from tfdoctor.cli import main

    try:
        raise SystemExit(main())
    except SystemExit as error:
        code = exit_code(error)
    except BaseException:  # noqa: BLE001 - what the interpreter would print, and its code
        traceback.print_exc()
        code = 1
    threading._shutdown()  # as the interpreter ends: non-daemon threads are joined, then atexit runs
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


def serve(reply_fd: int) -> None:
    replies = os.fdopen(reply_fd, "w", buffering=1)
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            try:
                command(request, reply_fd)
            finally:
                os._exit(70)
        replies.write(json.dumps({"pid": pid}) + "\n")
        _, status = os.waitpid(pid, 0)
        replies.write(json.dumps({"code": os.waitstatus_to_exitcode(status)}) + "\n")


if __name__ == "__main__":
    preload()
    # A thread here would be missing (and its locks possibly held) in every child.
    assert threading.active_count() == 1, threading.enumerate()
    serve(int(sys.argv[1]))
