"""benchmarks/synthetic_checkpoint.py writes what the Trainer writes: at tiny size, the same files with the same
structure (keys, shapes, dtypes, ZeRO's paddings and parameter -> slice maps) as a real bf16 ZeRO-1 pipeline
run on 2 ranks, and the Trainer resumes from it."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from benchmarks.synthetic_checkpoint import write_synthetic_checkpoint
from megatron.config import Config, load_config
from megatron.training.pretrain import Trainer
from tests.conftest import REPO
from tests.distributed import run_on_ranks

pytestmark = pytest.mark.slow

TINY = REPO / "tests" / "tiny.yml"
LAYOUT = ("bf16={enabled: true}", "pipe_parallel_size=1", "zero_optimization={stage: 1}")


def structure(value, values: bool = True):
    """`value` with tensors replaced by (shape, dtype) and floats by their type; other scalars kept when
    `values`, else replaced by their type too."""
    if isinstance(value, dict):
        return {key: structure(item, values) for key, item in value.items()}
    if isinstance(value, torch.Size):
        return tuple(value)
    if isinstance(value, (list, tuple)):
        return [structure(item, values) for item in value]
    if isinstance(value, torch.Tensor):
        return tuple(value.shape), value.dtype
    return repr(value) if values and not isinstance(value, float) else type(value).__name__


def train(overrides: list[str]) -> tuple[int, float]:
    """One rank: the iteration the run starts from and its last training loss."""
    world = dist.get_world_size()
    trainer = Trainer(load_config([TINY], [*overrides, f"num_gpus={world}"], world_size=world))
    start = trainer.state.iteration
    state = trainer.train()
    trainer.metrics.close()
    return start, state.last_train_loss


def test_the_synthetic_checkpoint_is_what_the_trainer_writes(demo_data, tmp_path):
    common = [f"data_path={demo_data}/demo_text_document", f"vocab_file={demo_data}/tokenizer.json", "eval_iters=0",
              f"log_dir={tmp_path}/logs", *LAYOUT]
    run_on_ranks(2, train, [*common, "train_iters=1", f"save={tmp_path}/real"])
    real = tmp_path / "real" / "global_step1"
    synthetic = write_synthetic_checkpoint(Config.from_json((real / "config.json").read_text()), tmp_path / "synth", 1)

    assert sorted(p.name for p in synthetic.iterdir()) == sorted(p.name for p in real.iterdir())
    for path in sorted(real.glob("*.pt")):
        exact = not path.name.startswith("rng_state")  # generator states differ in their values only
        expected = structure(torch.load(path, weights_only=False), exact)
        assert structure(torch.load(synthetic / path.name, weights_only=False), exact) == expected, path.name

    resumed = run_on_ranks(2, train, [*common, "train_iters=2", f"load={tmp_path}/synth"])
    assert [start for start, _ in resumed] == [1, 1]
    assert all(torch.isfinite(torch.tensor(loss)) for _, loss in resumed)
