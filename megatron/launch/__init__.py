"""deepy.py's side of a run: the config resolved and checked, slots from the hostfile, the launcher's command,
the processes started and supervised.

deepy.py resolves and checks everything before any process starts
(resources.py `process_slots`, command.py `check_launcher`, ssh.py `check_reachable`), then runs
`launch_command`. The ranks never import this package: what they run is megatron/runtime, and what both sides
share on a machine is megatron/host. Nothing is imported here: `python -m megatron.launch.local_ranks`, which
starts the ranks (again at each restart), would otherwise import torch through command.py first.
"""
