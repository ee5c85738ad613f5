"""Runs run_engine.py jobs in processes forked from one that has already imported vLLM.

    python engine_forker.py        (then one JSON job per line on stdin)
JOB:   {"argv": [REQUEST.json, RESULT.json], "log": LOG, "env": {...}, "timeout": seconds}
REPLY: {"code": exit status of the job's process} per job, one line on stdout

Importing vLLM and PyTorch is about three quarters of a tiny engine's run on a small machine
(7 of 10 s). Each job still gets a process of its own with a fresh engine, its own
environment and its own log, as `python run_engine.py` gives it; only the imports are done
once, before any engine, thread pool or Mooncake client exists, so the fork copies none of them.
"""

from __future__ import annotations

import atexit
import gc
import json
import os
import signal
import sys
import time
import traceback

import run_engine  # this folder is on sys.path: the script's own
from vllm import LLM, SamplingParams  # noqa: F401  (the imports every job would repeat)


def run_job(job: dict[str, object], replies: int) -> None:
    """In the forked child: become `python run_engine.py ARGV` with the job's environment."""
    os.close(replies)
    log = os.open(str(job["log"]), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    env = job["env"]
    assert isinstance(env, dict)
    os.environ.clear()
    os.environ.update(env)
    # PYTHONPATH is read once, at interpreter start: put the job's entries in front here.
    sys.path[:0] = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    argv = job["argv"]
    assert isinstance(argv, list)
    sys.argv = ["run_engine.py", *argv]
    code = 0
    try:
        run_engine.main()
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
    except BaseException:
        traceback.print_exc()
        code = 1
    gc.collect()  # the engine and its connector close as they would at the end of main
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def wait(pid: int, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return -signal.SIGKILL
        time.sleep(0.05)


def main() -> None:
    replies = os.dup(1)  # children write their logs to fd 1; replies go here only
    os.dup2(2, 1)
    for line in sys.stdin:
        job = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            run_job(job, replies)
        code = wait(pid, float(job.get("timeout", 600)))
        os.write(replies, (json.dumps({"code": code}) + "\n").encode())


if __name__ == "__main__":
    main()
