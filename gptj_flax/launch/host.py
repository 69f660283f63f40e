"""The launcher's agent on one host: a Ray actor that runs the program as a child process and holds its
output until the launcher collects it.

Ray sends this class to its workers by value (see ``placement.py``), so a worker needs only Ray and
the standard library to run it: it imports nothing from the package, which would load JAX in every
agent for nothing (the program it starts loads what it needs).
"""

from __future__ import annotations

import ctypes
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time

import ray

# prctl(2)'s option that sends the child a signal when its parent dies.
_PR_SET_PDEATHSIG = 1
# How long a finished program's pipes may stay open (held by a process it started) before its exit
# is reported anyway.
_PIPE_GRACE_S = 5.0
STDOUT, STDERR = "stdout", "stderr"


def _die_with_parent() -> None:
    """In the child before exec: a lost agent (its node preempted, the actor killed) takes the program with it."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the launcher's own stop still ends the program
        pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class ProgramHost:
    """Starts one program, hands its output over in pieces, and signals it.

    Every method returns at once (the actor runs one call at a time, on one thread, which is the
    program's parent for as long as the actor lives).
    """

    def __init__(self) -> None:
        self._proc: subprocess.Popen | None = None
        self._output: queue.SimpleQueue = queue.SimpleQueue()
        self._readers: list[threading.Thread] = []
        self._ended_at: float | None = None
        self._signalled: int | None = None  # the signal the launcher sent, if it sent one

    def place(self) -> dict:
        """Where this agent runs: host name, IP, a free port (the coordinator's, on process 0), and the
        host's index within its TPU slice, when Ray's node labels give one."""
        labels: dict = ray.get_runtime_context().get_node_labels()
        worker_id = labels.get("ray.io/tpu-worker-id")
        return {
            "hostname": socket.gethostname(),
            "ip": ray.util.get_node_ip_address(),
            "port": _free_port(),
            "tpu_worker_id": int(worker_id) if isinstance(worker_id, str) and worker_id.isdigit() else None,
        }

    def start(self, python_args: list[str], env: dict[str, str], cwd: str) -> int | str:
        """Start this host's Python (the agent's own) with ``python_args`` in ``cwd``, ``env`` added to the
        agent's environment: its pid, or why it could not start."""
        if not os.path.isdir(cwd):
            return f"{cwd} is not a directory on {socket.gethostname()}; pass --workdir, a directory every host has"
        try:
            self._proc = subprocess.Popen(
                [sys.executable, *python_args],
                cwd=cwd,
                env={**os.environ, **env},
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,  # the launcher's signals reach it only as the launcher sends them
                preexec_fn=_die_with_parent,
            )
        except OSError as e:
            return f"cannot start {sys.executable} on {socket.gethostname()}: {e.strerror or e}"
        for name, pipe in ((STDOUT, self._proc.stdout), (STDERR, self._proc.stderr)):
            reader = threading.Thread(target=self._read, args=(name, pipe), daemon=True)
            reader.start()
            self._readers.append(reader)
        return self._proc.pid

    def _read(self, name: str, pipe) -> None:
        fd = pipe.fileno()
        while chunk := os.read(fd, 1 << 16):
            self._output.put((name, chunk))
        pipe.close()

    def poll(self) -> tuple[list[tuple[str, bytes]], dict | None]:
        """The output since the last call, and how the program ended (None while it runs).

        The ending is reported once the program's output has all been handed over.
        """
        ended = None
        if self._proc is not None and self._proc.poll() is not None:
            now = time.monotonic()
            self._ended_at = self._ended_at or now
            drained = not any(r.is_alive() for r in self._readers) or now - self._ended_at > _PIPE_GRACE_S
            if drained:
                for reader in self._readers:
                    reader.join(timeout=0.1)
                ended = {"returncode": self._proc.returncode, "signalled": self._signalled}
        chunks = []
        while not self._output.empty():
            chunks.append(self._output.get())
        return chunks, ended

    def send(self, signum: int) -> bool:
        """Send ``signum`` to the program (and anything it started); False if it had already ended."""
        if self._proc is None or self._proc.poll() is not None:
            return False
        self._signalled = signum
        try:
            os.killpg(self._proc.pid, signum)
        except ProcessLookupError:
            return False
        return True
