"""The job's output on the launcher's terminal: process 0's stdout as it is, everything else by line
with the process and host in front, and each process's last error line kept for the verdict."""

from __future__ import annotations

import collections
from typing import BinaryIO

from gptj_flax.errors import UNEXPECTED_HINT

# Lines of each process's stderr kept to find its error line.
TAIL_LINES = 20


class Relay:
    """Writes what the agents hand over: ``out`` gets process 0's stdout unchanged, ``err`` the rest."""

    def __init__(self, out: BinaryIO, err: BinaryIO):
        self.out, self.err = out, err
        self._prefixes: dict[int, bytes] = {}
        self._partial: dict[tuple[int, str], bytes] = {}
        self._tails: dict[int, collections.deque[str]] = {}

    def name(self, process: int, hostname: str) -> None:
        """Process ``process`` runs on ``hostname``: its lines get ``[#process hostname] `` in front."""
        self._prefixes[process] = f"[#{process} {hostname}] ".encode()
        self._tails[process] = collections.deque(maxlen=TAIL_LINES)

    def write(self, process: int, stream: str, data: bytes) -> None:
        if process == 0 and stream == "stdout":
            self.out.write(data)
            self.out.flush()
            return
        lines = (self._partial.pop((process, stream), b"") + data).split(b"\n")
        if lines[-1]:
            self._partial[(process, stream)] = lines[-1]
        self._emit(process, stream, lines[:-1])

    def _emit(self, process: int, stream: str, lines: list[bytes]) -> None:
        prefix = self._prefixes[process]
        self.err.write(b"".join(prefix + line + b"\n" for line in lines))
        self.err.flush()
        if stream == "stderr":
            self._tails[process].extend(line.decode(errors="replace").rstrip("\r") for line in lines)

    def close(self, process: int) -> None:
        """The process ended: write what it left without a newline."""
        for stream in ("stdout", "stderr"):
            rest = self._partial.pop((process, stream), None)
            if rest is not None:
                self._emit(process, stream, [rest])

    def error_line(self, process: int) -> tuple[str | None, bool]:
        """The process's last ``error: …`` line (or, failing one, its last line: a traceback's end) and
        whether the program called it unexpected (any exception but the project's and the OS's)."""
        tail = [line for line in self._tails.get(process, ()) if line.strip()]
        for index in range(len(tail) - 1, -1, -1):
            if tail[index].startswith("error: "):
                unexpected = UNEXPECTED_HINT in tail[index + 1 :]
                return tail[index].removeprefix("error: "), unexpected
        return (tail[-1].strip() if tail else None), True
