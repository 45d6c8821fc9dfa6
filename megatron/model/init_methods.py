"""Parameter initialisation that does not depend on the parallel layout.

Each parameter is drawn on CPU in fp32 from its own `torch.Generator`, seeded from (seed, the parameter's
fully-qualified name). The same seed therefore gives the same full tensors whatever the number of
processes, the device, or the order modules are built in; tensor/pipeline parallelism slices these.

What each parameter is (its InitRole) comes from the Pattention spec (spec.py) for parameter tokens and
from the other modules' `init_roles() -> {local_name: InitRole}`; the GPT-NeoX init methods chosen in the
config (`init_method`, `output_layer_init_method`) say *how* to draw it:
    normal: N(0, std)                      scaled_normal: N(0, std / √(2·num_layers))
    wang_init: N(0, 2 / num_layers / √d)   small_init: N(0, √(2 / (5·d)))
    xavier_normal / xavier_uniform: torch.nn.init's, fans from the full tensor
"""

import hashlib
import math
from collections.abc import Callable, Mapping, Sequence

import torch
from torch import Tensor, nn

from megatron.model.args import TokenFormerArgs
from megatron.model.init_roles import InitRole
from megatron.model.spec import pattention_entry
from megatron.mpu import full_shape, local_block

InitFunction = Callable[[Tensor, torch.Generator], None]


def _normal(std: float) -> InitFunction:
    return lambda tensor, generator: nn.init.normal_(tensor, mean=0.0, std=std, generator=generator)


def init_function(method: str, args: TokenFormerArgs) -> InitFunction:
    """The GPT-NeoX init method `method` ("normal", "scaled_normal", ...) for this model's sizes."""
    if method == "normal":
        return _normal(args.init_method_std)
    if method == "scaled_normal":
        return _normal(args.init_method_std / math.sqrt(2.0 * args.num_layers))
    if method == "wang_init":
        return _normal(2.0 / args.num_layers / math.sqrt(args.hidden_size))
    if method == "small_init":
        return _normal(math.sqrt(2.0 / (5.0 * args.hidden_size)))
    if method == "xavier_normal":
        return lambda tensor, generator: nn.init.xavier_normal_(tensor, generator=generator)
    if method == "xavier_uniform":
        return lambda tensor, generator: nn.init.xavier_uniform_(tensor, generator=generator)
    raise ValueError(f"init method {method!r} is unknown: use one of normal, scaled_normal, wang_init, "
                     f"small_init, xavier_normal, xavier_uniform")


def _role_function(role: InitRole, args: TokenFormerArgs) -> InitFunction:
    if role is InitRole.ONES:
        return lambda tensor, generator: nn.init.ones_(tensor)
    if role is InitRole.ZEROS:
        return lambda tensor, generator: nn.init.zeros_(tensor)
    return init_function(getattr(args, role.value), args)


def parameter_seed(seed: int, name: str) -> int:
    """A stable 63-bit generator seed for parameter `name` (independent of Python's hash randomisation)."""
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def initial_value(name: str, shape: Sequence[int], role: InitRole, seed: int, args: TokenFormerArgs,
                  out: Tensor | None = None) -> Tensor:
    """The full fp32 CPU tensor parameter `name` (relative to TokenFormerModel) starts from; parallel
    layouts slice it. With `out` (a contiguous fp32 CPU tensor of `shape`) it is drawn into `out`: growth
    draws into the grown tensor itself, with no full-size temporary."""
    if out is not None and (tuple(out.shape) != tuple(shape) or out.dtype != torch.float32
                            or out.device.type != "cpu" or not out.is_contiguous()):
        raise ValueError(f"initial_value({name!r}): out must be a contiguous fp32 CPU tensor of shape "
                         f"{tuple(shape)}, not {out.dtype} {tuple(out.shape)} on {out.device}")
    generator = torch.Generator(device="cpu").manual_seed(parameter_seed(seed, name))
    values = torch.empty(tuple(shape), dtype=torch.float32) if out is None else out
    _role_function(role, args)(values, generator)
    return values


def parameter_roles(model: nn.Module) -> dict[str, InitRole]:
    """Fully-qualified parameter name of a TokenFormerModel -> role: a Pattention's from the spec, every other
    parameter's from its module's `init_roles()`."""
    roles = {}
    for module_name, module in model.named_modules():
        if hasattr(module, "init_roles"):
            prefix = f"{module_name}." if module_name else ""
            roles.update({prefix + local: role for local, role in module.init_roles().items()})
    for name, _ in model.named_parameters():
        if (entry := pattention_entry(name)) is not None:
            roles[name] = entry[0].init_role(entry[1])
    return roles


@torch.no_grad()
def initialize_parameters(model: nn.Module, seed: int, args: TokenFormerArgs,
                          model_names: Mapping[str, str] | None = None,
                          model_roles: Mapping[str, InitRole] | None = None) -> None:
    """(Re)initialise every parameter of `model` from (seed, its name); see the module docstring.

    A tensor-parallel block gets its slice of the full tensor, so every layout starts from one model.
    Names (hence values) are TokenFormerModel's: call it on the TokenFormerModel itself, or on a part of it
    (a pipeline stage) with `model_names` (each parameter's TokenFormerModel name) and the TokenFormerModel's
    `model_roles`.
    """
    roles = parameter_roles(model) if model_roles is None else model_roles
    parameters = {model_names[name] if model_names else name: parameter
                  for name, parameter in model.named_parameters()}
    # A part of the model uses only some of the model's roles.
    unused_roles = set(roles) - set(parameters) if model_names is None else set()
    if set(parameters) - set(roles) or unused_roles:
        raise ValueError(f"parameters without an init role: {sorted(set(parameters) - set(roles))}; "
                         f"roles without a parameter: {sorted(unused_roles)}")
    for name, parameter in parameters.items():
        if parameter.is_meta:
            raise ValueError(f"parameter {name} is on the meta device: build the model on a real device to "
                             f"initialise it")
        parameter.copy_(local_block(initial_value(name, full_shape(parameter), roles[name], seed, args), parameter))
