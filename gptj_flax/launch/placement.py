"""Where a job's processes run: one Ray placement-group bundle per host, one agent in each.

On TPU, Ray's own slice reservation (``ray.util.tpu.SlicePlacementGroup``): it holds the slice's
head resource (``TPU-v4-16-head`` on worker 0 of a free v4-16) and then one bundle of the host's
``TPU`` chips on every host of that slice. Elsewhere, ``hosts`` bundles of CPUs, spread over as
many nodes as the cluster has.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import sys
from collections.abc import Callable

import ray
from ray.util import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
from ray.util.tpu import SlicePlacementGroup

from gptj_flax.errors import GptjFlaxError
from gptj_flax.launch import host

# Ray's workers get the agent's class by value: they need not import this package, and so JAX.
ray.cloudpickle.register_pickle_by_value(host)

# While the hosts are not there: how often the launcher checks for Ctrl-C, and says it still waits.
WAIT_POLL_S = 2.0
WAIT_MESSAGE_EVERY_S = 60.0
TPU_SPEC = re.compile(r"^(v\d+[a-z]*):(\d+(?:x\d+){1,2})$")


class LaunchError(GptjFlaxError):
    """The job cannot be placed or started; the message says why and what to do."""


@dataclasses.dataclass(frozen=True)
class Hosts:
    """The hosts a job asks for: ``count`` plain workers, or a TPU slice (``tpu`` = ``VERSION:TOPOLOGY``)."""

    count: int | None = None
    tpu: str | None = None
    cpus_per_host: float = 1.0

    def __post_init__(self) -> None:
        if (self.count is None) == (self.tpu is None):
            raise LaunchError("give either --hosts N or --tpu VERSION:TOPOLOGY")
        if self.count is not None and self.count < 1:
            raise LaunchError(f"--hosts must be at least 1, got {self.count}")
        if self.tpu is not None and not TPU_SPEC.match(self.tpu.lower()):
            raise LaunchError(
                f"--tpu {self.tpu!r}: expected a TPU generation and the slice's topology, such as v4:2x2x2, "
                "v5e:4x4 or v6e:4x8 (the topology GKE and gcloud give, not the pod type v4-16)"
            )

    def describe(self) -> str:
        return f"{self.count} host(s)" if self.tpu is None else f"a TPU {self.tpu} slice"


class Reservation:
    """Reserved hosts: the placement group, the resources of each bundle, and how to give them back."""

    def __init__(self, group, bundle: dict[str, float], hosts: int, release: Callable[[], None]):
        self.group, self.bundle, self.hosts, self._release = group, bundle, hosts, release

    def release(self) -> None:
        self._release()


def _wait_ready(group, what: str, say: Callable[[str], None], stopped: Callable[[], bool]) -> bool:
    """Wait for ``group``'s bundles, saying so now and then; False if ``stopped()`` came first."""
    waited = 0.0
    while not ray.wait([group.ready()], timeout=WAIT_POLL_S)[0]:
        if stopped():
            return False
        waited += WAIT_POLL_S
        if waited % WAIT_MESSAGE_EVERY_S < WAIT_POLL_S:
            say(f"still waiting for {what} after {waited:.0f} s (an autoscaler brings hosts back after a preemption)")
    return True


def _reserve_slice(hosts: Hosts, say: Callable[[str], None], stopped: Callable[[], bool]) -> Reservation | None:
    version, topology = (hosts.tpu or "").lower().split(":")
    waited = 0.0
    while not stopped():
        try:
            tpu_slice = SlicePlacementGroup(topology, version, head_reservation_timeout_s=WAIT_POLL_S)
        except TimeoutError:  # no free slice's head resource yet
            waited += WAIT_POLL_S
            if waited % WAIT_MESSAGE_EVERY_S < WAIT_POLL_S:
                say(f"still waiting for {hosts.describe()} after {waited:.0f} s: no free slice yet")
            continue
        except ValueError as e:  # Ray's check of the generation and topology
            raise LaunchError(f"--tpu {hosts.tpu}: {e}") from None
        if _wait_ready(tpu_slice.placement_group, hosts.describe(), say, stopped):
            bundle = tpu_slice.bundle_resources
            return Reservation(tpu_slice.placement_group, bundle, tpu_slice.num_hosts, tpu_slice.shutdown)
        tpu_slice.shutdown()
    return None


def reserve(hosts: Hosts, say: Callable[[str], None], stopped: Callable[[], bool]) -> Reservation | None:
    """Reserve ``hosts``, waiting for as long as the cluster needs to have them; None if ``stopped()``
    turned true first (Ctrl-C on the launcher)."""
    if hosts.tpu is not None:
        return _reserve_slice(hosts, say, stopped)
    assert hosts.count is not None
    bundle = {"CPU": hosts.cpus_per_host}
    group = placement_group([dict(bundle)] * hosts.count, strategy="SPREAD")
    if not _wait_ready(group, hosts.describe(), say, stopped):
        remove_placement_group(group)
        return None
    return Reservation(group, bundle, hosts.count, lambda: remove_placement_group(group))


def start_agents(reservation: Reservation) -> list:
    """One :class:`host.ProgramHost` actor in each bundle of ``reservation``, holding the bundle's resources."""
    bundle = dict(reservation.bundle)
    cpus = bundle.pop("CPU", 0)
    agent = ray.remote(host.ProgramHost)
    return [
        agent.options(
            num_cpus=cpus,
            resources=bundle,
            max_restarts=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=reservation.group, placement_group_bundle_index=index
            ),
        ).remote()
        for index in range(reservation.hosts)
    ]


def connect(address: str | None) -> None:
    """Join the Ray cluster at ``address`` (None: $RAY_ADDRESS, else the one started on this machine)."""
    try:
        ray.init(address=address or "auto", log_to_driver=False, logging_level=logging.WARNING)
    except ConnectionError as e:
        where = f"at {address}" if address else "on this machine or at $RAY_ADDRESS"
        raise LaunchError(
            f"no Ray cluster answered {where} ({str(e).splitlines()[0] if str(e) else 'no answer'}), or it refused "
            "this machine's token ($RAY_AUTH_TOKEN or ~/.ray/auth_token): start one with `ray start --head`, "
            "`ray up` or KubeRay (docs/pods/), or pass --address HOST:PORT"
        ) from None
    print(f"gptj-launch: connected to the Ray cluster at {ray.get_runtime_context().gcs_address}", file=sys.stderr)
