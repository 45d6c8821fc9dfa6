"""A single-node SLURM cluster on localhost for the tests: munged, slurmctld and slurmd, started and stopped by pid.

Everything lives in one directory (config, munge key and socket, state,
logs) with ports picked free, so it touches nothing system-wide and several
can run side by side. Jobs run as root with no cgroups (proctrack/linuxproc),
which works in containers.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

from tests.distributed import free_port

_STARTUP_SECONDS = 60


class SlurmCluster:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.conf = directory / "slurm.conf"
        self.node = socket.gethostname()
        self._daemons: list[subprocess.Popen] = []

    def environment(self) -> dict[str, str]:
        """os.environ pointing SLURM's commands at this cluster."""
        return dict(os.environ, SLURM_CONF=str(self.conf))

    def _write_config(self) -> None:
        munge = self.directory / "munge"
        munge.mkdir(mode=0o700)
        key = munge / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        for name in ("state", "spool"):
            (self.directory / name).mkdir()
        d = self.directory
        self.conf.write_text(
            f"""ClusterName=tokenformer-test
SlurmctldHost={self.node}(127.0.0.1)
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
SlurmUser=root
AuthType=auth/munge
AuthInfo=socket={munge}/socket
CredType=cred/munge
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
KillWait=5
NodeName={self.node} NodeAddr=127.0.0.1 CPUs={os.cpu_count()} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""
        )

    def _start(self, name: str, command: list[str]) -> None:
        with open(self.directory / f"{name}.out", "w") as log:  # the daemon keeps its own copy of the file
            self._daemons.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=self.environment()))

    def _wait_until_idle(self) -> None:
        deadline = time.monotonic() + _STARTUP_SECONDS
        while time.monotonic() < deadline:
            state = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, env=self.environment())
            if state.stdout.strip() == "idle":
                return
            if any(daemon.poll() is not None for daemon in self._daemons):
                break
            time.sleep(0.5)
        logs = "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in sorted(self.directory.glob("*.out")))
        raise RuntimeError(f"the test SLURM cluster did not become idle within {_STARTUP_SECONDS} s\n{logs}")

    def start(self) -> None:
        self._write_config()
        munge = self.directory / "munge"
        try:
            self._start("munged", ["munged", "--foreground", "--force", f"--socket={munge}/socket",
                                   f"--key-file={munge}/munge.key", f"--pid-file={munge}/munged.pid",
                                   f"--log-file={munge}/munged.log", f"--seed-file={munge}/munged.seed"])
            self._start("slurmctld", ["slurmctld", "-D", "-f", str(self.conf)])
            self._start("slurmd", ["slurmd", "-D", "-f", str(self.conf)])
            self._wait_until_idle()
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Cancel leftover jobs, then stop the daemons in reverse order of start."""
        if self._daemons:
            scancel = ["scancel", "--full", f"--nodelist={self.node}"]
            subprocess.run(scancel, capture_output=True, env=self.environment())
        for daemon in reversed(self._daemons):
            daemon.terminate()
            try:
                daemon.wait(timeout=15)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()
        self._daemons.clear()
