"""Checkpoints written by the real training loop (forked gloo ranks, tests/tiny.yml), shared by the
inference tests, with the logits the training model computes on PROBE tokens just after saving them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from deepspeed.runtime.pipe.engine import PipelineEngine

from megatron import mpu
from megatron.config import load_config
from megatron.training.pretrain import Trainer
from tests.distributed import run_on_ranks

TINY = Path(__file__).resolve().parent / "tiny.yml"
# One micro-batch of tests/tiny.yml (4 sequences of 64 tokens): a pipeline engine runs that shape.
PROBE = torch.randint(0, 2000, (4, 64), generator=torch.Generator().manual_seed(5))


@dataclass(frozen=True)
class TrainedCheckpoint:
    save: Path              # the save directory (with `latest`)
    logits: torch.Tensor    # the training model's logits on PROBE, whole vocabulary
    overrides: tuple[str, ...]

    def config(self, *more: str):
        return load_config([TINY], [*self.overrides, *more])


def _train_then_probe(overrides: list[str]) -> torch.Tensor | None:
    """One rank: train, save, then the trained model's logits on PROBE gathered over the vocabulary (a
    pipeline's last stage holds them; its other stages return None)."""
    world = dist.get_world_size()
    trainer = Trainer(load_config([TINY], [*overrides, f"num_gpus={world}"], world_size=world))
    trainer.train()
    trainer.metrics.close()
    engine = trainer.engine
    if isinstance(engine, PipelineEngine):
        _, logits = engine.eval_batch(iter([(PROBE, PROBE)]), return_logits=True, num_micro_batches=1)
        if not engine.is_last_stage():
            return None
    else:
        with torch.no_grad():
            logits = engine.module.eval()(PROBE)
    return mpu.gather_from_region(logits, -1)


def train_checkpoint(world_size: int, directory: Path, demo_data: Path, *overrides: str) -> TrainedCheckpoint:
    common = (f"data_path={demo_data}/demo_text_document", f"vocab_file={demo_data}/tokenizer.json",
              "train_iters=2", "lr_decay_iters=2", "eval_iters=0", "eval_interval=1000",
              f"log_dir={directory}/logs", f"save={directory}/checkpoints", *overrides)
    logits = next(r for r in run_on_ranks(world_size, _train_then_probe, list(common)) if r is not None)
    return TrainedCheckpoint(directory / "checkpoints", logits, common)


@pytest.fixture
def one_thread():
    """The inference tests' tensors are tiny: one intra-op thread is fastest, and keeps them fast on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tensor_parallel_checkpoint(demo_data, tmp_path_factory) -> TrainedCheckpoint:
    """Model parallel size 2: one mp_rank_XX_model_states.pt per tensor rank."""
    return train_checkpoint(2, tmp_path_factory.mktemp("tp2"), demo_data, "model_parallel_size=2")


@pytest.fixture(scope="session")
def zero_data_parallel_checkpoint(demo_data, tmp_path_factory) -> TrainedCheckpoint:
    """Data parallel size 2 with ZeRO stage 1: the optimizer state partitioned in two files."""
    return train_checkpoint(2, tmp_path_factory.mktemp("dp2"), demo_data, "zero_optimization={stage: 1}")


@pytest.fixture(scope="session")
def pipeline_checkpoint(demo_data, tmp_path_factory) -> TrainedCheckpoint:
    """2 pipeline stages × 2 tensor ranks: one layer_II-model_XX-model_states.pt per layer and tensor rank."""
    return train_checkpoint(4, tmp_path_factory.mktemp("pp2tp2"), demo_data, "pipe_parallel_size=2",
                            "model_parallel_size=2")
