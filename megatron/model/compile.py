"""torch.compile of each TokenFormer layer (the `compile` config section), as torchtitan compiles each block.

Each layer's __call__ is compiled in place (nn.Module.compile), so parameter names, state_dicts and checkpoints
are those of the eager model, and DeepSpeed's engines, the pipeline's stages and activation checkpointing call
the layers as before. The layers of a model share their code, so dynamo compiles it once per distinct set of
shapes: a layer whose Pattentions grew (new parameter tokens, new shapes) fails its guards and is recompiled;
the n of √n is a tensor buffer, so a norm ramp changes values, never the compiled code. Collectives of tensor
parallelism split a layer's graph where dynamo cannot trace them.
"""

from __future__ import annotations

from torch import nn

from megatron.model.layer import TokenFormerLayer


def compile_backend(section: dict | None) -> str | None:
    """The backend the `compile` config section asks for, None when it does not enable compilation."""
    if not section or not section.get("enable", False):
        return None
    return section.get("backend", "inductor")


def compile_layers(model: nn.Module, backend: str) -> int:
    """Compile every TokenFormer layer of `model` (a TokenFormerModel or a pipeline stage) in place; how many."""
    layers = [module for module in model.modules() if isinstance(module, TokenFormerLayer)]
    for layer in layers:
        layer.compile(backend=backend)
    return len(layers)
