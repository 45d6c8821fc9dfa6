"""TokenFormer model: Pattention layers, the language model, its initialisation and FLOPs formula.

The names below are imported on first use, so a process that reads only the declaration of the Pattentions
(megatron.model.spec) or the model's arguments does not import torch.
"""

from importlib import import_module

_EXPORTS = {"TokenFormerArgs": "megatron.model.args", "TokenFormerModel": "megatron.model.tokenformer",
            "Pattention": "megatron.model.pattention",
            "initialize_parameters": "megatron.model.init_methods", "flops_per_token": "megatron.model.flops"}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'megatron.model' has no attribute {name!r}")
    return getattr(import_module(_EXPORTS[name]), name)
