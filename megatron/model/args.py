"""The model's own view of the configuration.

The model reads only this small dataclass, so it can be built and tested without the full
training config; `TokenFormerArgs.from_config` copies the same-named (GPT-NeoX) attributes
from any config object.
"""

from dataclasses import MISSING, dataclass, fields
from typing import Any

from megatron.cli import InputError
from megatron.model.spec import slot_keys

MODEL_TYPES = ("tokenformer", "transformer")
POSITION_EMBEDDINGS = ("rotary", "learned", "none")
LAYER_NORMS = ("layernorm_nonparam", "layernorm")
NORM_ACTIVATIONS = ("l2_norm_gelu", "gelu_l2_norm", "softmax")
PATTENTION_IMPLS = ("plain", "fused", "flash")
FLASH_BACKENDS = ("auto", "pytorch", "triton", "kernels")
# How growth makes new parameter tokens (docs/growth.md): the layer's grow() and the config's growth_mode.
GROWTH_MODES = ("preserve", "official")
DEFAULT_GROWTH_MODE = "official"
INIT_METHODS = ("normal", "scaled_normal", "wang_init", "small_init", "xavier_normal", "xavier_uniform")
# Config keys that change the function the weights compute (shapes are checked against the weights).
ARCHITECTURE_KEYS = ("model_type", "num_layers", "hidden_size", "num_attention_heads", *slot_keys(),
                     "pos_emb", "rotary_pct", "rotary_emb_base", "norm", "final_norm",
                     "layernorm_epsilon", "no_weight_tying", "norm_activation_type", "pattention_tau")


@dataclass
class TokenFormerArgs:
    """Hyper-parameters of a TokenFormer (or, with model_type "transformer", of the dense baseline of the same
    width and depth); names and defaults follow GPT-NeoX / the official release.

    `max_position_embeddings=None` means `seq_length` (as in GPT-NeoX); `final_norm=None` means the
    same kind as `norm` (as in the official code).
    """

    padded_vocab_size: int
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    qkv_slot_num: int | None  # the parameter-token counts: None (unused) for model_type "transformer"
    proj_slot_num: int | None
    ffn_slot_num: int | None
    seq_length: int
    model_type: str = "tokenformer"
    max_position_embeddings: int | None = None
    pos_emb: str = "rotary"
    rotary_pct: float = 1.0
    rotary_emb_base: int = 10000
    norm: str = "layernorm_nonparam"
    final_norm: str | None = "layernorm"
    layernorm_epsilon: float = 1e-5
    no_weight_tying: bool = False
    norm_activation_type: str = "l2_norm_gelu"
    pattention_tau: float = 1.0
    pattention_impl: str = "flash"
    flash_backend: str = "auto"
    init_method: str = "normal"
    output_layer_init_method: str = "scaled_normal"
    init_method_std: float = 0.02
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    checkpoint_activations: bool = False
    checkpoint_num_layers: int = 1
    seed: int = 1234

    def __post_init__(self) -> None:
        if self.max_position_embeddings is None:
            self.max_position_embeddings = self.seq_length
        if self.final_norm is None:
            self.final_norm = self.norm
        self._validate()

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def rotary_dims(self) -> int:
        """Leading dims of each head that get rotary embeddings (GPT-NeoX: int(head_dim * rotary_pct))."""
        return int(self.head_dim * self.rotary_pct) if self.pos_emb == "rotary" else 0

    @classmethod
    def from_config(cls, cfg: Any, **overrides: Any) -> "TokenFormerArgs":
        """Build from any object with GPT-NeoX-named attributes; absent optional ones keep defaults.

        `overrides` take precedence over the config (e.g. a vocabulary size before the tokenizer sets it).
        """
        values = dict(overrides)
        for field in fields(cls):
            if field.name in values:
                continue
            if hasattr(cfg, field.name):
                values[field.name] = getattr(cfg, field.name)
            elif field.default is MISSING:
                raise InputError(f"config has no '{field.name}', which the model needs: set it in the config")
        if values.get("pattention_impl") == "auto":
            # A training run decides auto itself (training/pattention_choice.py); a model built for anything
            # else keeps nothing for backward, where fused is the faster one.
            values["pattention_impl"] = "fused"
        return cls(**values)

    @classmethod
    def for_inference(cls, cfg: Any, padded_vocab_size: int) -> "TokenFormerArgs":
        """The config's architecture with no dropout and no recomputation: the model a checkpoint is read
        into, written from, or evaluated with."""
        return cls.from_config(cfg, padded_vocab_size=padded_vocab_size, hidden_dropout=0.0, attention_dropout=0.0,
                               checkpoint_activations=False)

    def _validate(self) -> None:
        if self.model_type not in MODEL_TYPES:
            raise InputError(f"model_type={self.model_type!r}: must be one of {MODEL_TYPES}")
        slots = slot_keys() if self.model_type == "tokenformer" else ()
        positive = ("padded_vocab_size", "hidden_size", "num_layers", "num_attention_heads", *slots,
                    "seq_length", "max_position_embeddings", "checkpoint_num_layers")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise InputError(f"{name}={value!r}: must be a positive integer")
        choices = {"pos_emb": POSITION_EMBEDDINGS, "norm": LAYER_NORMS, "final_norm": LAYER_NORMS,
                   "norm_activation_type": NORM_ACTIVATIONS, "pattention_impl": PATTENTION_IMPLS,
                   "flash_backend": FLASH_BACKENDS, "init_method": INIT_METHODS,
                   "output_layer_init_method": INIT_METHODS}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise InputError(f"{name}={getattr(self, name)!r}: must be one of {allowed}")
        if self.hidden_size % self.num_attention_heads:
            raise InputError(f"hidden_size={self.hidden_size} is not divisible by num_attention_heads="
                             f"{self.num_attention_heads}: choose a head count that divides it")
        for name in ("hidden_dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise InputError(f"{name}={getattr(self, name)!r}: must be in [0, 1)")
        if self.pos_emb == "rotary":
            if not 0.0 < self.rotary_pct <= 1.0:
                raise InputError(f"rotary_pct={self.rotary_pct!r}: must be in (0, 1]")
            if self.rotary_dims == 0 or self.rotary_dims % 2:
                raise InputError(f"rotary_pct={self.rotary_pct} gives {self.rotary_dims} rotary dims of a "
                                 f"{self.head_dim}-dim head: choose rotary_pct so head_dim*rotary_pct is even and > 0")
        if self.pos_emb == "learned" and self.max_position_embeddings < self.seq_length:
            raise InputError(f"max_position_embeddings={self.max_position_embeddings} is below seq_length="
                             f"{self.seq_length}: learned positions need one row per position; raise it")
        for name in ("pattention_tau", "layernorm_epsilon", "init_method_std", "rotary_emb_base"):
            if not getattr(self, name) > 0:
                raise InputError(f"{name}={getattr(self, name)!r}: must be positive")


def args_problem(values: dict[str, Any]) -> str | None:
    """Why TokenFormerArgs(**values) is refused (a field it lacks or does not know, a wrong value); None if it is
    not: a file naming a model (a golden curve's) is judged before anything is built from it."""
    try:
        TokenFormerArgs(**values)
    except (TypeError, ValueError) as error:
        return str(error)
    return None
