"""One trainer per run directory: an exclusive lock file that names its holder.

``RUN_DIR/train.lock`` holds JSON ``{"host", "pid", "started", "command"}``. On a local or network
file system the file is also ``flock``-ed for as long as the trainer runs, so the kernel releases it
when the process dies however it dies; the next trainer on the same host then takes the stale file
over with a notice. A lock left by another host cannot be checked from here and is never taken over,
except one left by an earlier attempt of the same gptj-launch job: the launcher ended every process of
that attempt, wherever it ran, before it started this one (after a preemption the hosts are new).
Object stores (``gs://``) have no locks: the file is checked, written and read back, which catches
a trainer that is already running but not two that start in the same instant.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import logging
import os
import socket
import sys
import time
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np
from etils import epath
from jax.experimental import multihost_utils

from gptj_flax.errors import LAUNCHED_ENV, GptjFlaxError

log = logging.getLogger(__name__)

LOCK_NAME = "train.lock"


class RunDirLocked(GptjFlaxError, RuntimeError):
    """Another trainer holds the run directory."""


def _holder_info() -> dict[str, Any]:
    info = {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
    }
    if os.environ.get(LAUNCHED_ENV):
        info["launch"] = os.environ[LAUNCHED_ENV]
    return info


def _launch_attempt(text: Any) -> tuple[str, int] | None:
    """gptj-launch's ``JOB:ATTEMPT`` as (job, attempt), or None."""
    job, _, attempt = str(text or "").rpartition(":")
    return (job, int(attempt)) if job and attempt.isdigit() else None


def _left_by_an_earlier_attempt(info: dict[str, Any] | None) -> bool:
    """Whether ``info``'s holder was a process of an earlier attempt of the gptj-launch job this process
    belongs to, which the launcher ended before it started this one."""
    ours = _launch_attempt(os.environ.get(LAUNCHED_ENV))
    theirs = _launch_attempt((info or {}).get("launch"))
    return ours is not None and theirs is not None and ours[0] == theirs[0] and theirs[1] < ours[1]


def _parse(text: str) -> dict[str, Any] | None:
    try:
        info = json.loads(text)
    except ValueError:
        return None
    return info if isinstance(info, dict) and {"host", "pid"} <= info.keys() else None


def _describe(info: dict[str, Any] | None) -> str:
    if info is None:
        return "an unknown process (the lock file is unreadable)"
    return f"pid {info['pid']} on host {info['host']}, started {info.get('started', '?')}"


def _pid_alive(pid: Any) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


class RunDirLock:
    """``with RunDirLock(run_dir):`` — refuses with :class:`RunDirLocked` if another trainer holds it."""

    def __init__(self, run_dir: str | os.PathLike):
        run_dir = os.fspath(run_dir)
        self.is_url = "://" in run_dir
        self.run_dir = run_dir if self.is_url else os.path.abspath(run_dir)
        self.path = f"{self.run_dir.rstrip('/')}/{LOCK_NAME}"
        self._fd: int | None = None
        self._token: str | None = None
        self._made_dir = False

    def __enter__(self) -> RunDirLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def _refuse(self, info: dict[str, Any] | None, advice: str) -> RunDirLocked:
        return RunDirLocked(
            f"{self.run_dir} is in use by another trainer: {_describe(info)} (lock file {self.path}); {advice}"
        )

    def acquire(self) -> None:
        if self.is_url:
            self._acquire_object_store()
        else:
            self._acquire_file_system()

    def release(self) -> None:
        if self._fd is not None:
            try:  # unlink while still holding the lock, so no one can lock the old file after us
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            os.close(self._fd)
            self._fd = None
            if self._made_dir:  # a run that failed before writing anything leaves no empty directory behind
                try:
                    os.rmdir(self.run_dir)
                except OSError:
                    pass
        elif self._token is not None:
            path = epath.Path(self.path)
            try:
                if path.exists() and (_parse(path.read_text()) or {}).get("token") == self._token:
                    path.unlink()
            except OSError as e:
                log.warning("could not remove the lock file %s (%s); delete it before the next run", self.path, e)
            self._token = None

    # -- local and network file systems ----------------------------------------------------
    def _acquire_file_system(self) -> None:
        self._made_dir = not os.path.isdir(self.run_dir)
        os.makedirs(self.run_dir, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                os.close(fd)
                if e.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
                raise self._refuse(self._read_local(), "wait for it to finish or stop it first") from None
            try:  # the holder may have unlinked the file between our open and our flock: lock the new one
                same_file = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same_file = False
            if same_file:
                break
            os.close(fd)
        try:
            previous = os.pread(fd, 65536, 0).decode(errors="replace")
            if previous.strip():
                info = _parse(previous)
                earlier_attempt = _left_by_an_earlier_attempt(info)
                if info is not None and info["host"] != socket.gethostname() and not earlier_attempt:
                    raise self._refuse(
                        info,
                        f"this host cannot tell whether that process still runs; if it does not, delete {self.path}",
                    )
                if earlier_attempt:
                    log.warning(
                        "taking over the lock of %s, an earlier attempt of this gptj-launch job", _describe(info)
                    )
                else:
                    log.warning(
                        "taking over the stale lock of %s: no process holds it any more%s",
                        _describe(info),
                        "" if info is None or not _pid_alive(info["pid"]) else " (its pid was reused)",
                    )
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(_holder_info()) + "\n").encode(), 0)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd

    def _read_local(self) -> dict[str, Any] | None:
        for _ in range(20):  # the holder writes its details just after locking
            try:
                with open(self.path) as f:
                    text = f.read()
            except OSError:
                return None
            if text.strip():
                return _parse(text)
            time.sleep(0.05)
        return None

    # -- object stores ----------------------------------------------------------------------
    def _acquire_object_store(self) -> None:
        path = epath.Path(self.path)
        log.warning(
            "%s is on an object store, which has no locks: the run-directory lock there only catches a "
            "trainer that is already running, not two that start at the same moment",
            self.run_dir,
        )
        if path.exists():
            info = _parse(path.read_text())
            if _left_by_an_earlier_attempt(info):
                log.warning("taking over the lock of %s, an earlier attempt of this gptj-launch job", _describe(info))
            elif info is None or info["host"] != socket.gethostname():
                raise self._refuse(
                    info, f"this host cannot tell whether that process still runs; if it does not, delete {self.path}"
                )
            elif _pid_alive(info["pid"]):
                raise self._refuse(info, "wait for it to finish or stop it first")
            else:
                log.warning("taking over the stale lock of %s: that process is no longer running", _describe(info))
        path.parent.mkdir(parents=True, exist_ok=True)
        info = {**_holder_info(), "token": os.urandom(8).hex()}
        path.write_text(json.dumps(info) + "\n")
        written = _parse(path.read_text())
        if (written or {}).get("token") != info["token"]:
            raise self._refuse(written, "it started at the same moment as this one")
        self._token = info["token"]


@contextlib.contextmanager
def exclusive_run_dir(run_dir: str | os.PathLike) -> Iterator[None]:
    """Hold ``run_dir``'s lock for a (possibly multi-process) run: process 0 takes it, and every
    process learns whether it did, so none waits on a process 0 that was refused."""
    lock = RunDirLock(run_dir) if jax.process_index() == 0 else None
    error = None
    if lock is not None:
        try:
            lock.acquire()
        except Exception as e:  # noqa: BLE001 - re-raised below, after the other processes know
            error = e
    failed = error is not None
    if jax.process_count() > 1:
        failed = bool(multihost_utils.broadcast_one_to_all(np.int32(failed)))
    if error is not None:
        raise error
    if failed:
        raise RunDirLocked(f"process 0 could not lock {run_dir}; its error says why")
    try:
        yield
    finally:
        if lock is not None:
            lock.release()
