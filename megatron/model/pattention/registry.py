"""Every way of computing Pattention, by name: the one place a config value (`pattention_impl`,
`flash_backend`) becomes code.

    plain   plain.py: the reference formula under autograd (about three [tokens, n] tensors kept)
    fused   fused.py: one autograd node keeping one [tokens, n] score matrix for backward
    flash   keeping the input and O(tokens) statistics, whatever n is: flash.py's blocks of input rows; with
            the kernels backend and an l2 Θ, flash_triton.py's kernels (no score tile leaves the chip)
The tile backend (config key flash_backend) runs Θ's elementwise work of flash's blocks, and of fused where it
is Triton:
              pytorch   tiles_torch.py for flash; fused's own PyTorch passes
              triton    tiles_triton.py (Triton kernels; on a CPU only under Triton's interpreter)
              kernels   as triton, and flash's l2 Θ in flash_triton.py's whole-Pattention kernels: opted into,
                        never chosen by auto (a 4-layer 1-5B step: 44x slower than fused on an H200, where
                        the blocks ran 1.8x slower on an H100; benchmarks/RESULTS.md, "GPU check, 2026-11-30")
              auto      triton on CUDA tensors, pytorch elsewhere

Every implementation is called as f(x, key_tokens, value_tokens, theta, tau, norm_token_counts, reduce_sum,
reduce_max) -> [B, ..., d_out] for B Pattentions of one input, and computes the same values and gradients;
the reductions are the tensor-parallel all-reduces of the row statistics (parallel.py). The Triton module
is imported only when a flash Pattention runs with it, so a CPU process never loads Triton unasked.
"""

import importlib
from collections.abc import Callable, Sequence
from types import ModuleType

import torch
from torch import Tensor

from megatron.model.args import FLASH_BACKENDS, PATTENTION_IMPLS
from megatron.model.pattention.flash import flash_pattentions
from megatron.model.pattention.fused import fused_pattentions
from megatron.model.pattention import tiles_torch
from megatron.model.pattention.plain import plain_pattentions
from megatron.model.pattention.theta import Reduce, identity

IMPLEMENTATIONS: dict[str, Callable[..., Tensor]] = {
    "plain": plain_pattentions,
    "fused": fused_pattentions,
    "flash": flash_pattentions,
}
TILE_BACKENDS: dict[str, str] = {
    "pytorch": "megatron.model.pattention.tiles_torch",
    "triton": "megatron.model.pattention.tiles_triton",
    "kernels": "megatron.model.pattention.tiles_triton",
}
FLASH_KERNELS = "megatron.model.pattention.flash_triton"
# The Θ flash_triton.py's kernels compute; flash with the kernels backend runs the others in blocks of rows.
FLASH_KERNEL_THETAS = ("l2_norm_gelu", "gelu_l2_norm")


def check_choice(key: str, name: str, choices: tuple[str, ...]) -> None:
    """One error naming the key, the value and every choice."""
    if name not in choices:
        raise ValueError(f"{key}={name!r}: must be one of {', '.join(choices)}")


def resolved_backend(backend: str, device: torch.device) -> str:
    """The tile backend `backend` names for tensors on `device`: auto is Triton on CUDA, PyTorch elsewhere."""
    check_choice("flash_backend", backend, FLASH_BACKENDS)
    return ("triton" if device.type == "cuda" else "pytorch") if backend == "auto" else backend


# Modules imported so far, by name: a lookup here is a dict read that torch.compile traces (an import is a graph
# break), so a compiled layer breaks only in the call that first imports Triton's modules; PyTorch's tiles are
# imported with this module.
_IMPORTED: dict[str, ModuleType] = {TILE_BACKENDS["pytorch"]: tiles_torch}


def _imported(name: str) -> ModuleType:
    module = _IMPORTED.get(name)
    if module is None:
        module = _IMPORTED[name] = importlib.import_module(name)
    return module


def tile_functions(backend: str, device: torch.device) -> ModuleType:
    """The tile backend module `backend` names for tensors on `device` (auto: Triton on CUDA)."""
    resolved = resolved_backend(backend, device)
    try:
        return _imported(TILE_BACKENDS[resolved])
    except ImportError as error:
        raise RuntimeError(f"flash_backend={backend!r} runs Triton kernels, and importing them failed ({error}): "
                           "install triton (pip install triton), or set flash_backend: pytorch") from error


def pattentions_function(impl: str, flash_backend: str = "auto") -> Callable[..., Tensor]:
    """The function computing several Pattentions of one input by implementation `impl` (and, for flash and
    fused, tile backend `flash_backend`, resolved for each call's device); see the module docstring."""
    check_choice("pattention_impl", impl, PATTENTION_IMPLS)
    check_choice("flash_backend", flash_backend, FLASH_BACKENDS)
    if impl == "plain":
        return IMPLEMENTATIONS[impl]
    implementation = IMPLEMENTATIONS[impl]

    def with_tiles(x: Tensor, key_tokens: Sequence[Tensor], value_tokens: Sequence[Tensor], theta: str, tau: float,
                   norm_token_counts: Sequence[int | Tensor], reduce_sum: Reduce = identity,
                   reduce_max: Reduce = identity) -> Tensor:
        backend = resolved_backend(flash_backend, x.device)
        tiles = tile_functions(flash_backend, x.device)  # a failed Triton import: one error, whatever the path
        if impl == "flash" and backend == "kernels" and theta in FLASH_KERNEL_THETAS:
            return _imported(FLASH_KERNELS).flash_kernel_pattentions(
                x, key_tokens, value_tokens, theta, tau, norm_token_counts, reduce_sum, reduce_max)
        # fused without Triton runs its own PyTorch passes, not tiles_torch's
        return implementation(x, key_tokens, value_tokens, theta, tau, norm_token_counts, reduce_sum, reduce_max,
                              tiles=None if impl == "fused" and backend == "pytorch" else tiles)
    return with_tiles
