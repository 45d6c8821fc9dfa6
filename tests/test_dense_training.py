"""The dense Transformer baseline trains, saves and resumes as train.py runs a TokenFormer: tests/tiny.yml with
`model_type: transformer` (no slot counts), 2 processes on gloo, tensor-parallel over both, 20 iterations saved at
10; the resumed run's losses equal the uninterrupted run's bitwise."""

from __future__ import annotations

import shutil

import pytest

from tests.conftest import read_metrics
from tests.distributed import run_on_ranks
from tests.test_tensor_parallel_training import train
from tests.test_training_e2e import data_overrides

pytestmark = pytest.mark.slow

DENSE = ["model_type=transformer", "qkv_slot_num=null", "proj_slot_num=null", "ffn_slot_num=null",
         "model_parallel_size=2", "train_iters=20", "lr_decay_iters=20"]


def train_losses(log_dir) -> dict[int, float]:
    return {r["iteration"]: r["lm_loss"] for r in read_metrics(log_dir) if r["split"] == "train"}


def test_dense_transformer_trains_and_resumes_bitwise(demo_data, tmp_path):
    run_on_ranks(2, train, [*data_overrides(demo_data), *DENSE, f"save={tmp_path}/run", f"log_dir={tmp_path}/logs",
                            "extra_save_iters=[10]"])
    losses = train_losses(tmp_path / "logs")
    assert sorted(losses) == list(range(1, 21)) and losses[1] - losses[20] > 0.5, losses
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copytree(tmp_path / "run" / "global_step10", resumed / "global_step10")
    (resumed / "latest").write_text("global_step10")
    run_on_ranks(2, train, [*data_overrides(demo_data), *DENSE, f"load={resumed}", f"save={resumed}",
                            f"log_dir={tmp_path}/resumed_logs"])
    got = train_losses(tmp_path / "resumed_logs")
    assert sorted(got) == list(range(11, 21))
    assert all(got[i] == losses[i] for i in got), [(i, got[i], losses[i]) for i in got]
