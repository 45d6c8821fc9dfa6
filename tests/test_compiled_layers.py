"""The `compile` section (megatron/model/compile.py) on this CPU with inductor: each TokenFormer layer compiled,
training tests/tiny.yml (fused Pattentions) at TP = 2 (the lean step) and at PP = 2 (DeepSpeed's pipeline engine)
within fp32 tolerance of the eager run over 10 steps; a compiled run resumed from its checkpoint bitwise equal to
itself uninterrupted; a compiled layer grown to more parameter tokens recompiled to the grown layer's outputs (with
aot_eager: the guards that force the recompile are dynamo's, whichever backend compiles; inductor's C++ took 26 s of
CPU here)."""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path

import pytest
import torch

from megatron.config import load_config
from megatron.model import TokenFormerArgs
from megatron.model.compile import compile_layers
from megatron.model.layer import TokenFormerLayer
from tests.conftest import REPO, read_metrics
from tests.distributed import run_on_ranks
from tests.test_tensor_parallel_training import train

pytestmark = pytest.mark.slow

os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")  # no pool of compile workers in the forked ranks

TINY = REPO / "tests" / "tiny.yml"
ITERATIONS = 10
COMPILED = ("compile={enable: true}",)
FUSED = "pattention_impl=fused"  # auto's choice here, named: flash recomputes in Python loops (many graphs)
RELATIVE_TOLERANCE = 1e-5
# No dropout: compiled code draws its masks with inductor's own generator, so they differ from eager's.


def run(world_size: int, run_dir: Path, demo_data: Path, *overrides: str) -> dict[int, dict]:
    run_on_ranks(world_size, train, [
        f"data_path={demo_data}/demo_text_document", f"vocab_file={demo_data}/tokenizer.json", FUSED,
        f"train_iters={ITERATIONS}", f"lr_decay_iters={ITERATIONS}", "eval_iters=0", "eval_interval=1000",
        "gradient_accumulation_steps=1", f"log_dir={run_dir}/logs", *overrides], timeout=900)
    return {r["iteration"]: r for r in read_metrics(run_dir / "logs") if r["split"] == "train"}


def assert_within_fp32_tolerance(compiled: dict[int, dict], eager: dict[int, dict]) -> None:
    assert sorted(compiled) == sorted(eager) == list(range(1, ITERATIONS + 1))
    for key in ("lm_loss", "grad_norm"):
        errors = [abs(compiled[i][key] - eager[i][key]) / abs(eager[i][key]) for i in eager]
        assert max(errors) < RELATIVE_TOLERANCE, (key, errors)


@pytest.fixture(scope="module")
def tensor_2_compiled(demo_data, tmp_path_factory) -> Path:
    """A compiled TP = 2 run of 10 steps that saved at step 5."""
    run_dir = tmp_path_factory.mktemp("tensor_2_compiled")
    run(2, run_dir, demo_data, "model_parallel_size=2", *COMPILED, f"save={run_dir}/checkpoints",
        "extra_save_iters=[5]")
    return run_dir


def test_compiled_layers_train_as_eager_ones_at_tensor_parallel_2(tensor_2_compiled, demo_data, tmp_path):
    eager = run(2, tmp_path, demo_data, "model_parallel_size=2")
    compiled = {r["iteration"]: r for r in read_metrics(tensor_2_compiled / "logs") if r["split"] == "train"}
    assert_within_fp32_tolerance(compiled, eager)


def test_compiled_layers_train_as_eager_ones_at_pipeline_parallel_2(demo_data, tmp_path):
    eager = run(2, tmp_path / "eager", demo_data, "pipe_parallel_size=2")
    compiled = run(2, tmp_path / "compiled", demo_data, "pipe_parallel_size=2", *COMPILED)
    assert_within_fp32_tolerance(compiled, eager)


def test_a_compiled_run_resumes_bitwise(tensor_2_compiled, demo_data, tmp_path):
    uninterrupted = {r["iteration"]: r for r in read_metrics(tensor_2_compiled / "logs") if r["split"] == "train"}
    saved = tmp_path / "checkpoints"
    shutil.copytree(tensor_2_compiled / "checkpoints" / "global_step5", saved / "global_step5")
    (saved / "latest").write_text("global_step5")
    resumed = run(2, tmp_path, demo_data, "model_parallel_size=2", *COMPILED, f"load={saved}")
    assert sorted(resumed) == list(range(6, ITERATIONS + 1))
    assert [resumed[i]["lm_loss"] for i in resumed] == [uninterrupted[i]["lm_loss"] for i in resumed]


def test_a_layer_grown_to_more_parameter_tokens_recompiles_to_its_own_outputs():
    """Growth appends parameter tokens, so a grown model's layers have longer token matrices: the compiled code
    of the smaller layers fails its guards and is recompiled for them (one graph per shape)."""
    base = dataclasses.replace(TokenFormerArgs.for_inference(load_config([TINY]), 64), pattention_impl="fused",
                               num_layers=1)
    torch._dynamo.utils.counters.clear()
    for tokens in (base.ffn_slot_num, 2 * base.ffn_slot_num):
        args = dataclasses.replace(base, ffn_slot_num=tokens)
        compiled, eager = TokenFormerLayer(args), TokenFormerLayer(args)
        eager.load_state_dict(compiled.state_dict())
        assert compile_layers(compiled, "aot_eager") == 1
        x = torch.randn(2, 16, args.hidden_size)
        torch.testing.assert_close(compiled(x), eager(x), rtol=1e-5, atol=1e-6)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2
