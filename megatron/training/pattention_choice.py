"""pattention_impl: auto, decided once per run from the memory model (megatron/model/memory.py).

fused keeps one [tokens, n] score matrix per Pattention and is the faster one wherever memory does not bind;
flash keeps O(tokens) per Pattention and recomputes the scores, so it fits a larger micro-batch at a cost in time
(figures: benchmarks/RESULTS.md). So auto takes fused unless the memory model says a training step of the
configured micro-batch would not fit the device with fused, and flash then.

Per rank, the estimate is: model states (parameters and gradients in the training precision, fp32 master
weights where that is 16-bit, Adam's two moments; optimizer states sharded over the data-parallel ranks under
ZeRO >= 1) for 1/(tensor x pipeline) of the parameters, plus the activations of the micro-batch with each
Pattention's tokens and the vocabulary split over the tensor-parallel ranks. Under a pipeline the first stage
holds as many micro-batches in flight as there are stages, each for its share of the layers: the whole
model's activations of one micro-batch, which is what is counted. A tenth of the device is left for what the
formula leaves out (fragmentation, workspaces, communication buckets, backward's transients).
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass

import torch

from megatron.model.args import TokenFormerArgs
from megatron.model.memory import GIB, model_state_bytes, parameter_count, peak_activation_bytes
from megatron.model.spec import slot_keys

RESERVE = 0.10
_DTYPES = {"fp16": torch.float16, "bfloat16": torch.bfloat16, "fp32": torch.float32}


@dataclass(frozen=True)
class RunShape:
    """What of a run, besides the model, decides its memory per rank."""

    micro_batch: int
    precision: str  # "fp16" | "bfloat16" | "fp32" (the config's derived `precision`)
    zero_stage: int
    data_parallel: int
    tensor_parallel: int
    pipeline_parallel: int

    @classmethod
    def from_config(cls, cfg) -> "RunShape":
        model_copies = cfg.model_parallel_size * max(cfg.pipe_parallel_size, 1)
        world = cfg.world_size or model_copies
        return cls(micro_batch=cfg.train_micro_batch_size_per_gpu, precision=cfg.precision,
                   zero_stage=int((cfg.zero_optimization or {}).get("stage", 0)),
                   data_parallel=max(1, world // model_copies), tensor_parallel=cfg.model_parallel_size,
                   pipeline_parallel=max(cfg.pipe_parallel_size, 1))


def training_bytes_per_rank(args: TokenFormerArgs, impl: str, shape: RunShape, device_type: str) -> int:
    """Model states plus the activations at their peak, on one rank (module docstring)."""
    params = math.ceil(parameter_count(args) / (shape.tensor_parallel * shape.pipeline_parallel))
    states = model_state_bytes(params, shape.data_parallel, mixed_precision=shape.precision != "fp32",
                               sharded=shape.zero_stage >= 1)
    tp = shape.tensor_parallel
    per_rank = dataclasses.replace(args, padded_vocab_size=math.ceil(args.padded_vocab_size / tp),
                                   **{key: math.ceil(getattr(args, key) / tp) for key in slot_keys()})
    activations = peak_activation_bytes(per_rank, impl, _DTYPES[shape.precision], shape.micro_batch,
                                        args.checkpoint_activations, "cpu" if device_type == "cpu" else "cuda")
    return states + activations


def choose_pattention_impl(args: TokenFormerArgs, shape: RunShape, device_type: str,
                           device_bytes: int) -> tuple[str, str]:
    """("fused" or "flash", the reason in one line) for a run of `shape` on a device of `device_bytes`."""
    budget = (1 - RESERVE) * device_bytes
    fused = training_bytes_per_rank(args, "fused", shape, device_type)
    where = f"micro-batch {shape.micro_batch}, {device_bytes / GIB:.1f} GiB per rank, {RESERVE:.0%} kept free"
    if fused <= budget:
        return "fused", (f"fused fits ({fused / GIB:.1f} GiB by the memory model; {where}) and is faster where "
                         "memory does not bind")
    flash = training_bytes_per_rank(args, "flash", shape, device_type)
    return "flash", (f"fused would need {fused / GIB:.1f} GiB, flash {flash / GIB:.1f} GiB ({where}); flash "
                     "keeps no [tokens x n] scores")


def resolve_pattention_impl(cfg, args: TokenFormerArgs, accelerator) -> tuple[str, str | None]:
    """The config's pattention_impl, with auto decided for this run's shape and device: (impl, why auto chose it,
    or None when the config named one)."""
    if cfg.pattention_impl != "auto":
        return cfg.pattention_impl, None
    if args.model_type == "transformer":
        return "fused", "model_type transformer has no Pattentions: the choice has no effect"
    return choose_pattention_impl(args, RunShape.from_config(cfg), accelerator.device_name(),
                                  device_bytes_per_rank(accelerator))


def device_bytes_per_rank(accelerator) -> int:
    """Memory one rank may use: its device's on an accelerator; on a CPU, the machine's shared by the ranks on
    it (DeepSpeed's launcher sets LOCAL_SIZE, torchrun LOCAL_WORLD_SIZE)."""
    total = int(accelerator.total_memory())
    if accelerator.device_name() != "cpu":
        return total
    local_ranks = int(os.environ.get("LOCAL_SIZE") or os.environ.get("LOCAL_WORLD_SIZE") or 1)
    return total // local_ranks
