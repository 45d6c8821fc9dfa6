"""TokenFormer model: Pattention layers, the language model, its initialisation and FLOPs formula."""

from megatron.model.args import TokenFormerArgs
from megatron.model.flops import flops_per_token
from megatron.model.init_methods import initialize_parameters
from megatron.model.pattention import Pattention, pattention
from megatron.model.tokenformer import TokenFormerModel

__all__ = ["TokenFormerArgs", "TokenFormerModel", "Pattention", "pattention", "initialize_parameters",
           "flops_per_token"]
