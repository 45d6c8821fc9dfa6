"""`load_model`: a checkpoint or exported weights -> a TokenFormerModel for inference, without DeepSpeed.

    from megatron.inference import load_model
    model = load_model("demo_run/checkpoints")      # newest checkpoint, whatever TP/PP layout it was saved in
    logits = model(torch.tensor([[1, 2, 3]]))        # LongTensor [batch, seq] -> logits [batch, seq, vocab]

`path` may be
  - a checkpoint directory (`save`, whose `latest` names the tag) or one `global_stepN` directory in it;
  - an exported directory or file: `model.safetensors` / `pytorch_model.bin` (or a sharded `*.index.json`)
    with `config.json` beside it, or DeepSpeed's zero_to_fp32 output (pass `config=` for that one);
  - a Hugging Face model directory tools/convert_to_hf.py wrote;
  - the official release's `pytorch_model.bin` (recognised by its keys; pass `config=`).
Every format is read into the whole model by megatron/formats/ (registry.py's `read_state`).
The architecture comes from the `config.json` saved with the weights; `config` (a Config, or a YAML/JSON
file) is needed only where none was saved, and when both exist their architecture keys must agree.
Whatever layout the weights were saved in is consolidated into the whole model first. Called where
`mpu` is initialised (generate.py, eval.py under tensor parallelism), each rank then keeps its own block;
anywhere else (a notebook, a script) the model is whole and its logits cover the whole vocabulary.
Weights are cast to fp32.

A checkpoint directory is verified against its manifest before it is read (formats/deepspeed/weights.py).
"""

from __future__ import annotations

from itertools import chain
from pathlib import Path

import torch
from torch import Tensor

from megatron.config import Config
from megatron.formats.registry import check_state_fits, read_state
from megatron.model import TokenFormerArgs, TokenFormerModel
from megatron.mpu import local_block


def _own_block(whole: Tensor, like: Tensor) -> Tensor:
    """This rank's block of `whole`, copied when it is a part, so that the whole tensor can be freed."""
    block = local_block(whole, like)
    return block if block.shape == whole.shape else block.clone()


def build_model(state: dict[str, Tensor], config: Config, device: str | torch.device = "cpu",
                source: str | Path = "the state dict") -> TokenFormerModel:
    """A model in eval mode holding `state` (this rank's blocks of it under tensor parallelism)."""
    check_state_fits(state, config, source)
    args = TokenFormerArgs.for_inference(config, state["word_embeddings.weight"].shape[0])
    model = TokenFormerModel(args, device="meta")
    local = {name: _own_block(state[name], tensor)
             for name, tensor in chain(model.named_parameters(), model.named_buffers())}
    model.load_state_dict(local, assign=True)
    return model.to(device).eval()


def load_model(path: str | Path, config: Config | str | Path | None = None,
               device: str | torch.device = "cpu") -> TokenFormerModel:
    """The model saved at `path`, in eval mode on `device` (see the module docstring for what `path` may be)."""
    state, cfg = read_state(path, config)
    return build_model(state, cfg, device, path)
