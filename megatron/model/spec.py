"""The one declaration of a TokenFormer layer's Pattentions: every subsystem that needs to know which
Pattentions exist reads it, so adding a kind of Pattention is one entry here.

For each Pattention (all hidden_size -> hidden_size):
    path           module path inside a layer (`layers.{i}.<path>`), as in the official release
    slot_key       the config key setting its parameter-token count (what growth changes)
    hf_name        its name in an exported config.json's `norm_token_counts` (megatron/formats/huggingface.py)
    official_path  its module path inside a layer of the official release's pytorch_model.bin
    component      the part of the model its parameters count towards (parameter_count.py: attention or ffn)
    split_dim      the dimension tensor parallelism splits its key and value tokens along (the tokens)
    key_init, value_init   the init roles of its key and value tokens (official: init_method for keys,
                   output_layer_init_method for values)

Read by: the model's construction (declared_pattentions.py), initialisation (init_methods.py), the parameter
count by component, growth (growth/plan.py, growth/freezing.py), the tensor-parallel layout and the official and
Hugging Face formats (megatron/formats/), the FLOPs and memory formulas, pattention_impl: auto, and the tools and
benchmarks. Readers call the functions below at run time, so a test can declare another Pattention by replacing
`LAYER_PATTENTIONS` (tests/test_model_spec.py). A slot key is a config key marked `token_count` in
megatron/config/schema.py, which cannot import the model; a test pins the two equal.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from megatron.model.init_roles import InitRole

TOKEN_LEAVES = ("key_param_tokens", "value_param_tokens")
COUNT_LEAF = "norm_token_count"


@dataclass(frozen=True)
class PattentionSpec:
    """One Pattention of every layer (see the module docstring for the fields)."""

    path: str
    slot_key: str
    hf_name: str
    official_path: str
    component: str
    split_dim: int = 0
    key_init: InitRole = InitRole.INPUT
    value_init: InitRole = InitRole.OUTPUT

    def init_role(self, leaf: str) -> InitRole:
        """The init role of parameter `leaf` (key_param_tokens or value_param_tokens)."""
        return {"key_param_tokens": self.key_init, "value_param_tokens": self.value_init}[leaf]


LAYER_PATTENTIONS: tuple[PattentionSpec, ...] = (
    PattentionSpec("attention.query", "qkv_slot_num", "query", "attention.query", "attention"),
    PattentionSpec("attention.key", "qkv_slot_num", "key", "attention.key", "attention"),
    PattentionSpec("attention.value", "qkv_slot_num", "value", "attention.value", "attention"),
    PattentionSpec("attention.proj", "proj_slot_num", "proj", "attention.proj", "attention"),
    PattentionSpec("mlp", "ffn_slot_num", "mlp", "mlp", "ffn"),
)

_LAYER_ENTRY = re.compile(rf"^layers\.(?P<layer>\d+)\.(?P<path>.+)\.(?P<leaf>{'|'.join((*TOKEN_LEAVES, COUNT_LEAF))})$")


def layer_pattentions() -> tuple[PattentionSpec, ...]:
    """Every Pattention of a layer, in declaration order."""
    return LAYER_PATTENTIONS


def slot_keys() -> tuple[str, ...]:
    """The config keys setting token counts, each once, in declaration order."""
    return tuple(dict.fromkeys(spec.slot_key for spec in layer_pattentions()))


def layer_token_count(slot_counts: Mapping[str, int]) -> int:
    """The parameter tokens of one layer, summed over its Pattentions, given each slot key's count."""
    return sum(slot_counts[spec.slot_key] for spec in layer_pattentions())


def pattention_at(path: str) -> PattentionSpec | None:
    """The Pattention at module path `path` inside a layer; None if there is none."""
    return next((spec for spec in layer_pattentions() if spec.path == path), None)


def pattention_of_module(module_name: str) -> PattentionSpec | None:
    """The Pattention a module name of a whole model or of a pipeline stage ends with (`layers.3.mlp`,
    `5.attention.query`); None if it is not one."""
    return next((spec for spec in layer_pattentions()
                 if module_name == spec.path or module_name.endswith("." + spec.path)), None)


def pattention_entry(name: str) -> tuple[PattentionSpec, str] | None:
    """(spec, leaf) of a TokenFormerModel state-dict entry `layers.{i}.<path>.<leaf>` of a Pattention, e.g.
    (mlp's spec, "key_param_tokens") for layers.3.mlp.key_param_tokens; None for every other entry."""
    match = _LAYER_ENTRY.match(name)
    spec = pattention_at(match["path"]) if match else None
    return None if spec is None else (spec, match["leaf"])
