"""What one rank of a training run holds by the memory model (megatron/model/memory.py), for pattention_impl:
auto's choice (megatron/training/pattention_choice.py), cluster_check's micro-batch and deepy.py's bound on a
CPU node's memory (megatron/launch/node_resources.py).

Per rank, the estimate is: model states (parameters and gradients in the training precision, fp32 master
weights where that is 16-bit, Adam's two moments; optimizer states sharded over the data-parallel ranks under
ZeRO >= 1) for 1/(tensor x pipeline) of the parameters, plus the activations of the micro-batch with each
Pattention's tokens and the vocabulary split over the tensor-parallel ranks. Under a pipeline the first stage
holds as many micro-batches in flight as there are stages, each for its share of the layers: the whole
model's activations of one micro-batch, which is what is counted.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from megatron.model.args import TokenFormerArgs
from megatron.model.memory import model_state_bytes, parameter_count, peak_activation_bytes
from megatron.model.spec import slot_keys

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
