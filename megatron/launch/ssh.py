"""Probe every remote host with passwordless ssh before launching.

A typo in a hostfile or a node that is down then fails in seconds, naming the
host, instead of surfacing later as a launcher hang. SLURM starts its tasks
without ssh, so `launcher: slurm` is not probed; `no_ssh_check: true` skips it.
"""

from __future__ import annotations

import shutil
import subprocess

from megatron.config import Config, ConfigError
from megatron.launch.hosts import is_local_host
from megatron.launch.resources import Slots

_CONNECT_TIMEOUT_SECONDS = 10


def _probe(host: str) -> subprocess.Popen:
    return subprocess.Popen(
        ["ssh", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={_CONNECT_TIMEOUT_SECONDS}", host, "true"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def _failure(probe: subprocess.Popen) -> str | None:
    """Why the probe failed, or None if the host answered."""
    try:
        _, stderr = probe.communicate(timeout=2 * _CONNECT_TIMEOUT_SECONDS)
    except subprocess.TimeoutExpired:
        probe.kill()
        probe.communicate()
        return f"no answer within {2 * _CONNECT_TIMEOUT_SECONDS} s"
    if probe.returncode == 0:
        return None
    lines = stderr.strip().splitlines()
    return lines[-1] if lines else f"ssh exited {probe.returncode}"


def check_reachable(cfg: Config, slots: Slots) -> None:
    """Raise ConfigError naming every remote host that passwordless ssh cannot reach."""
    remote = [host for host in slots if not is_local_host(host)]
    if cfg.no_ssh_check or cfg.launcher == "slurm" or not remote:
        return
    if not shutil.which("ssh"):
        raise ConfigError(
            f"hostfile {cfg.hostfile} names remote hosts ({', '.join(remote)}) but ssh is not installed; "
            "install openssh-client, or set no_ssh_check: true if the launcher reaches them another way"
        )
    probes = {}
    for host in remote:  # all started before any is waited for
        probes[host] = _probe(host)
    failures = {}
    for host, probe in probes.items():
        reason = _failure(probe)
        if reason is not None:
            failures[host] = reason
    if failures:
        listed = "; ".join(f"{host}: {reason}" for host, reason in failures.items())
        raise ConfigError(
            f"hostfile {cfg.hostfile}: passwordless ssh cannot reach {listed}. Fix the host names or ssh keys, "
            "leave those hosts out (exclude), or set no_ssh_check: true"
        )
