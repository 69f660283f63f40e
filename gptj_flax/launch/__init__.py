"""``gptj-launch``'s engine: one command on every host of a slice, on a Ray cluster, run again whole
after a preemption. Needs the ``pod`` extra (Ray); nothing else in the package imports it."""

from gptj_flax.launch.job import COMMANDS, Ending, Job, judge, launch
from gptj_flax.launch.placement import Hosts, LaunchError

__all__ = ["COMMANDS", "Ending", "Hosts", "Job", "LaunchError", "judge", "launch"]
