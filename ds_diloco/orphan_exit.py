"""A process that ``ds-diloco run`` started stops once that run is gone.

The coordinator and each island's launcher live in process groups of their own, so that
a Ctrl-C reaches the run alone, which stops them in order. A run that died without
stopping them (SIGKILL, the OOM killer) left them all running: islands training on into
a run nobody watches, holding the ports, the workdir and the cores, unseen by a later run
in the same workdir. The run names itself in ``RUN_ENV`` (its pid and start time, so that
a pid used again is not taken for it); the coordinator and every island rank look for it
every ``CHECK_S`` and, once it is gone, send themselves SIGTERM: the coordinator's own
stop (its state saved), a rank's exit (its launcher then stops the island's other ranks).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading

import psutil

log = logging.getLogger(__name__)

RUN_ENV = "DS_DILOCO_RUN"
"""``PID:START_TIME:HOST`` of the ``ds-diloco run`` process that started this one."""
CHECK_S = 2.0


def run_env() -> dict[str, str]:
    """The variable that names this process as the run, for the processes it starts."""
    return {RUN_ENV: f"{os.getpid()}:{psutil.Process().create_time()!r}:{socket.gethostname()}"}


def _parse(value: str) -> tuple[int, float, str]:
    """(pid, start time, host) of ``RUN_ENV``'s value; ValueError: not that form."""
    pid, started, host = value.split(":", 2)
    return int(pid), float(started), host


def run_gone(value: str) -> bool:
    """Whether the run ``value`` (``RUN_ENV``'s form) has exited: no such process, a zombie
    (killed, its parent not yet told) or another process under its pid."""
    pid, started, _ = _parse(value)
    try:
        p = psutil.Process(pid)
        return p.create_time() != started or p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def watch_run(check_s: float = CHECK_S) -> threading.Thread | None:
    """In a process the run started (``RUN_ENV`` set): a daemon thread that sends this
    process SIGTERM once the run is gone. None where no run started it (``ds-diloco
    island`` under the deepspeed launcher alone, a coordinator on its own host)."""
    value = os.environ.get(RUN_ENV)
    if not value:
        return None
    try:
        pid, _, host = _parse(value)
    except ValueError:
        raise ValueError(f"{RUN_ENV}={value!r} is not PID:START_TIME:HOST") from None
    if host != socket.gethostname():  # a rank on another node: its pid is no process
        return None  # here (the launcher passes the variable on only by hand)

    def watch() -> None:
        stop = threading.Event()
        while not stop.wait(check_s):
            if run_gone(value):
                log.warning("the run that started this process (pid %d) is gone: stopping", pid)
                os.kill(os.getpid(), signal.SIGTERM)
                return

    thread = threading.Thread(target=watch, name="orphan-exit", daemon=True)
    thread.start()
    return thread
