"""Build the Pattentions the spec (spec.py) declares, so a layer's modules and the declaration cannot differ."""

import torch
from torch import nn

from megatron.model.args import TokenFormerArgs
from megatron.model.pattention import ParallelPattention, Pattention
from megatron.model.spec import layer_pattentions


def add_declared_pattentions(owner: nn.Module, parent: str, args: TokenFormerArgs,
                             device: str | torch.device | None = None) -> None:
    """Add to `owner`, the module at path `parent` inside a layer ("" for the layer itself), each Pattention
    the spec declares directly under it: hidden_size -> hidden_size, split over the tensor-parallel ranks."""
    d = args.hidden_size
    for spec in layer_pattentions():
        module_parent, _, name = spec.path.rpartition(".")
        if module_parent != parent:
            continue
        pattention = ParallelPattention(d, d, getattr(args, spec.slot_key), args.norm_activation_type,
                                        args.pattention_tau, device=device, impl=args.pattention_impl,
                                        flash_backend=args.flash_backend)
        if pattention.key_param_tokens.partition_dim != spec.split_dim:
            raise ValueError(f"{spec.path}: megatron/model/spec.py declares split_dim {spec.split_dim}, but "
                             f"ParallelPattention splits its tokens along {pattention.key_param_tokens.partition_dim}")
        owner.add_module(name, pattention)


def check_declared_pattentions(layer: nn.Module) -> None:
    """Raise unless `layer`'s Pattentions are exactly those the spec declares."""
    built = {name for name, module in layer.named_modules() if isinstance(module, Pattention)}
    declared = {spec.path for spec in layer_pattentions()}
    if built != declared:
        raise ValueError(f"{type(layer).__name__} builds the Pattentions {sorted(built)} but megatron/model/spec.py "
                         f"declares {sorted(declared)}: declare each one there, under a module that builds it")
