"""The formats a model can be read from, and the contract a new one implements.

A format is a module of megatron/formats/ with
    NAME                       what a person calls it ("checkpoint", "official", ...)
    recognises(path) -> bool   whether `path` holds this format (by names and headers, cheaply)
    read(path, config) -> (state, Config)
                               the canonical state (whole tensors under TokenFormerModel's names, any dtype)
                               and the config describing it; `config` (a Config or a YAML/JSON file) where the
                               files carry none, checked against theirs where they do
and its writer, taking the canonical state and a Config. `FORMATS` lists the readers; each path is recognised
by one of them only, so their order decides nothing: a sixth format is one new module and one entry here.
"""

from __future__ import annotations

from itertools import chain
from pathlib import Path

from torch import Tensor

from megatron.cli import InputError
from megatron.config import Config
from megatron.formats import consolidated, huggingface, official
from megatron.formats.consolidated import weights_location_problem
from megatron.formats.deepspeed import weights as checkpoint
from megatron.formats.deepspeed.files import tag_directory
from megatron.model import TokenFormerArgs, TokenFormerModel
from megatron.mpu import full_shape

# Each path is recognised by one format only (the weight files by their names), whatever the order
FORMATS = (checkpoint, huggingface, official, consolidated)


def read_state(path: str | Path, config: Config | str | Path | None = None) -> tuple[dict[str, Tensor], Config]:
    """The whole model's state dict (fp32 weights) saved at `path` in any format, and the config describing it."""
    path = Path(path)
    problem = weights_location_problem(path)
    if problem:
        raise FileNotFoundError(problem)
    reader = next((format for format in FORMATS if format.recognises(path)), None)
    if reader is None:  # weights under names none of the formats has: another model's
        raise KeyError(f"{path} has no word_embeddings.weight: it is not a TokenFormer state dict")
    state, cfg = reader.read(path, config)
    return {name: t.float() if t.is_floating_point() else t for name, t in state.items()}, cfg


def describe_weights(path: str | Path) -> str:
    """What `path` loads, for a person: the checkpoint directory and its iteration, or the weights file."""
    path = Path(path)
    tag_dir = tag_directory(path) if path.is_dir() else None
    if tag_dir is None:
        return str(path)
    step = tag_dir.name.removeprefix("global_step")
    return f"{tag_dir} (iteration {step})" if step.isdigit() else str(tag_dir)


def check_state_fits(state: dict[str, Tensor], config: Config, source: str | Path) -> None:
    """One error naming every missing, unexpected or misshapen entry if `state` is not the model `config`
    describes (with the vocabulary size of its embedding)."""
    if "word_embeddings.weight" not in state:
        raise KeyError(f"{source} has no word_embeddings.weight: it is not a TokenFormer state dict")
    args = TokenFormerArgs.for_inference(config, state["word_embeddings.weight"].shape[0])
    model = TokenFormerModel(args, device="meta")
    expected = {name: full_shape(tensor) for name, tensor in chain(model.named_parameters(), model.named_buffers())}
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    wrong = [f"{name} {tuple(state[name].shape)} (config: {expected[name]})" for name in expected
             if name in state and tuple(state[name].shape) != expected[name]]
    if missing or unexpected or wrong:
        raise InputError(f"the weights in {source} do not fit the model its config describes: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}, shapes {wrong[:5]}; check the config's model keys")
