"""cluster_check.py (docs/cluster.md): the pieces on their own, then real runs on gloo processes.

A 4-process deepy.py launch in the tensor 2 x pipeline 2 layout passes every section and writes the report.
Real faults, each in a run of the section it must fail, started rank by rank as deepy.py's launcher would (so
that a rank can start in namespaces of its own): a `save` directory that rank 1 sees as another (a tmpfs over it
in its mount namespace), data that differs on rank 1 (another dataset bind-mounted over the path), a golden curve
that does not match (through deepy.py), a bandwidth floor above gloo's (on 4 ranks, two of them in a UTS
namespace named node-b: two nodes). Each fails its section, names the rank, ranks or hosts, exits with
CLUSTER_CHECK_FAILED and prints no traceback. (tests/test_slurm.py runs the check through
tools/slurm/cluster_check.sbatch.)
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

from megatron.cluster_check.collectives import bus_factor
from megatron.cluster_check.golden import curve_losses, make_curve, read_curve_file
from megatron.cluster_check.ranks import Ranks
from megatron.cluster_check.report import FAIL, PASS, SKIP, Finding, RunDescription, SectionResult
from megatron.cluster_check.report import console_summary, markdown
from megatron.cluster_check.throughput import largest_micro_batch
from megatron.cluster_check.variants import batch_split, small_model, variant
from megatron.config import ConfigError, load_config
from megatron.config.golden_curve import REPOSITORY_CURVE, CurveError, tolerance_for
from megatron.config.argument import encode_config
from megatron.config.run_inputs import CLUSTER_CHECK_FAILED
from megatron.config.schema import CLUSTER_CHECK_SECTIONS
from megatron.data.indexed_dataset import MMapIndexedDataset, MMapIndexedDatasetBuilder
from megatron.model import TokenFormerArgs
from megatron.model.rank_memory import RunShape, training_bytes_per_rank
from megatron.training.pattention_choice import RESERVE
from tests.conftest import REPO, run_deepy
from tests.distributed import free_port
from tests.test_launch_preflight import pristine, run  # noqa: F401 (fixtures: a save directory at iteration 3)
from tests.test_training_e2e import data_overrides

TINY = str(REPO / "tests" / "tiny.yml")
HOST = socket.gethostname()
RUN_TIMEOUT_SECONDS = 300


# --- the pieces -------------------------------------------------------------------------------------------------

def test_bus_bandwidth_is_nccl_tests_formula():
    assert bus_factor("all-reduce", 8) == pytest.approx(2 * 7 / 8)
    assert bus_factor("all-gather", 8) == bus_factor("reduce-scatter", 8) == pytest.approx(7 / 8)
    assert bus_factor("all-reduce", 1) == 0


@pytest.mark.parametrize("world", [1, 2, 4, 8, 16, 64])
@pytest.mark.parametrize("tensor", [1, 2, 4, 8])
@pytest.mark.parametrize("pipe", [0, 1, 2, 4])
def test_the_layout_and_the_single_device_run_see_the_same_global_batch(world, tensor, pipe):
    if world % (tensor * max(1, pipe)):
        return
    micro, accumulation, reference = batch_split(tensor, pipe)
    data = world // (tensor * max(1, pipe))
    assert micro * accumulation * data == reference * world
    assert accumulation >= max(2, pipe)


@pytest.mark.parametrize("layout", [(1, 0), (2, 0), (1, 2), (2, 2), (4, 1), (8, 4)])
def test_the_small_model_is_a_valid_config_in_every_layout(layout):
    tensor, pipe = layout
    world = 2 * tensor * max(1, pipe)
    cfg = load_config(["configs/1-5B.yml"], ["data_path=d", "vocab_file=v", f"num_gpus={world}"], world_size=world)
    small = variant(cfg, **small_model(cfg, tensor, pipe), model_parallel_size=tensor, pipe_parallel_size=pipe,
                    train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=2)
    assert small.hidden_size // small.num_attention_heads == 96 and small.num_layers == 2 * max(1, pipe)
    assert small.precision == cfg.precision and small.load is None and small.save is None


def test_the_small_model_sets_the_token_count_of_every_pattention_the_spec_declares(monkeypatch):
    from megatron.model import spec as model_spec

    cfg = load_config([TINY], ["data_path=d", "num_gpus=2"], world_size=2)
    branch = model_spec.PattentionSpec("branch", "branch_slot_num", "branch", "branch", "ffn")
    monkeypatch.setattr(model_spec, "LAYER_PATTENTIONS", (*model_spec.LAYER_PATTENTIONS[:4], branch))
    model = small_model(cfg, 2, 0)
    assert {key: model.get(key) for key in ("qkv_slot_num", "proj_slot_num", "branch_slot_num")} == {
        "qkv_slot_num": 128, "proj_slot_num": 128, "branch_slot_num": 256}
    assert "ffn_slot_num" not in model

def test_the_micro_batch_is_the_largest_the_memory_model_fits():
    cfg = load_config(["configs/1-5B.yml"], ["data_path=d", "vocab_file=v", "num_gpus=8"], world_size=8)
    args = TokenFormerArgs.from_config(cfg, padded_vocab_size=50304)
    shape, budget = RunShape.from_config(cfg), 80 * 2**30
    micro = largest_micro_batch(args, "fused", shape, "cuda", budget)
    need = [training_bytes_per_rank(args, "fused", dataclasses.replace(shape, micro_batch=m), "cuda")
            for m in (micro, micro + 1)]
    assert micro >= 1 and need[0] <= (1 - RESERVE) * budget < need[1]


def test_an_unknown_section_is_refused_when_the_config_loads():
    with pytest.raises(ConfigError, match="cluster_check_sections: 'colectives' is not a section"):
        load_config([TINY], ["data_path=d", "cluster_check_sections=[environment, colectives]"])
    assert load_config([TINY], ["data_path=d"]).cluster_check_sections == list(CLUSTER_CHECK_SECTIONS)


def test_a_run_whose_checkpoint_reached_train_iters_is_still_checked(run, tmp_path):
    """deepy.py does not launch train.py on a finished run; the cluster check trains nothing of its own."""
    from megatron.launch.preflight import nothing_left_to_train
    from tests.test_launch_preflight import run_config

    assert nothing_left_to_train(run_config(tmp_path, f"load={run}", "train_iters=3"))
    assert nothing_left_to_train(run_config(tmp_path, f"load={run}", "train_iters=3",
                                            "user_script=cluster_check.py")) is None


def test_ranks_are_named_with_their_hosts():
    ranks = Ranks(("a", "a", "b", "b", "b", "c", "c", "c"))
    assert ranks.hosts() == ["a", "b", "c"] and ranks.local_rank(3) == 1
    assert ranks.name([0, 1, 4]) == "ranks 0, 1 on a; rank 4 on b"
    assert ranks.name(list(range(8))).endswith("and 2 more")


def gpu_facts(host_devices: dict[str, int], **changes) -> list[dict]:
    """What environment.rank_facts gives on GPU nodes, one rank per device, with `changes` ({rank: {field: value}})."""
    facts = []
    for host, devices in host_devices.items():
        for index in range(devices):
            facts.append({"device": "NVIDIA H100 80GB HBM3", "device_type": "cuda",
                          "device_identity": f"{host}-gpu{index}", "devices_visible": devices, "driver": "550.54.15",
                          "python": "3.11.7", "torch": "2.13.0", "cuda": "13.0", "nccl": "2.27.3",
                          "deepspeed": "0.19.8", "triton": "3.9.0", "free_memory": 79 * 2**30,
                          "total_memory": 80 * 2**30, "slurm_gpus_on_node": None})
    for rank, fields in changes.get("ranks", {}).items():
        facts[rank].update(fields)
    return facts


def test_gpu_nodes_that_disagree_are_named_with_both_values():
    """The environment section's judgements on GPU facts (this machine has none to gather)."""
    from megatron.cluster_check import environment
    from megatron.cluster_check.context import CheckContext

    ranks = Ranks(("a",) * 4 + ("b",) * 4)
    context = CheckContext(None, ranks, torch.device("cuda", 0), "t")
    result = SectionResult("environment")
    facts = gpu_facts({"a": 4, "b": 4}, ranks={5: {"torch": "2.12.1", "devices_visible": 3},
                                                6: {"device_identity": "b-gpu1", "free_memory": 30 * 2**30},
                                                7: {"slurm_gpus_on_node": "4"}})
    for fact in facts[4:]:
        fact.update(devices_visible=3, slurm_gpus_on_node="4")
    environment._devices(result, context, facts)
    environment._mismatches(result, context, facts)
    environment._memory(result, context, facts)
    found = {(f.where, f.what) for f in result.findings}
    assert ("host b", "3 devices visible for 4 ranks") in found
    assert ("host b", "SLURM promised 4 GPUs (SLURM_GPUS_ON_NODE) but 3 are visible") in found
    assert ("ranks 5, 6 on b", "2 ranks use one device (b-gpu1)") in found
    assert ("rank 5 on b", "torch 2.12.1 where the other ranks have 2.13.0") in found
    assert ("rank 6 on b", "30.0 GiB free on its device where others have 79.0 GiB") in found
    assert ("ranks 4, 5, 6, 7 on b", "devices_visible 3 where the other ranks have 4") not in found  # not compared
    assert len(result.findings) == 5


def bytes_read_by_this_process() -> int:
    """What this process has read through read(2) so far (/proc/self/io's rchar)."""
    fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return int(fields["rchar"])


def environment_on_a_large_index(prefix: str) -> tuple[str, int]:
    """Rank body: the environment section of a config whose dataset has a 512 MiB .idx; (its status, the bytes
    this rank read meanwhile)."""
    from megatron.cluster_check import environment
    from megatron.cluster_check.context import CheckContext

    cfg = load_config([TINY], [f"data_path={prefix}", "num_gpus=1"], world_size=1)
    before = bytes_read_by_this_process()
    result = environment.run(CheckContext(cfg, Ranks.gather(), torch.device("cpu"), "t"))
    return result.status, bytes_read_by_this_process() - before


def test_the_environment_reads_a_few_mib_of_a_large_dataset_index_not_all_of_it(tmp_path):
    """Every rank of every node digests the dataset files at once: a whole .idx of GBs each would take minutes."""
    from tests.distributed import run_on_ranks

    prefix = tmp_path / "corpus_text_document"
    with open(f"{prefix}.idx", "wb") as index:
        index.truncate(512 * 2**20)  # sparse: nothing on disk, 512 MiB to read
    Path(f"{prefix}.bin").write_bytes(b"tokens")
    [(status, read)] = run_on_ranks(1, environment_on_a_large_index, str(prefix))
    assert status == PASS and read < 32 * 2**20, read

def collectives_of_one_rank() -> SectionResult:
    """Rank body: the collectives section of a one-process world with a bandwidth floor."""
    from megatron.cluster_check import collectives
    from megatron.cluster_check.context import CheckContext

    cfg = load_config([TINY], ["data_path=d", "num_gpus=1", "cluster_check_busbw_floor=1000"], world_size=1)
    return collectives.run(CheckContext(cfg, Ranks.gather(), torch.device("cpu"), "t"))


def test_one_rank_has_no_bandwidth_to_hold_against_a_floor():
    from tests.distributed import run_on_ranks

    [result] = run_on_ranks(1, collectives_of_one_rank)
    assert (result.status, result.findings, result.facts) == (PASS, [], {"correct": True})
    assert result.summary.startswith("one rank: the values are right; bandwidth and latency not applicable")
    assert "cluster_check_busbw_floor is not applied" in result.figures[0]

def test_the_report_names_every_failure_and_the_console_fits_a_screen():
    results = [SectionResult("environment", PASS, "fine"),
               SectionResult("collectives", FAIL, "slow", ["| a | b |"],
                             [Finding(f"rank {r} on h", "slow", "fix it") for r in range(20)]),
               SectionResult("numerics", SKIP, "skipped: collectives wrong")]
    described = RunDescription(["x.yml"], 20, ["h"], "tensor 1 x pipeline 0 x data 20", "cpu")
    report = markdown(results, described, 12.0)
    assert report.startswith("# Cluster check: FAIL") and report.count("*Likely fix:* fix it") == 20
    console = console_summary(results, Path("r.md"), 12.0).splitlines()
    assert len(console) <= 24 and console[-2].startswith("  ... and 12 more")


def test_the_repositorys_golden_curve_is_reproduced_on_this_cpu():
    """The curve ships with the repository: a change to the model, the optimizer or the data generator that moves
    it must be deliberate (regenerate it: python -m megatron.cluster_check.golden --write ...)."""
    curve, threads = read_curve_file(REPOSITORY_CURVE), torch.get_num_threads()
    torch.set_num_threads(1)  # as one rank of a launch has on this machine: two threads contend with the others
    try:
        losses = curve_losses(curve, torch.device("cpu"))
    finally:
        torch.set_num_threads(threads)
    assert losses == pytest.approx(curve["losses"], rel=tolerance_for(curve, "cpu") / 100)
    assert losses[-1] < losses[0] - 1.0  # it learns: a wrong gradient would show


def test_a_file_that_is_no_curve_is_named(tmp_path):
    (tmp_path / "curve.json").write_text(json.dumps({"losses": [1.0]}))
    with pytest.raises(CurveError, match="lacks model, optimizer, data, steps, relative_tolerance"):
        read_curve_file(tmp_path / "curve.json")
    (tmp_path / "curve.json").write_text("{")
    with pytest.raises(CurveError, match="cannot be read as JSON"):
        read_curve_file(tmp_path / "curve.json")


@pytest.mark.parametrize("field, value, named", [
    ("losses", [math.nan] * 20, "losses at steps 1, 2, 3, 4, 5 ... are not finite numbers above 0 (step 1: nan)"),
    ("losses", [5.0] * 19 + [math.inf], "losses at step 20 are not finite numbers above 0 (step 20: inf)"),
    ("relative_tolerance", math.nan, "relative_tolerance is nan, not a finite number above 0"),
    ("relative_tolerance", "0.001", "relative_tolerance is '0.001', not a finite number above 0"),
    ("relative_tolerance", {"cpu": 0.001, "cuda": math.nan}, "relative_tolerance.cuda is nan, not a finite number"),
    ("relative_tolerance", {}, "relative_tolerance is {}, not a finite number above 0 or a mapping"),
    ("steps", "20", "steps is '20', not a positive integer"),
    ("data", {"batch_size": "8", "seed": 1, "successors": 4, "vocab_size": 64}, "data.batch_size is '8'"),
    ("optimizer", {"lr": math.nan, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}, "optimizer.lr is nan"),
    ("model", {"hidden_size": 64}, "model: "),
])
def test_a_curve_file_with_a_wrong_field_is_refused_naming_it(tmp_path, field, value, named):
    """A NaN loss or tolerance would pass every device (no comparison with NaN is above a tolerance); a string
    would end in a traceback after the section trained."""
    curve = read_curve_file(REPOSITORY_CURVE)
    curve[field] = value
    (tmp_path / "curve.json").write_text(json.dumps(curve))  # NaN and Infinity, as Python's json writes them
    with pytest.raises(CurveError) as refused:
        read_curve_file(tmp_path / "curve.json")
    assert str(refused.value).startswith(named), str(refused.value)


def test_deepy_refuses_an_unusable_golden_curve_before_any_process_starts(tmp_path):
    from megatron.launch.preflight import preflight_problems
    from tests.test_launch_preflight import TWO_RANKS, run_config

    curve = read_curve_file(REPOSITORY_CURVE)
    curve["relative_tolerance"] = math.nan
    (tmp_path / "nan.json").write_text(json.dumps(curve))
    problems = preflight_problems(run_config(tmp_path, "user_script=cluster_check.py",
                                             f"cluster_check_golden={tmp_path}/nan.json"), TWO_RANKS)
    assert problems == [f"cluster_check_golden = {tmp_path}/nan.json: relative_tolerance is nan, not a finite "
                        "number above 0; point it at a file written by python -m megatron.cluster_check.golden "
                        "--write FILE"]
    without_golden = run_config(tmp_path, "user_script=cluster_check.py", "cluster_check_sections=[environment]",
                                f"cluster_check_golden={tmp_path}/nan.json")
    assert preflight_problems(without_golden, TWO_RANKS) == []


def test_a_run_that_diverges_writes_no_curve(tmp_path, monkeypatch):
    """--write refuses a curve with a NaN loss, which every later check would pass."""
    from megatron.cluster_check import golden

    template = read_curve_file(REPOSITORY_CURVE)
    template.update(steps=2, losses=[1.0, 1.0])
    template["optimizer"]["lr"] = 1e30  # the first step's update overflows: the second loss is NaN
    with pytest.raises(CurveError, match="the run on cpu gave no usable curve: losses at step 2 are not finite"):
        make_curve(template, torch.device("cpu"))
    (tmp_path / "template.json").write_text(json.dumps(template))
    monkeypatch.setattr(sys, "argv", ["golden", "--write", str(tmp_path / "out.json"), "--from",
                                      str(tmp_path / "template.json")])
    with pytest.raises(SystemExit, match=f"nothing written to {tmp_path}/out.json"):
        golden.main()
    assert not (tmp_path / "out.json").exists()


def test_a_cluster_check_of_no_section_is_refused_when_the_config_loads():
    with pytest.raises(ConfigError, match="cluster_check_sections is empty: the cluster check would check nothing"):
        load_config([TINY], ["data_path=d", "cluster_check_sections=[]"])

def test_the_check_started_without_deepy_names_the_command_that_starts_it(monkeypatch, capsys):
    from megatron.runtime.entry import run_rank

    monkeypatch.setattr(sys, "argv", ["cluster_check.py", "configs/1-5B.yml"])
    with pytest.raises(SystemExit) as exited:
        run_rank(lambda cfg: 0, "the cluster check")
    assert exited.value.code == 2
    assert capsys.readouterr().err == ("cluster_check.py runs on the processes deepy.py starts, with the config "
                                       "deepy.py checked: python deepy.py cluster_check.py CONFIG.yml "
                                       "[CONFIG.yml ...] [key=value ...]\n")

# --- real runs --------------------------------------------------------------------------------------------------

def report_sections(log_dir: Path) -> dict[str, str]:
    """Section -> status, from the report's table."""
    rows = [line.split("|") for line in (log_dir / "cluster_check.md").read_text().splitlines()
            if line.startswith("| ") and line.split("|")[1].strip() in CLUSTER_CHECK_SECTIONS]
    return {row[1].strip(): row[2].strip() for row in rows}


@pytest.mark.slow
def test_four_processes_in_tensor_by_pipeline_layout_pass_every_section(demo_data, tmp_path):
    result = run_deepy("cluster_check.py", TINY, *data_overrides(demo_data), "num_gpus=4", "model_parallel_size=2",
                       "pipe_parallel_size=2", f"save={tmp_path}/save", f"log_dir={tmp_path}/logs",
                       timeout=RUN_TIMEOUT_SECONDS)
    output = result.stdout + result.stderr
    assert report_sections(tmp_path / "logs") == dict.fromkeys(CLUSTER_CHECK_SECTIONS, PASS), output
    assert "cluster check: PASS" in result.stdout and "Traceback" not in output
    report = (tmp_path / "logs" / "cluster_check.md").read_text()
    assert "TP 2 x PP 2 x DP 1 against TP = PP = 1" in report and "re-sharded checkpoint scores" in report
    assert "4 device(s) reproduce golden_curve.json" in report and "CPU processes: the config's architecture" in report
    assert sorted(p.name for p in (tmp_path / "save").iterdir()) == []  # the check leaves nothing in `save`


@pytest.mark.slow
def test_a_check_stopped_midway_leaves_its_report_incomplete_with_the_signal(demo_data, tmp_path):
    """Ctrl-C to deepy.py during the golden section (a 200-step curve: long enough to be caught in it). Before,
    the report of the sections done read as a verdict over them, and deepy.py spoke of saving a checkpoint."""
    curve = read_curve_file(REPOSITORY_CURVE)
    curve.update(steps=200, losses=[1.0] * 200)
    (tmp_path / "long.json").write_text(json.dumps(curve))
    report = tmp_path / "logs" / "cluster_check.md"
    command = [sys.executable, "deepy.py", "cluster_check.py", TINY, *data_overrides(demo_data),
               f"log_dir={tmp_path}/logs", "cluster_check_sections=[environment, golden]",
               f"cluster_check_golden={tmp_path}/long.json", f"master_port={free_port()}"]
    with open(tmp_path / "stdout", "w") as stdout, open(tmp_path / "stderr", "w") as stderr:
        deepy = subprocess.Popen(command, cwd=REPO, stdout=stdout, stderr=stderr, env=dict(os.environ,
                                                                                        PYTHONUNBUFFERED="1"))
    deadline = time.monotonic() + RUN_TIMEOUT_SECONDS
    while "1 of 2 sections done" not in (report.read_text() if report.is_file() else ""):
        assert deepy.poll() is None and time.monotonic() < deadline, (tmp_path / "stderr").read_text()
        time.sleep(0.1)
    midway = report.read_text().splitlines()[0]  # what a SIGKILL would leave
    deepy.send_signal(signal.SIGINT)
    deepy.wait(timeout=RUN_TIMEOUT_SECONDS)
    stdout, stderr = (tmp_path / "stdout").read_text(), (tmp_path / "stderr").read_text()
    assert midway == ("# Cluster check: INCOMPLETE (1 of 2 sections done; the check has not ended, or was killed: "
                      "the verdict is written when it ends)")
    assert deepy.returncode == 128 + signal.SIGINT, stdout + stderr
    assert report.read_text().splitlines()[0] == ("# Cluster check: INCOMPLETE (stopped by SIGTERM during golden: "
                                                  "1 of 2 sections done)")
    assert "SIGTERM sent to the 2 ranks here, which stop the check and mark its report INCOMPLETE" in stderr
    assert "deepy.py: cluster_check.py stopped at your request (SIGINT)" in stderr
    assert "save a checkpoint" not in stderr and "Traceback" not in stdout + stderr, stdout + stderr

def other_dataset(demo_data: Path, folder: Path) -> str:
    """The first half of the demo corpus's documents as a dataset of its own: another file under the same name."""
    source = MMapIndexedDataset(f"{demo_data}/demo_text_document")
    folder.mkdir()
    prefix = f"{folder}/demo_text_document"
    builder = MMapIndexedDatasetBuilder(f"{prefix}.bin", dtype=source.dtype)
    for index in range(len(source) // 2):
        builder.add_item(source[index])
        builder.end_document()
    builder.finalize(f"{prefix}.idx")
    return prefix


def in_namespaces(kinds: list[str], commands: list[str]) -> list[str]:
    """The prefix that starts a command in new namespaces (unshare's options, e.g. --mount, --uts) after
    `commands` ran there."""
    return ["unshare", *kinds, "sh", "-c", " && ".join([*commands, 'exec "$0" "$@"'])]


def run_ranks(demo_data: Path, log_dir: Path, overrides: list[str], prefixes: dict[int, list[str]] | None = None,
              world_size: int = 2) -> tuple[list[int], str]:
    """cluster_check.py on `world_size` processes started as DeepSpeed's launcher starts them (the config encoded
    as deepy.py encodes it), the ranks of `prefixes` behind theirs (in_namespaces). Every rank's exit status, and
    all the output."""
    cfg = load_config([TINY], [*data_overrides(demo_data), f"num_gpus={world_size}", f"log_dir={log_dir}",
                               "user_script=cluster_check.py", f"launch_id={uuid.uuid4().hex}",
                               f"master_port={free_port()}", *overrides], world_size=world_size)
    command = [sys.executable, "-u", "cluster_check.py", "--megatron_config", encode_config(cfg)]
    processes = []
    for rank in range(world_size):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                   LOCAL_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(cfg.master_port))
        processes.append(subprocess.Popen([*(prefixes or {}).get(rank, []), *command], cwd=REPO, env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True))
    outputs = [process.communicate(timeout=RUN_TIMEOUT_SECONDS)[0] for process in processes]
    return [process.returncode for process in processes], "\n".join(outputs)


def assert_failed(codes: list[int], output: str, log_dir: Path, section: str, *named: str) -> str:
    """Every rank exited CLUSTER_CHECK_FAILED without a traceback; `section` failed; its findings name `named`."""
    assert codes == [CLUSTER_CHECK_FAILED] * len(codes), output
    assert "Traceback" not in output, output
    assert report_sections(log_dir)[section] == FAIL, output
    findings = (log_dir / "cluster_check.md").read_text().split(f"## {section}: FAIL")[1]
    for text in named:
        assert text in findings, findings
    return findings


needs_namespaces = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("unshare"), reason="needs root and unshare(1) for namespaces")


@pytest.mark.slow
@needs_namespaces
def test_a_save_directory_another_on_one_rank_fails_the_environment(demo_data, tmp_path):
    save = tmp_path / "save"
    save.mkdir()
    codes, output = run_ranks(demo_data, tmp_path / "logs", [f"save={save}", "cluster_check_sections=[environment]"],
                              prefixes={1: in_namespaces(["--mount"], [f"mount -t tmpfs tmpfs {save}"])})
    assert_failed(codes, output, tmp_path / "logs", "environment", f"**rank 1 on {HOST}**",
                  f"save = {save} does not hold the file rank 0 wrote there")
    assert f"rank 0 on {HOST}**" not in (tmp_path / "logs" / "cluster_check.md").read_text()


@pytest.mark.slow
@needs_namespaces
def test_data_that_differs_on_one_rank_fails_the_environment(demo_data, tmp_path):
    other = other_dataset(demo_data, tmp_path / "other")
    path = f"{demo_data}/demo_text_document"
    mounts = [f"mount --bind {other}{suffix} {path}{suffix}" for suffix in (".idx", ".bin")]
    codes, output = run_ranks(demo_data, tmp_path / "logs", ["cluster_check_sections=[environment]"],
                              prefixes={1: in_namespaces(["--mount"], mounts)})
    assert_failed(codes, output, tmp_path / "logs", "environment", f"**rank 1 on {HOST}**: data_path: {path}.idx is "
                  "another file than on rank 0", f"**rank 1 on {HOST}**: data_path: {path}.bin")


@pytest.mark.slow
def test_a_golden_curve_that_does_not_match_fails_the_golden_section(demo_data, tmp_path):
    """Through deepy.py, which says the check found failures rather than naming a crashed rank."""
    curve = read_curve_file(REPOSITORY_CURVE)
    curve["losses"] = [loss * 1.01 for loss in curve["losses"]]
    (tmp_path / "curve.json").write_text(json.dumps(curve))
    result = run_deepy("cluster_check.py", TINY, *data_overrides(demo_data), f"log_dir={tmp_path}/logs",
                       "cluster_check_sections=[golden]", f"cluster_check_golden={tmp_path}/curve.json",
                       check=False, timeout=RUN_TIMEOUT_SECONDS)
    output = result.stdout + result.stderr
    assert_failed([result.returncode], output, tmp_path / "logs", "golden", f"**rank 0 on {HOST}**: step 1 loss",
                  f"**rank 1 on {HOST}**: step 1 loss", "relative 9.9e-03 > 0.001")
    assert "deepy.py: cluster_check.py found failures (exit status 3)" in result.stderr
    assert "first to end" not in result.stderr


@pytest.mark.slow
@needs_namespaces
def test_a_bandwidth_floor_above_what_gloo_gives_fails_the_collectives_of_two_nodes(demo_data, tmp_path):
    """Ranks 2 and 3 start in a UTS namespace named node-b: two nodes of two ranks, so that the groups within a node
    and across nodes are measured and named too."""
    node_b = in_namespaces(["--uts"], ["hostname node-b"])
    codes, output = run_ranks(demo_data, tmp_path / "logs", ["cluster_check_sections=[environment, collectives]",
                                                              "cluster_check_busbw_floor=1000"],
                              prefixes={2: node_b, 3: node_b}, world_size=4)
    findings = assert_failed(codes, output, tmp_path / "logs", "collectives", f"all-reduce world ({HOST}, node-b)",
                             "below the floor cluster_check_busbw_floor = 1000 GB/s", f"within a node ({HOST})",
                             "all-gather within a node (node-b)", f"across nodes (rank 0 on {HOST}; rank 2 on node-b)",
                             f"reduce-scatter across nodes (rank 1 on {HOST}; rank 3 on node-b)")
    assert report_sections(tmp_path / "logs")["environment"] == PASS
    # three operations over the world, two nodes, two pairs; a straggler finding may come beside them on a loaded
    # machine (4 ranks timing a matrix multiply on 2 cores shared with other tests)
    floor_findings = [item for item in findings.split("\n- **")[1:] if "below the floor" in item]
    assert len(floor_findings) == 3 * 5, findings


def test_a_section_is_skipped_when_an_earlier_one_found_its_premise_false():
    from megatron.cluster_check.check import premise_failed

    no_devices = {"environment": SectionResult("environment", FAIL, facts={"devices": False, "save_shared": True})}
    assert premise_failed("environment", {}) is None
    assert all("without a device of their own" in premise_failed(name, no_devices)
               for name in CLUSTER_CHECK_SECTIONS[1:])
    wrong = {"environment": SectionResult("environment", PASS, facts={"devices": True, "save_shared": True}),
             "collectives": SectionResult("collectives", FAIL, facts={"correct": False})}
    assert "wrong values" in premise_failed("numerics", wrong) and "wrong values" in premise_failed("throughput", wrong)
    assert premise_failed("golden", wrong) is None
    slow = {"collectives": SectionResult("collectives", FAIL, facts={"correct": True})}  # below a floor: still correct
    assert all(premise_failed(name, slow) is None for name in CLUSTER_CHECK_SECTIONS)


@pytest.mark.parametrize(("device", "mfu", "floor", "failed", "line"), [
    ("cuda", 0.05, 0, False, "no MFU floor (cluster_check_mfu_floor: 0)"),
    ("cuda", 0.30, 0, False, "no MFU floor (cluster_check_mfu_floor: 0)"),
    ("cuda", 0.30, 0.1, False, "MFU floor 10%"),
    ("cuda", 0.05, 0.1, True, "MFU floor 10%"),
    ("cuda", None, 0.1, False, "MFU floor 10% not applied: no peak FLOP/s for this device (set peak_tflops)"),
    ("cpu", 0.001, 0.1, False, "MFU floor 10% not applied: CPU processes are a report only"),
])
def test_throughput_below_the_mfu_floor_fails_naming_the_slowest_rank(device, mfu, floor, failed, line):
    """The throughput section's judgement of its figures (a GPU's are not measured on this machine); the default
    floor applies when the key is left out."""
    from megatron.cluster_check import throughput
    from megatron.cluster_check.context import CheckContext

    overrides = ["data_path=d"] + ([] if floor == 0.1 else [f"cluster_check_mfu_floor={floor}"])
    cfg = load_config([TINY], overrides)
    result = SectionResult("throughput")
    said = throughput._mfu_floor(result, CheckContext(cfg, Ranks(("a", "a", "b", "b")), torch.device(device), "t"),
                                 {"mfu": mfu}, 5000.0, 2)
    assert said == line and (result.status == FAIL) == failed
    if failed:
        [finding] = result.findings
        assert finding.where == "rank 2 on b"
        assert finding.what.startswith("MFU 5.0%, below the floor cluster_check_mfu_floor = 10%: 5,000 tokens/s where "
                                       "the FLOP model gives 10,000 at the floor")


def golden_on(device_type: str, tolerance: object, folder: str) -> SectionResult:
    """Rank body: the golden section with the repository's curve under `tolerance`, on a device of `device_type`
    (cpu; meta, a type the tolerances below do not list: the section ends before it computes). The curve's losses
    are moved by 1e-9 relative, so that a tolerance below that fails on every CPU (some reproduce the curve
    exactly)."""
    from megatron.cluster_check import golden
    from megatron.cluster_check.context import CheckContext

    curve = read_curve_file(REPOSITORY_CURVE)
    curve["losses"] = [loss * (1 + 1e-9) for loss in curve["losses"]]
    curve["relative_tolerance"] = tolerance
    path = Path(folder) / "curve.json"
    path.write_text(json.dumps(curve))
    cfg = load_config([TINY], ["data_path=d", "num_gpus=1", f"cluster_check_golden={path}"], world_size=1)
    return golden.run(CheckContext(cfg, Ranks.gather(), torch.device(device_type), "t"))


def test_the_golden_tolerance_is_chosen_by_the_device_type(tmp_path):
    from tests.distributed import run_on_ranks

    [cpu] = run_on_ranks(1, golden_on, "cpu", {"cpu": 1e-3, "cuda": 1e-9}, str(tmp_path))
    assert cpu.status == PASS and "tolerance 0.001 relative on cpu" in cpu.figures[0], cpu
    [strict] = run_on_ranks(1, golden_on, "cpu", {"cpu": 1e-12, "cuda": 1.0}, str(tmp_path))
    assert strict.status == FAIL and "> 1e-12" in strict.findings[0].what, strict
    [unlisted] = run_on_ranks(1, golden_on, "meta", {"cpu": 1e-3, "cuda": 1e-3}, str(tmp_path))
    assert unlisted.status == FAIL and unlisted.findings[0].what.endswith(
        "holds no relative_tolerance for meta devices (it has cpu, cuda)"), unlisted

