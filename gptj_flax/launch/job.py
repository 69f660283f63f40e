"""One job on every host of a slice, run again whole after a preemption, until it finishes.

An attempt reserves the hosts, starts one agent per host (``host.ProgramHost``) and the program in
each, with the ``jax.distributed`` coordinates that make them one multi-controller JAX program, and
watches them. The first process to end badly ends the attempt: the launcher stops the others (they
cannot go on without it), and judges the attempt by how its processes ended:

- a host lost, a process killed by a signal the launcher did not send, or a program that saved and
  stopped on SIGTERM (``EXIT_PREEMPTED``): a preemption, and the job runs again on a fresh
  reservation (the trainer resumes from its newest checkpoint);
- a program's own error (``error: …``, a :class:`GptjFlaxError`): reported, never retried;
- an unexpected exception: run once more, since it may be a peer's loss seen from the other side; the
  same error line twice in a row is reported.

Every run again counts against ``max_restarts``.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import time
import uuid
from collections.abc import Mapping
from typing import BinaryIO

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from gptj_flax.errors import EXIT_INTERRUPTED, EXIT_PREEMPTED, LAUNCHED_ENV
from gptj_flax.launch.output import Relay
from gptj_flax.launch.placement import Hosts, LaunchError, Reservation, connect, reserve, start_agents

# The commands a job may run: gptj_flax.cli's module of each (gptj_flax_entry runs it).
COMMANDS = ("train", "eval", "sample")
POLL_S = 0.2
# An agent that does not answer for this long is taken for lost with its host.
AGENT_TIMEOUT_S = 120.0
EXIT_TERMINATED = 128 + signal.SIGTERM
EXIT_USAGE = 2


@dataclasses.dataclass(frozen=True)
class Job:
    """What to run (``gptj-COMMAND ARGS``) where, and how many times to start it again."""

    command: str
    args: tuple[str, ...]
    hosts: Hosts
    max_restarts: int = 10
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    workdir: str = dataclasses.field(default_factory=os.getcwd)
    address: str | None = None

    def program(self) -> list[str]:
        """The arguments of the agent's Python that run the command as its console script does."""
        code = (
            f"import sys, gptj_flax_entry; sys.argv[0] = 'gptj-{self.command}'; "
            f"sys.exit(gptj_flax_entry.run({self.command!r}))"
        )
        return ["-c", code, *self.args]


@dataclasses.dataclass(frozen=True)
class Ending:
    """How one process of an attempt ended: ``exit`` (its own status), ``killed`` (by a signal the
    launcher did not send), ``stopped`` (by the launcher), or ``lost`` (its agent or host gone)."""

    process: int
    hostname: str
    kind: str
    status: int | None = None
    error: str | None = None
    unexpected: bool = False

    def describe(self) -> str:
        where = f"process {self.process} on {self.hostname}"
        if self.process < 0:
            return "a host was lost while the processes started"
        if self.kind == "lost":
            return f"{where} was lost with its host"
        if self.kind in ("killed", "stopped"):
            return f"{where} was killed by {signal.Signals(self.status or 0).name}"
        if self.status == EXIT_PREEMPTED:
            return f"{where} saved and stopped on SIGTERM (status {EXIT_PREEMPTED})"
        return f"{where} exited with status {self.status}" + (f": {self.error}" if self.error else "")


FINISHED, PREEMPTED, FAILED = "finished", "preempted", "failed"


def judge(endings: list[Ending]) -> tuple[str, Ending | None]:
    """The attempt's verdict from its processes' endings (in the order they were seen), and the ending
    that decided it."""
    for ending in endings:
        if ending.kind in ("killed", "lost") or (ending.kind == "exit" and ending.status == EXIT_PREEMPTED):
            return PREEMPTED, ending
    failed = [e for e in endings if e.kind == "exit" and e.status != 0]
    if failed:
        return FAILED, failed[0]
    if all(e.kind == "exit" for e in endings):
        return FINISHED, None
    return PREEMPTED, next(e for e in endings if e.kind != "exit")


class StopRequests:
    """SIGINT and SIGTERM on the launcher, kept for the attempt to hand on to the programs (which
    save and stop, as on their own terminal); the launcher then ends with 130 or 143."""

    def __init__(self) -> None:
        self.received: list[int] = []
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopRequests:
        self._previous = {s: signal.signal(s, self._handle) for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def _handle(self, signum, frame) -> None:
        self.received.append(signum)

    def __exit__(self, *exc) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)  # type: ignore[arg-type]

    def status(self) -> int:
        return EXIT_INTERRUPTED if signal.SIGINT in self.received else EXIT_TERMINATED


def say(message: str) -> None:
    print(f"gptj-launch: {message}", file=sys.stderr, flush=True)


def launch(job: Job, out: BinaryIO | None = None, err: BinaryIO | None = None) -> int:
    """Run ``job`` to its end: 0 once every process finished, else a non-zero status (or LaunchError)."""
    connect(job.address)
    try:
        return _attempts(job, Relay(out or sys.stdout.buffer, err or sys.stderr.buffer))
    finally:
        ray.shutdown()


class Restarts:
    """Whether a job whose attempt did not finish runs again: a preemption or a first unexpected error
    does, until ``limit`` runs again; a program's own error, or the same unexpected one twice in a row,
    ends it (:class:`LaunchError`)."""

    def __init__(self, limit: int):
        self.limit, self.count = limit, 0
        self._last_failure: tuple[int, str | None] | None = None

    def after(self, verdict: str, decisive: Ending) -> None:
        failure = (decisive.process, decisive.error) if verdict == FAILED else None
        if failure is not None and (not decisive.unexpected or failure == self._last_failure):
            raise LaunchError(f"the program failed, not retried: {decisive.describe()}")
        self._last_failure = failure
        if self.count >= self.limit:
            raise LaunchError(
                f"{decisive.describe()}, and the job was already started again {self.count} time(s), "
                f"as many as --max-restarts={self.limit} allows"
            )
        self.count += 1
        cause = "a preemption" if verdict == PREEMPTED else "an unexpected error"
        say(f"{decisive.describe()}; {cause}: starting every process again (restart {self.count})")


def _attempts(job: Job, relay: Relay) -> int:
    restarts, job_id = Restarts(job.max_restarts), uuid.uuid4().hex[:12]
    with StopRequests() as stop:
        while True:
            endings = Attempt(job, relay, stop, f"{job_id}:{restarts.count}").run()
            if stop.received:
                ended = "; ".join(e.describe() for e in endings) or "none had started"
                say(f"stopped as asked: {ended}")
                return stop.status()
            verdict, decisive = judge(endings)
            if verdict == FINISHED:
                say(f"the job finished ({restarts.count} restart(s))")
                return 0
            assert decisive is not None
            restarts.after(verdict, decisive)


class Attempt:
    """One start of the job on freshly reserved hosts, until every process has ended."""

    def __init__(self, job: Job, relay: Relay, stop: StopRequests, tag: str):
        self.job, self.relay, self.stop, self.tag = job, relay, stop, tag
        self.agents: list = []
        self.hostnames: list[str] = []
        self.endings: dict[int, Ending] = {}
        self.forwarded = 0  # how many of the launcher's signals the programs have been sent
        self.stopping = False

    def run(self) -> list[Ending]:
        reservation = reserve(self.job.hosts, say, lambda: bool(self.stop.received))
        if reservation is None:  # stopped while waiting for the hosts
            return []
        try:
            self._start(reservation)
            while len(self.endings) < len(self.agents):
                self._forward_stop()
                self._collect()
                time.sleep(POLL_S)
        except RayActorError:  # a host lost while the agents started
            self.endings = {-1: Ending(-1, "", "lost")}
        finally:
            for agent in self.agents:
                ray.kill(agent)
            reservation.release()
        return list(self.endings.values())

    def _start(self, reservation: Reservation) -> None:
        self.agents = agents = start_agents(reservation)
        places = ray.get([agent.place.remote() for agent in agents])
        # On a TPU slice the process ids follow the hosts' order in the slice, worker 0 first.
        order = sorted(range(len(agents)), key=lambda i: (places[i]["tpu_worker_id"] or 0, i))
        self.agents = [agents[i] for i in order]
        places = [places[i] for i in order]
        self.hostnames = [place["hostname"] for place in places]
        for process, hostname in enumerate(self.hostnames):
            self.relay.name(process, hostname)
        coordinator = f"{places[0]['ip']}:{places[0]['port']}"
        started = ray.get(
            [
                agent.start.remote(self.job.program(), self._environment(process, coordinator), self.job.workdir)
                for process, agent in enumerate(self.agents)
            ]
        )
        refused = [reason for reason in started if isinstance(reason, str)]
        if refused:
            raise LaunchError(refused[0])
        where = ", ".join(f"#{p} {host} (pid {pid})" for p, (host, pid) in enumerate(zip(self.hostnames, started)))
        say(f"started gptj-{self.job.command} on {len(self.agents)} host(s): {where}")

    def _environment(self, process: int, coordinator: str) -> dict[str, str]:
        env = {**self.job.env, LAUNCHED_ENV: self.tag, "PYTHONUNBUFFERED": "1"}
        if len(self.agents) > 1:
            env |= {
                "JAX_COORDINATOR_ADDRESS": coordinator,
                "JAX_NUM_PROCESSES": str(len(self.agents)),
                "JAX_PROCESS_ID": str(process),
            }
        return env

    def _running(self) -> list[int]:
        return [p for p in range(len(self.agents)) if p not in self.endings]

    def _send(self, signum: int) -> None:
        calls = [self.agents[p].send.remote(signum) for p in self._running()]
        try:
            ray.get(calls, timeout=AGENT_TIMEOUT_S)
        except (RayActorError, GetTimeoutError):  # that host is gone: the next poll says so
            pass

    def _forward_stop(self) -> None:
        """Hand each SIGINT or SIGTERM the launcher got to every running program, once."""
        for signum in self.stop.received[self.forwarded :]:
            self._send(signum)
        self.forwarded = len(self.stop.received)

    def _collect(self) -> None:
        """Relay every running process's output, note the ends, and stop all once one ended badly."""
        running = self._running()
        calls = [self.agents[p].poll.remote() for p in running]
        for process, call in zip(running, calls):
            try:
                chunks, ended = ray.get(call, timeout=AGENT_TIMEOUT_S)
            except (RayActorError, GetTimeoutError):
                self.relay.close(process)
                self.endings[process] = Ending(process, self.hostnames[process], "lost")
                continue
            for stream, data in chunks:
                self.relay.write(process, stream, data)
            if ended is not None:
                self.relay.close(process)
                self.endings[process] = self._ending(process, ended)
        bad = any(e.kind != "exit" or e.status != 0 for e in self.endings.values())
        if bad and not self.stopping and not self.stop.received:
            self.stopping = True  # the others would wait on the lost one until JAX's heartbeat timeout
            self._send(signal.SIGKILL)

    def _ending(self, process: int, ended: Mapping) -> Ending:
        code, hostname = ended["returncode"], self.hostnames[process]
        if code < 0:
            return Ending(process, hostname, "stopped" if ended["signalled"] else "killed", -code)
        error, unexpected = self.relay.error_line(process) if code else (None, False)
        if code == EXIT_USAGE:  # argparse's usage error: the command line is wrong, whatever it printed
            unexpected = False
        return Ending(process, hostname, "exit", code, error, unexpected)
