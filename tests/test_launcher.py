"""What deepy.py asks each launcher to run, the checks before it does, and each rank's environment.

The launches themselves run for real in test_slurm.py, test_mpi.py,
test_rank_failure.py and test_hostfile.py; these tests pin the arguments and
the errors that must come before any process starts.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from megatron.config import ConfigError, load_config
from megatron.config.argument import decode_config, encode_config
from megatron.launch.command import check_launcher, launch_command, launch_notes
from megatron.launch.resources import process_slots
from megatron.launch.resources import local_device_ids
from megatron.runtime.entry import share_cores
from megatron.runtime.environment import TORCH_VARIABLES, export_rank_environment
from tests.launch_checks import TINY

TWO_NODES = {"node-a": [0, 1], "node-b": [0, 1]}


def config(*overrides: str):
    return load_config(TINY, list(overrides))


@pytest.fixture
def hostfile(tmp_path) -> str:
    path = tmp_path / "hostfile"
    path.write_text("node-a slots=2\nnode-b slots=2\n")
    return str(path)


def test_srun_runs_one_task_per_slot_and_ends_the_step_on_a_failure(hostfile):
    cfg = config("launcher=slurm", f"hostfile={hostfile}", "comment=project-42")
    assert launch_command(cfg, TWO_NODES, "train.py", ["--megatron_config", "X"]) == [
        "srun", "--ntasks=4", "--nodes=2", "--ntasks-per-node=2", "--nodelist=node-a,node-b", "--kill-on-bad-exit=1",
        "--comment=project-42", sys.executable, "-u", "train.py", "--megatron_config", "X",
    ]


def test_openmpi_lists_hosts_with_their_process_counts(hostfile):
    command = launch_command(config("launcher=openmpi", f"hostfile={hostfile}"), {"node-a": [0, 1], "node-b": [0]},
                             "train.py", [])
    assert command[:7] == ["mpirun", "-n", "3", "--host", "node-a:2,node-b:1", "--bind-to", "none"]
    assert ("--allow-run-as-root" in command) == (os.geteuid() == 0)
    assert command[command.index("PATH") - 1] == "-x"
    assert command[-3:] == [sys.executable, "-u", "train.py"]


def test_mpich_runs_the_same_count_on_every_host(hostfile):
    command = launch_command(config("launcher=mpich", f"hostfile={hostfile}"), TWO_NODES, "train.py", [])
    assert command == ["mpirun", "-n", "4", "-ppn", "2", "-hosts", "node-a,node-b", sys.executable, "-u", "train.py"]


def test_deepspeed_runner_gets_the_exact_slots_and_the_first_host_as_master(hostfile):
    command = launch_command(config(f"hostfile={hostfile}"), {"node-a": [1], "node-b": [0, 1]}, "train.py", ["A"])
    assert command[3:] == [
        "deepspeed.launcher.runner", "--log_level", "warning", "--master_port", "29500",
        "--include", "node-a:1@node-b:0,1", "--hostfile", hostfile, "--launcher", "pdsh", "--no_ssh_check",
        "--master_addr", "node-a", "--force_multi", "train.py", "A",
    ]


def test_local_run_starts_num_gpus_processes():
    cfg = config()
    slots = process_slots(cfg, "cpu", 1)
    assert slots == {"localhost": [0, 1]}
    assert launch_command(cfg, slots, "train.py", ["A"])[2:] == [
        "-m", "megatron.launch.local_ranks", "--devices", "0,1", "--master_addr", "127.0.0.1", "--master_port",
        "29500", "--visible_devices_variable", "CUDA_VISIBLE_DEVICES", "train.py", "A",
    ]


def test_a_schedulers_visible_devices_list_maps_the_slots_and_bounds_them():
    """CUDA_VISIBLE_DEVICES=2,3 set by a scheduler: the ranks get GPUs 2 and 3, never 0 and 1 (maybe another
    job's), and a third slot is refused before launch. Without the variable, or on CPUs, a slot is its own id."""
    scheduler = {"CUDA_VISIBLE_DEVICES": "2,3"}
    assert local_device_ids([0, 1], "cuda", "CUDA_VISIBLE_DEVICES", scheduler) == ["2", "3"]
    assert local_device_ids([1], "cuda", "CUDA_VISIBLE_DEVICES", scheduler) == ["3"]
    assert local_device_ids([0], "cuda", "CUDA_VISIBLE_DEVICES", {"CUDA_VISIBLE_DEVICES": "GPU-5d1f"}) == ["GPU-5d1f"]
    with pytest.raises(ConfigError, match=r"^CUDA_VISIBLE_DEVICES=2,3 gives this job 2 devices, but the run takes "
                                          r"slots \[0, 1, 2\] of this machine .*; take at most 2 "):
        local_device_ids([0, 1, 2], "cuda", "CUDA_VISIBLE_DEVICES", scheduler)
    assert local_device_ids([0, 1], "cuda", "CUDA_VISIBLE_DEVICES", {}) == ["0", "1"]
    assert local_device_ids([0, 1, 2], "cpu", "CUDA_VISIBLE_DEVICES", scheduler) == ["0", "1", "2"]


@pytest.mark.parametrize(
    ("overrides", "slots", "expected"),
    [
        (["launcher=slurm"], {"localhost": [0, 1]}, "launcher: slurm needs hostfile"),
        (["deepspeed_slurm=true"], {"localhost": [0, 1]}, "deepspeed_slurm: true .* set launcher: slurm as well"),
        (["launcher=slurm", "HOSTFILE"], {"node-a": [0, 1], "node-b": [0]},
         r"runs the same number of processes on every host, got \{'node-a': 2, 'node-b': 1\}"),
        (["launcher=openmpi", "HOSTFILE"], {"node-a": [1]}, r"cannot pick slots \[1\] of node-a"),
        (["launcher=mpich", "HOSTFILE"], {"node-a": [0, 1], "node-b": [0]}, "runs the same number of processes"),
    ],
)
def test_launcher_mismatches_are_errors_before_launch(hostfile, overrides, slots, expected):
    cfg = config(*[f"hostfile={hostfile}" if o == "HOSTFILE" else o for o in overrides])
    with pytest.raises(ConfigError, match=expected):
        check_launcher(cfg, slots)


@pytest.mark.parametrize(
    ("launcher", "expected"),
    [
        ("slurm", "launcher: slurm needs srun on PATH"),
        ("openmpi", "launcher: openmpi needs ompi_info on PATH; install Open MPI"),
        ("mpich", "launcher: mpich needs mpichversion on PATH; install MPICH"),
        ("pdsh", "through pdsh, which is not installed"),
    ],
)
def test_missing_launcher_program_is_named(hostfile, launcher, expected, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ConfigError, match=expected):
        check_launcher(config(f"launcher={launcher}", f"hostfile={hostfile}"), TWO_NODES)


def test_ignored_launcher_keys_are_noted():
    notes = dict(launch_notes(config("launcher=openmpi", "comment=x", "include=localhost:0")))
    assert notes == {
        "comment": "only srun takes --comment; launcher openmpi ignores it",
        "num_gpus": "include/exclude choose the slots of each host",
    }


@pytest.mark.parametrize("script, noted", [("train.py", False), ("generate.py", True), ("cluster_check.py", True)])
def test_max_restarts_is_noted_where_nothing_restarts(script, noted):
    cfg = config("max_restarts=2", "save=ck", "load=ck", f"user_script={script}")
    assert ("max_restarts" in dict(launch_notes(cfg))) == noted


def test_config_argument_round_trips():
    cfg = config("train_iters=7")
    assert decode_config(encode_config(cfg)).to_json() == cfg.to_json()


@pytest.fixture
def clean_rank_environment(monkeypatch):
    """No rank variables, and those the test's code sets removed after it: monkeypatch restores only what it
    recorded, and a delenv of a variable not set records nothing."""
    for name in [*TORCH_VARIABLES, "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_STEP_NODELIST"]:
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    return monkeypatch


def test_slurm_task_variables_become_torch_variables(clean_rank_environment):
    clean_rank_environment.setenv("SLURM_PROCID", "5")
    clean_rank_environment.setenv("SLURM_NTASKS", "8")
    clean_rank_environment.setenv("SLURM_LOCALID", "1")
    clean_rank_environment.setenv("SLURM_STEP_NODELIST", "gpu[01-04]")
    export_rank_environment(config("launcher=slurm", "master_addr=gpu01", "master_port=6000"))
    assert {name: os.environ[name] for name in TORCH_VARIABLES} == {
        "RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "gpu01", "MASTER_PORT": "6000"}


def test_a_process_srun_did_not_start_is_told_how_to_launch(clean_rank_environment):
    with pytest.raises(ConfigError, match="'SLURM_PROCID' is not set, so srun did not start this process"):
        export_rank_environment(config("launcher=slurm"))


def test_a_process_without_rank_variables_is_told_how_to_launch(clean_rank_environment):
    with pytest.raises(ConfigError, match="this process has no RANK, WORLD_SIZE, .* start it with python deepy.py"):
        export_rank_environment(config())


@pytest.mark.parametrize(("environment", "local"), [
    ({"LOCAL_SIZE": "2"}, 2),
    ({"LOCAL_WORLD_SIZE": "64"}, 64),
    ({"LOCAL_SIZE": "2", "OMP_NUM_THREADS": "1"}, None),
    ({"SLURM_STEP_TASKS_PER_NODE": "64(x2),2", "SLURM_NODEID": "2"}, 2),  # srun sets no LOCAL_SIZE
    ({"SLURM_STEP_TASKS_PER_NODE": "2,64", "SLURM_NODEID": "1"}, 64),
    ({"OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, 2),
    ({"MPI_LOCALNRANKS": "64"}, 64),
])
def test_each_rank_takes_its_share_of_the_cores(environment, local, clean_rank_environment, capsys):
    """`local` ranks on this node, from whichever launcher's variable; None: OMP_NUM_THREADS decides (torch read
    it when it started, so the count set before stays)."""
    cores = len(os.sched_getaffinity(0))
    before, unset = torch.get_num_threads(), 3  # a count share_cores would never give on this machine's cores
    for name in [*os.environ]:
        if name in ("OMP_NUM_THREADS", "LOCAL_SIZE", "LOCAL_WORLD_SIZE") or name.startswith(("SLURM_", "OMPI_")):
            clean_rank_environment.delenv(name)
    for name, value in {**environment, "RANK": "0"}.items():
        clean_rank_environment.setenv(name, value)
    torch.set_num_threads(unset)
    try:
        threads = share_cores()
        assert threads == torch.get_num_threads() == (unset if local is None else max(1, cores // local))
    finally:
        torch.set_num_threads(before)
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("threads:")]
    if local is None:
        assert said == []
    else:
        assert said == [f"threads: {threads} per process ({cores} cores, {local} processes per node); "
                        "set OMP_NUM_THREADS to choose"]


@pytest.mark.parametrize(("device", "environment", "expected"), [
    ("cuda", {}, {"PYTORCH_ALLOC_CONF": "expandable_segments:True"}),
    ("cuda", {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}, {}),  # the user's setting stands
    ("cuda", {"PYTORCH_ALLOC_CONF": "max_split_size_mb:128"}, {}),  # under torch 2.13's name too
    ("cpu", {}, {}),
])
def test_a_cuda_rank_uses_expandable_segments_unless_told_otherwise(device, environment, expected):
    from megatron.runtime.entry import allocator_settings

    assert allocator_settings(device, environment) == expected


def test_a_rank_ends_on_too_many_non_finite_steps_or_an_id_outside_the_vocabulary_in_one_line(capsys):
    """NonFiniteTrainingError, which every rank raises alike, ended each rank in a 9-line traceback; a token id
    outside the vocabulary, which only the ranks that read it find, is one line naming the rank. Any other error
    keeps its traceback."""
    from megatron.data.token_ids import TokenIdError
    from megatron.runtime.entry import reported
    from megatron.training.numerics import NonFiniteTrainingError

    stop = "stopping at iteration 8: 3 steps in a row had a non-finite loss or gradient norm (max_skipped_steps=3)"
    assert reported(NonFiniteTrainingError(stop)) == 2
    assert capsys.readouterr().err == f"error: {stop}\n"
    data = "/data/x.bin: document 7 holds token id 300, outside the padded vocabulary of 128 rows"
    assert reported(TokenIdError(data)) == 1
    assert capsys.readouterr().err == f"error (rank 0): {data}\n"
    try:
        raise KeyError("a bug")
    except KeyError as error:
        assert reported(error) == 1
    printed = capsys.readouterr().err
    assert printed.startswith("Traceback (most recent call last):") and printed.endswith("KeyError: 'a bug'\n")
