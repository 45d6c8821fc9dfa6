"""TokenFormerModel's name for a parameter of whatever module a run trained: the plain model, a pipeline
stage (DeepSpeed's `<layer index>.<key>` and `tied_modules.<key>.<key>`, model/pipeline.py), or a Pattention
whose leading tokens a frozen run keeps out of training (`<matrix>` is then the parametrization's
`parametrizations.<matrix>.original`, holding only the matrix's trailing rows, model/frozen_tokens.py).

Checkpoints name optimizer state by the module's names, growth and re-sharding work with TokenFormerModel's.
"""

from __future__ import annotations

import re

from torch import nn

from megatron.model.pipeline import pipeline_parameter_model_name

_PARAMETRIZED = re.compile(r"\.parametrizations\.([^.]+)\.original$")


def tokenformer_name(module_name: str, num_layers: int, pipelined: bool) -> str:
    """The TokenFormerModel state-dict name of module parameter `module_name`."""
    name = _PARAMETRIZED.sub(r".\1", module_name)
    return pipeline_parameter_model_name(name, num_layers) if pipelined else name


def holds_trailing_rows(module_name: str) -> bool:
    """Whether module parameter `module_name` is a frozen run's trainable rows of a matrix, the last rows of
    its TokenFormerModel block (so its state is a slice of that block's)."""
    return _PARAMETRIZED.search(module_name) is not None


def module_model_names(module: nn.Module, num_layers: int, pipelined: bool) -> dict[str, str]:
    """Every parameter name of `module` -> its TokenFormerModel name."""
    return {name: tokenformer_name(name, num_layers, pipelined) for name, _ in module.named_parameters()}
