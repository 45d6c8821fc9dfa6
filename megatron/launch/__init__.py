"""Starting a run's processes: slots from the hostfile, the launcher's command, each rank's environment.

deepy.py resolves and checks everything before any process starts
(`process_slots`, `check_launcher`, `check_reachable`), then runs
`launch_command`; every rank calls `export_rank_environment` before joining
the process group.
"""

from megatron.launch.command import check_launcher, launch_command, launch_notes
from megatron.launch.config_argument import decode_config, encode_config
from megatron.launch.environment import export_rank_environment
from megatron.launch.resources import process_slots, world_size
from megatron.launch.ssh import check_reachable

__all__ = [
    "check_launcher",
    "check_reachable",
    "decode_config",
    "encode_config",
    "export_rank_environment",
    "launch_command",
    "launch_notes",
    "process_slots",
    "world_size",
]
