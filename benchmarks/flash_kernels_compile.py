"""Flash's Triton kernels (megatron/model/pattention/flash_triton.py) compiled for a GPU on any machine, a GPU not
needed (Triton's own ptxas): each kernel's registers a thread and spilled bytes at each tile configuration, which
say whether a configuration fits the register file before any GPU time is spent on it.

    .venv/bin/python -m benchmarks.flash_kernels_compile [--arch 90] [--dtype bf16|fp32|fp64]
        [--theta l2_norm_gelu|gelu_l2_norm] [--tiles 64x64x64x128x8 ...]

--tiles: rows x tokens x step x output width x warps (flash_triton.Tiles); default: flash_triton.TILES' GPU
entry and gpu_pattention's TILES_SWEEP. Runs in a process of its own: Triton must compile here, not interpret
(the kernels' module switches the interpreter on where torch sees no GPU, so this script tells it there is one).
Last line: "spills: S of K kernels spill at the default tiles (flash_triton.TILES['default'])".
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
from pathlib import Path

import torch

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp64": torch.float64}
SIGNATURE_DTYPES = {torch.bfloat16: "*bf16", torch.float32: "*fp32", torch.float64: "*fp64"}
KERNELS = ("_statistics_kernel", "_output_kernel", "_row_dot_kernel", "_input_gradient_kernel",
           "_token_gradient_kernel")
STATISTICS = {"s_ptr", "r_ptr", "c_ptr", "count_ptr", "sum_ptr"}  # fp32 (fp64 for fp64 inputs)


def _compiling_module():
    """flash_triton imported for compilation, not for Triton's interpreter."""
    os.environ.pop("TRITON_INTERPRET", None)
    torch.cuda.is_available = lambda: True  # this process only compiles: nothing runs on a device
    from megatron.model.pattention import flash_triton

    return flash_triton


def kernel_resources(module, name: str, theta: str, dtype: torch.dtype, tiles, arch: int) -> tuple[int, int]:
    """(registers a thread, bytes spilled) of kernel `name` for Θ `theta` and `dtype` inputs at `tiles`."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget

    kernel = getattr(module, name)
    accumulate = tl.float64 if dtype == torch.float64 else tl.float32
    constants = {"THETA": module.THETAS.index(theta), "BM": tiles.m, "BN": tiles.n, "BK": tiles.k, "BD": tiles.d,
                 "ACC": accumulate, "PRECISION": "tf32" if dtype == torch.float32 else "ieee", "ACCUMULATE": True}
    signature, constexprs = {}, {}
    for arg in kernel.arg_names:
        if arg in constants:
            signature[arg], constexprs[arg] = "constexpr", constants[arg]
        elif arg.endswith("_ptr"):
            signature[arg] = SIGNATURE_DTYPES[torch.promote_types(dtype, torch.float32) if arg in STATISTICS
                                              else dtype]
        else:
            signature[arg] = "fp32" if arg == "scale" else "i32"
    compiled = triton.compile(triton.compiler.ASTSource(kernel, signature, constexprs),
                              target=GPUTarget("cuda", arch, 32),
                              options={"num_warps": tiles.warps, "num_stages": tiles.stages})
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as ptx:
        ptx.write(compiled.asm["ptx"])
        ptx.flush()
        bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
        ptxas = next(path for path in (bin_dir / "ptxas-blackwell", bin_dir / "ptxas") if path.exists())
        report = subprocess.run([str(ptxas), f"-arch=sm_{arch}a", "-v", ptx.name, "-o", os.devnull],
                                capture_output=True, text=True, check=True).stderr
    return (int(re.search(r"Used (\d+) registers", report).group(1)),
            int(re.search(r"(\d+) bytes spill stores", report).group(1)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: H100/H200)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--theta", choices=("l2_norm_gelu", "gelu_l2_norm"), default="l2_norm_gelu")
    parser.add_argument("--tiles", nargs="*", default=None, help="rows x tokens x step x width x warps")
    options = parser.parse_args()
    module = _compiling_module()
    from benchmarks.gpu_pattention import TILES_SWEEP

    default = module.TILES["default"]
    configurations = ([tuple(map(int, t.split("x"))) for t in options.tiles] if options.tiles is not None else
                      [(default.m, default.n, default.k, default.d, default.warps), *TILES_SWEEP])
    configurations = list(dict.fromkeys(configurations))
    print(f"sm_{options.arch}, {options.dtype} inputs, {options.theta}: registers a thread / bytes spilled")
    print(f"{'tiles':<18}" + "".join(f"{name.strip('_').removesuffix('_kernel'):>17}" for name in KERNELS))
    spills = {}
    for m, n, k, d, warps in configurations:
        tiles = module.Tiles(m, n, k, d, warps=warps, stages=default.stages)
        row = [kernel_resources(module, name, options.theta, DTYPES[options.dtype], tiles, options.arch)
               for name in KERNELS]
        spills[tiles] = sum(spilled > 0 for _, spilled in row)
        print(f"{f'{m}x{n}x{k}x{d}x{warps}':<18}" + "".join(f"{f'{regs} / {spilled}':>17}" for regs, spilled in row))
    at_default = module.Tiles(default.m, default.n, default.k, default.d, warps=default.warps, stages=default.stages)
    if at_default in spills:
        print(f"spills: {spills[at_default]} of {len(KERNELS)} kernels spill at the default tiles "
              "(flash_triton.TILES['default'])")


if __name__ == "__main__":
    main()
