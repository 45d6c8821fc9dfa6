"""deepy.py's side of a run: the config resolved and checked, slots from the hostfile, the launcher's command,
the processes started and supervised.

deepy.py resolves and checks everything before any process starts
(`process_slots`, `check_launcher`, `check_reachable`), then runs
`launch_command`. The ranks never import this package: what they run is megatron/runtime, and what both sides
share on a machine is megatron/host.
"""

from megatron.launch.command import check_launcher, launch_command, launch_notes
from megatron.launch.resources import process_slots, world_size
from megatron.launch.ssh import check_reachable

__all__ = [
    "check_launcher",
    "check_reachable",
    "launch_command",
    "launch_notes",
    "process_slots",
    "world_size",
]
