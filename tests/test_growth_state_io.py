"""Reading and writing the full training state of checkpoints in any parallel layout (megatron/checkpoint/:
reader.py, writer.py, engine_state.py), against the real training loop on forked gloo ranks (tests/tiny.yml).

Source runs (the Trainer, a few iterations) report their engines' fp32 masters, Adam moments and step right
after their last save; `open_checkpoint` reads exactly those (DP=2 ZeRO-1, TP=2 ZeRO-0, TP=2 × PP=2 ZeRO-1,
DP=3 ZeRO-2 bf16 with parameters across partitions and alignment padding). Iteration 2 of a 3-iteration run,
written into another layout (DP=2 → TP=2 × PP=1; TP=2 × PP=2 → DP=2), resumes in the Trainer with exactly
that state, and its step 3 gives the source's loss and update; the source is untouched. Bad sources are
named errors, an interrupted write publishes nothing, and reading and writing hold about one parameter.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from deepspeed.utils import lazy_init_hp_params_optimizer_state, safe_get_full_fp32_param, safe_get_full_optimizer_state

from megatron import mpu
from megatron.checkpoint.parameter_state import ParameterState
from megatron.checkpoint.selection import resume_tag
from megatron.config import load_config
from megatron.formats.deepspeed.names import tokenformer_name
from megatron.formats.deepspeed.reader import CheckpointUnreadable, open_checkpoint
from megatron.formats.deepspeed.writer import CheckpointWriter
from megatron.formats.tensor_parallel import split_dimensions
from megatron.inference import load_model
from megatron.model import TokenFormerArgs
from megatron.training.pretrain import Trainer
from tests.conftest import REPO, read_metrics
from tests.distributed import run_on_ranks

pytestmark = pytest.mark.slow

TINY = REPO / "tests" / "tiny.yml"
ZERO_0 = "zero_optimization={stage: 0}"


def run_overrides(demo_data: Path, run_dir: Path, *extra: str, iterations: int = 3) -> list[str]:
    return [f"data_path={demo_data}/demo_text_document", f"vocab_file={demo_data}/tokenizer.json",
            f"train_iters={iterations}", "lr_decay_iters=3", "eval_iters=0", "eval_interval=1000",
            f"log_dir={run_dir}/logs", f"save={run_dir}/checkpoints", "extra_save_iters=[2]", *extra]


def config(overrides: list[str], world_size: int):
    return load_config([TINY], [*overrides, f"num_gpus={world_size}"], world_size=world_size)


def link_moments_of_every_group(optimizer, params: list[torch.Tensor]) -> None:
    """DeepSpeed 0.19.8's ZeRO links parameters to their moments once, after the first group's first step, when
    the other groups have none yet; link them again so that safe_get_full_optimizer_state finds them."""
    inner = optimizer.optimizer
    for index, group in enumerate(inner.param_groups):
        members = [p for p in params if getattr(p, "_hp_mapping", None) and p._hp_mapping.param_group_index == index]
        lazy_init_hp_params_optimizer_state(members, group["params"][0], inner.state)


def live_state(trainer: Trainer) -> dict:
    """This rank's fp32 masters, moments (whole over data-parallel ranks) and buffers, by TokenFormerModel name."""
    engine, cfg = trainer.engine, trainer.cfg
    optimizer, pipelined = engine.optimizer, cfg.pipe_parallel_size >= 1
    base = optimizer if isinstance(optimizer, torch.optim.Optimizer) else optimizer.optimizer
    entries = {}
    if not isinstance(optimizer, torch.optim.Optimizer):
        link_moments_of_every_group(optimizer, list(engine.module.parameters()))
    for name, param in engine.module.named_parameters():
        if isinstance(optimizer, torch.optim.Optimizer):
            state = optimizer.state[param]
            tensors = (param.detach().clone(), state["exp_avg"].clone(), state["exp_avg_sq"].clone())
        else:
            tensors = (safe_get_full_fp32_param(param), safe_get_full_optimizer_state(param, "exp_avg"),
                       safe_get_full_optimizer_state(param, "exp_avg_sq"))
        entries[tokenformer_name(name, cfg.num_layers, pipelined)] = tensors
    for name, buffer in engine.module.named_buffers():
        entries[tokenformer_name(name, cfg.num_layers, pipelined)] = (buffer.clone(), None, None)
    steps = {int(state["step"]) for state in base.state.values()}
    return {"tensor_rank": mpu.get_tensor_parallel_rank(), "steps": steps, "entries": entries}


def train_reporting_state(overrides: list[str], before_training: bool = False) -> dict:
    """One rank: the Trainer's run (loading `load`, if set), then its state after the final save, and with
    `before_training` also right after loading."""
    trainer = Trainer(config(overrides, dist.get_world_size()))
    loaded = live_state(trainer) if before_training else None
    trainer.train()
    trainer.metrics.close()
    return {"loaded": loaded, "final": live_state(trainer)}


def whole(ranks: list[dict], source_config) -> tuple[dict[str, tuple], set[int]]:
    """The ranks' live states joined over tensor ranks; Adam's step counts seen."""
    blocks: dict[str, dict[int, tuple]] = {}
    for rank in ranks:
        for name, tensors in rank["entries"].items():
            blocks.setdefault(name, {}).setdefault(rank["tensor_rank"], tensors)
    dims = split_dimensions(TokenFormerArgs.for_inference(source_config, source_config.padded_vocab_size))
    joined = {}
    for name, by_rank in blocks.items():
        ordered = [by_rank[t] for t in sorted(by_rank)]
        joined[name] = ordered[0] if dims[name] is None else tuple(
            None if parts[0] is None else torch.cat(parts, dim=dims[name]) for parts in zip(*ordered))
    return joined, {step for rank in ranks for step in rank["steps"]}


def assert_same(got: ParameterState, expected: ParameterState, name: str) -> None:
    """Bit-identical weights and moments (or none on both sides)."""
    assert torch.equal(got.weight.to(expected.weight.dtype), expected.weight), name
    assert got.has_moments == expected.has_moments, name
    if expected.has_moments:
        assert torch.equal(got.exp_avg, expected.exp_avg) and torch.equal(got.exp_avg_sq, expected.exp_avg_sq), name


def assert_reads_exactly(checkpoint: Path, ranks: list[dict]) -> None:
    source = open_checkpoint(checkpoint)
    live, steps = whole(ranks, source.config)
    assert sorted(source.names()) == sorted(live)
    assert steps == {source.optimizer_step}
    for name in source.names():
        state, expected = source.state(name), ParameterState(*live[name])
        assert state.weight.dtype == (torch.float32 if expected.weight.is_floating_point() else torch.int64), name
        assert_same(state, expected, name)


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got.double() - expected.double()).norm() / expected.double().norm().clamp_min(1e-30)).item()


def file_hashes(directory: Path) -> dict[str, str]:
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


class SourceRun:
    """A run of `iterations` (of 3) saving at 2 and at its end: its checkpoints, training losses and its
    ranks' live state after the last save."""

    def __init__(self, world_size: int, run_dir: Path, demo_data: Path, *layout: str, iterations: int = 3) -> None:
        overrides = run_overrides(demo_data, run_dir, *layout, iterations=iterations)
        self.ranks = [r["final"] for r in run_on_ranks(world_size, train_reporting_state, overrides)]
        self.losses = {r["iteration"]: r["lm_loss"] for r in read_metrics(run_dir / "logs") if r["split"] == "train"}
        self.checkpoints = run_dir / "checkpoints"


@pytest.fixture(scope="module")
def data_2_zero_1(demo_data, tmp_path_factory) -> SourceRun:
    return SourceRun(2, tmp_path_factory.mktemp("dp2_zero1"), demo_data)


@pytest.fixture(scope="module")
def tensor_2_pipe_2_zero_1(demo_data, tmp_path_factory) -> SourceRun:
    return SourceRun(4, tmp_path_factory.mktemp("tp2_pp2_zero1"), demo_data, "model_parallel_size=2",
                     "pipe_parallel_size=2")


def test_reads_data_parallel_zero_1_exactly(data_2_zero_1):
    assert_reads_exactly(data_2_zero_1.checkpoints, data_2_zero_1.ranks)


def test_reads_tensor_2_by_pipe_2_zero_1_exactly(tensor_2_pipe_2_zero_1):
    assert_reads_exactly(tensor_2_pipe_2_zero_1.checkpoints, tensor_2_pipe_2_zero_1.ranks)


def test_reads_tensor_parallel_zero_0_exactly(demo_data, tmp_path):
    run = SourceRun(2, tmp_path, demo_data, "model_parallel_size=2", ZERO_0, iterations=1)
    assert_reads_exactly(run.checkpoints, run.ranks)


def test_reads_bf16_zero_2_masters_across_uneven_partitions_exactly(demo_data, tmp_path):
    # 3 data-parallel ranks: partitions end inside parameters, and groups are padded to a multiple of 2 · 3
    run = SourceRun(3, tmp_path, demo_data, "zero_optimization={stage: 2}", "bf16={enabled: true}",
                    "train_micro_batch_size_per_gpu=2", "gradient_accumulation_steps=1", iterations=1)
    shard = torch.load(run.checkpoints / "global_step1" / "bf16_zero_pp_rank_2_mp_rank_00_optim_states.pt",
                       weights_only=False)["optimizer_state_dict"]
    assert any(shard["group_paddings"])
    assert any(address.start == 0 and 0 < address.numel < run.ranks[0]["entries"][name][0].numel()
               for mapping in shard["param_slice_mappings"] for name, address in mapping.items())
    assert_reads_exactly(run.checkpoints, run.ranks)


def reshard(source_run: SourceRun, demo_data: Path, target_dir: Path, world_size: int, *layout: str) -> tuple:
    """Iteration 2 of `source_run` written in `layout`, checking the source stays as it was; the target run's
    overrides and the source read."""
    before = file_hashes(source_run.checkpoints)
    source = open_checkpoint(source_run.checkpoints, "global_step2")
    overrides = run_overrides(demo_data, target_dir, *layout, f"load={target_dir}/checkpoints")
    target = config(overrides, world_size)
    target.padded_vocab_size = source.config.padded_vocab_size
    with CheckpointWriter(target_dir / "checkpoints", "global_step2", target, iteration=source.iteration,
                          consumed_train_samples=source.consumed_train_samples,
                          optimizer_step=source.optimizer_step, growth_record=None) as writer:
        for name in reversed(source.names()):
            writer.write(name, source.state(name))
        writer.commit()
    assert file_hashes(source_run.checkpoints) == before
    return overrides, source


def assert_resumes_as_the_source(source_run: SourceRun, demo_data: Path, target_dir: Path, world_size: int,
                                 *layout: str) -> None:
    overrides, source = reshard(source_run, demo_data, target_dir, world_size, *layout)
    written = open_checkpoint(target_dir / "checkpoints")
    assert (written.iteration, written.consumed_train_samples, written.optimizer_step) == (
        2, source.consumed_train_samples, source.optimizer_step)
    model = load_model(target_dir / "checkpoints")
    assert all(torch.equal(tensor, source.state(name).weight.to(tensor.dtype))
               for name, tensor in model.state_dict().items())
    ranks = run_on_ranks(world_size, train_reporting_state, overrides, True)
    loaded, steps = whole([r["loaded"] for r in ranks], source.config)
    assert steps == {source.optimizer_step} == {2}
    for name in source.names():
        assert_same(written.state(name), source.state(name), name)
        assert_same(ParameterState(*loaded[name]), source.state(name), name)
    losses = {r["iteration"]: r["lm_loss"] for r in read_metrics(target_dir / "logs") if r["split"] == "train"}
    assert sorted(losses) == [3] and abs(losses[3] - source_run.losses[3]) <= 1e-6 * source_run.losses[3]
    resumed, continued = open_checkpoint(target_dir / "checkpoints"), open_checkpoint(source_run.checkpoints)
    assert resumed.optimizer_step == continued.optimizer_step == 3
    for name in continued.names():
        got, expected = resumed.state(name), continued.state(name)
        assert relative_error(got.weight, expected.weight) < 1e-6, name
        if expected.has_moments:
            assert relative_error(got.exp_avg, expected.exp_avg) < 1e-5, name
            assert relative_error(got.exp_avg_sq, expected.exp_avg_sq) < 1e-5, name


def test_data_parallel_checkpoint_resumes_under_tensor_2_by_pipe_1(data_2_zero_1, demo_data, tmp_path):
    assert_resumes_as_the_source(data_2_zero_1, demo_data, tmp_path, 2, "model_parallel_size=2",
                                 "pipe_parallel_size=1", ZERO_0, "gradient_accumulation_steps=4")


def test_tensor_2_by_pipe_2_checkpoint_resumes_under_data_parallel_zero_1(tensor_2_pipe_2_zero_1, demo_data,
                                                                           tmp_path):
    assert_resumes_as_the_source(tensor_2_pipe_2_zero_1, demo_data, tmp_path, 2, "gradient_accumulation_steps=1")


def test_missing_tags_and_damaged_files_are_named_errors(data_2_zero_1, tmp_path):
    with pytest.raises(CheckpointUnreadable, match=r"no checkpoint 'global_step7' \(it has \['global_step2', "):
        open_checkpoint(data_2_zero_1.checkpoints, "global_step7")
    checkpoints = Path(shutil.copytree(data_2_zero_1.checkpoints, tmp_path / "checkpoints"))
    (checkpoints / "latest").write_text("global_step9")
    with pytest.raises(CheckpointUnreadable, match="global_step9"):
        open_checkpoint(checkpoints)
    shard = checkpoints / "global_step3" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    os.truncate(shard, shard.stat().st_size // 2)
    with pytest.raises(CheckpointUnreadable, match="zero_pp_rank_1_mp_rank_00_optim_states.pt has .* bytes"):
        open_checkpoint(checkpoints, "global_step3")
    model_file = checkpoints / "global_step2" / "mp_rank_00_model_states.pt"
    data = bytearray(model_file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    model_file.write_bytes(bytes(data))
    with pytest.raises(CheckpointUnreadable, match="mp_rank_00_model_states.pt does not match its SHA-256"):
        open_checkpoint(checkpoints / "global_step2")


def write_until_half(source_dir: Path, save: Path, stop: str) -> None:
    """Copy `source_dir`'s checkpoint into `save` until half of it is written, then fail with `stop`: "raise"
    (an error inside the writer's `with`) or "kill" (SIGKILL, in a forked process: one thread there, as OpenMP
    must not be used across a fork)."""
    if stop == "kill":
        torch.set_num_threads(1)
    source = open_checkpoint(source_dir)
    with CheckpointWriter(save, "global_step3", source.config, iteration=3, consumed_train_samples=48,
                          optimizer_step=source.optimizer_step, growth_record=None) as writer:
        for index, name in enumerate(source.names()):
            if index == len(source.names()) // 2:
                if stop == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                raise RuntimeError("the disk went away")
            writer.write(name, source.state(name))


def test_an_interrupted_write_publishes_nothing(data_2_zero_1, tmp_path):
    raised, killed = tmp_path / "raised", tmp_path / "killed"
    with pytest.raises(RuntimeError, match="the disk went away"):
        write_until_half(data_2_zero_1.checkpoints, raised, "raise")
    assert list(raised.iterdir()) == []
    child = mp.get_context("fork").Process(target=write_until_half, args=(data_2_zero_1.checkpoints, killed, "kill"))
    child.start()
    child.join(timeout=120)
    assert child.exitcode == -signal.SIGKILL
    assert [p.name for p in killed.iterdir()] == [".tmp-global_step3"] and resume_tag(str(killed)) is None


def test_a_failed_background_write_publishes_nothing(data_2_zero_1, tmp_path, monkeypatch):
    source, save = open_checkpoint(data_2_zero_1.checkpoints), tmp_path / "out"
    real_save = torch.save

    def failing_on_moments(state, stream, *args, **kwargs) -> None:  # on a BackgroundWriter thread
        if "exp_avg" in state:
            raise OSError(28, "No space left on device")
        real_save(state, stream, *args, **kwargs)

    monkeypatch.setattr(torch, "save", failing_on_moments)
    with pytest.raises(OSError, match="No space left on device"):
        with CheckpointWriter(save, "global_step3", source.config, iteration=3, consumed_train_samples=48,
                              optimizer_step=source.optimizer_step, growth_record=None) as writer:
            for name in source.names():
                writer.write(name, source.state(name))
            writer.commit()
    assert list(save.iterdir()) == []


# 16 layers of 0.8 M parameters: the whole training state (~160 MB) is many times the few files the writer
# holds at once (its background threads write a layer's or an entry's file each).
WIDE = ("num_layers=16", "hidden_size=128", "qkv_slot_num=512", "proj_slot_num=512", "ffn_slot_num=1024",
        "train_micro_batch_size_per_gpu=1", "gradient_accumulation_steps=1")


def anonymous_memory() -> int:
    """Bytes of this process's private memory in RAM (memory-mapped file pages are not counted)."""
    line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith("RssAnon:"))
    return int(line.split()[1]) * 1024


def peak_memory_of_resharding(source_dir: Path, save: Path, target) -> tuple[int, int]:
    """One process: the peak growth of its private memory while reading every entry of `source_dir` and
    writing it as `target` lays out; and the bytes of the whole state (weights and moments)."""
    baseline, peak, done = anonymous_memory(), [0], threading.Event()

    def sample() -> None:
        while not done.wait(0.0005):
            peak[0] = max(peak[0], anonymous_memory())

    sampler = threading.Thread(target=sample)
    sampler.start()
    source = open_checkpoint(source_dir)
    target.padded_vocab_size = source.config.padded_vocab_size
    whole = 0
    with CheckpointWriter(save, "global_step1", target, iteration=1, consumed_train_samples=2,
                          optimizer_step=source.optimizer_step, growth_record=None) as writer:
        for name in source.names():
            state = source.state(name)
            whole += sum(t.numel() * t.element_size() for t in (state.weight, state.exp_avg, state.exp_avg_sq)
                         if t is not None)
            writer.write(name, state)
            del state
        writer.commit()
    done.set()
    sampler.join()
    return peak[0] - baseline, whole


def test_reading_and_writing_hold_about_one_parameter(demo_data, tmp_path):
    run = SourceRun(2, tmp_path / "source", demo_data, *WIDE, iterations=1)
    target = config(run_overrides(demo_data, tmp_path, *WIDE, "model_parallel_size=2", "pipe_parallel_size=1"), 2)
    [(peak, whole)] = run_on_ranks(1, peak_memory_of_resharding, run.checkpoints, tmp_path / "target", target)
    assert whole > 140e6 and peak < whole / 4, (peak, whole)
