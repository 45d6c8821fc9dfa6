"""The few training steps the numerics and throughput sections take, with the framework's own engine.

`engine_for` builds exactly what train.py builds for a config (megatron/training/pretrain.py's
setup_model_and_engine: the model or its pipeline stage, AdamW, DeepSpeed with ZeRO, and the training step,
the lean one or DeepSpeed's as lean_step_problem decides) after switching the process's parallel groups to the
config's layout; `batches` feeds it the synthetic samples the way the training
loop feeds its dataset, each data-parallel rank its own slice of every global batch.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

import torch
from deepspeed.accelerator import get_accelerator

from megatron import mpu
from megatron.cluster_check.synthetic import MarkovTokens
from megatron.config import Config
from megatron.runtime.process_group import use_deterministic_kernels
from megatron.training.data import batch_iterator
from megatron.training.lean_step import lean_step_problem, training_step_for
from megatron.training.pretrain import setup_model_and_engine

DATA_SEED = 20261127


def use_layout(tensor: int, pipe: int) -> None:
    """Collective: this process's data, tensor and pipeline groups for `tensor` x `pipe` (pipe 0: one stage)."""
    if mpu.model_parallel_is_initialized():
        mpu.destroy_model_parallel()
    mpu.initialize_model_parallel(tensor, max(1, pipe))


def engine_for(cfg: Config):
    """(DeepSpeed engine, model args, step) of `cfg` in its layout, as train.py builds them: `step(batches)` ->
    (loss, norm) is the training step train.py takes in this layout (the lean one or DeepSpeed's, as
    lean_step_problem decides for both)."""
    use_layout(cfg.model_parallel_size, cfg.pipe_parallel_size)
    deepspeed_step = lean_step_problem(cfg, get_accelerator().device_name())
    engine, _, model_args = setup_model_and_engine(cfg, lean=deepspeed_step is None)
    return engine, model_args, training_step_for(engine, cfg, deepspeed_step)


def release(engine) -> None:
    """Drop an engine's memory before the next one is built."""
    del engine
    gc.collect()
    get_accelerator().empty_cache()


def batches(cfg: Config, vocab_size: int, first_sample: int = 0) -> Iterator[torch.Tensor]:
    """This rank's micro-batches from global sample `first_sample` on: every layout of the same global batch size
    sees the same samples in each step."""
    samples = MarkovTokens(first_sample + 1000 * cfg.train_batch_size, cfg.seq_length, vocab_size, DATA_SEED)
    return batch_iterator(samples, first_sample, cfg.train_micro_batch_size_per_gpu,
                          mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size())


@contextlib.contextmanager
def exact_arithmetic(device: torch.device) -> Iterator[None]:
    """fp32 matrix products without TF32 and, on an accelerator, deterministic kernels, restored afterwards (the
    throughput section runs at the config's own speed). A CPU's kernels give the same bits run after run already,
    and torch's deterministic mode also fills every new tensor (fill_uninitialized_memory), which the engine's
    large communication buckets make many times slower than the step itself there."""
    deterministic = torch.are_deterministic_algorithms_enabled()
    matmul = torch.get_float32_matmul_precision()
    cudnn_tf32 = torch.backends.cudnn.allow_tf32
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = False
    if device.type != "cpu":
        use_deterministic_kernels()
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(deterministic)
        torch.set_float32_matmul_precision(matmul)
        torch.backends.cudnn.allow_tf32 = cudnn_tf32
