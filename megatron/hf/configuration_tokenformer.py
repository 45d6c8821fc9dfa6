"""TokenFormer's configuration for Hugging Face `transformers` (5.x), loaded with `trust_remote_code=True`.

This file is copied into every directory `tools/convert_to_hf.py` writes, beside `modeling_tokenformer.py`, so
it imports `transformers` only. Field names are those of the GPT-NeoX/TokenFormer config keys where
`transformers` has no convention of its own (`qkv_slot_num`, `norm_activation_type`, `pattention_tau`, ...), so a
config.json reads like the run's YAML; `vocab_size` is the padded vocabulary (the embedding's rows).

`norm_token_counts` holds, per layer, the n of each Pattention's √n (l2 variants) or ·n (softmax): a grown model
keeps the count it was trained with, which is then below its slot count. None means every Pattention's own slot
count, as in an un-grown model.
"""

from transformers import PretrainedConfig

# A layer's Pattentions (their names in norm_token_counts) -> the key of their slot count and their module path
# inside a layer, as config.json's `pattention_slot_keys` and `pattention_paths` give them (the exporter writes
# megatron/model/spec.py's); these defaults, for a config built without them, are the release's layer.
RELEASE_PATTENTIONS = {"query": "qkv_slot_num", "key": "qkv_slot_num", "value": "qkv_slot_num",
                       "proj": "proj_slot_num", "mlp": "ffn_slot_num"}
RELEASE_PATHS = {"query": "attention.query", "key": "attention.key", "value": "attention.value",
                 "proj": "attention.proj", "mlp": "mlp"}
# Where modeling_tokenformer.py can build a Pattention: directly in a layer, or in its attention.
PATTENTION_PARENTS = ("", "attention")
NORM_ACTIVATIONS = ("l2_norm_gelu", "gelu_l2_norm", "softmax")
POSITION_EMBEDDINGS = ("rotary", "learned", "none")
LAYER_NORMS = ("layernorm_nonparam", "layernorm")


class TokenFormerConfig(PretrainedConfig):
    model_type = "tokenformer"
    keys_to_ignore_at_inference = ["past_key_values"]

    vocab_size: int = 50304
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    qkv_slot_num: int = 768
    proj_slot_num: int = 768
    ffn_slot_num: int = 3072
    norm_token_counts: list | None = None
    pattention_slot_keys: dict | None = None
    pattention_paths: dict | None = None
    max_position_embeddings: int = 2048
    pos_emb: str = "rotary"
    rotary_pct: float = 0.25
    rotary_emb_base: int = 10000
    norm: str = "layernorm_nonparam"
    final_norm: str = "layernorm"
    layernorm_epsilon: float = 1e-5
    norm_activation_type: str = "l2_norm_gelu"
    pattention_tau: float = 1.0
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    initializer_range: float = 0.02
    tie_word_embeddings: bool = True
    tokenizer_vocab_size: int | None = None
    use_cache: bool = True
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None

    def __post_init__(self, **kwargs) -> None:
        super().__post_init__(**kwargs)
        choices = {"norm_activation_type": NORM_ACTIVATIONS, "pos_emb": POSITION_EMBEDDINGS, "norm": LAYER_NORMS,
                   "final_norm": LAYER_NORMS}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"config.json: {name}={getattr(self, name)!r} must be one of {allowed}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"config.json: hidden_size={self.hidden_size} is not divisible by num_attention_heads="
                             f"{self.num_attention_heads}")
        if self.pos_emb == "rotary" and (self.rotary_dims == 0 or self.rotary_dims % 2):
            raise ValueError(f"config.json: rotary_pct={self.rotary_pct} gives {self.rotary_dims} rotary dims of a "
                             f"{self.head_dim}-dim head; it must be even and positive")
        if self.pattention_slot_keys is None:
            self.pattention_slot_keys = dict(RELEASE_PATTENTIONS)
        if self.pattention_paths is None:
            self.pattention_paths = dict(RELEASE_PATHS)
        names = list(self.pattention_slot_keys)
        paths = self.pattention_paths
        if (sorted(paths) != sorted(names) or any(paths.get(name) != path for name, path in RELEASE_PATHS.items())
                or any(path.rpartition(".")[0] not in PATTENTION_PARENTS for path in paths.values())):
            raise ValueError(f"config.json: pattention_paths={paths} must give a path to each Pattention of "
                             f"pattention_slot_keys ({', '.join(names)}): the release's at {RELEASE_PATHS}, any "
                             "other directly in a layer (`name`) or in its attention (`attention.name`)")
        counts = self.norm_token_counts
        if counts is not None and (len(counts) != self.num_hidden_layers
                                   or any(sorted(layer) != sorted(names) for layer in counts)):
            raise ValueError(f"config.json: norm_token_counts must hold one {{{', '.join(names)}}} mapping per "
                             f"layer ({self.num_hidden_layers}), or be null")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def rotary_dims(self) -> int:
        """Leading dims of each head that rotary rotates (GPT-NeoX: int(head_dim * rotary_pct))."""
        return int(self.head_dim * self.rotary_pct) if self.pos_emb == "rotary" else 0

    def slot_num(self, pattention: str) -> int:
        return getattr(self, self.pattention_slot_keys[pattention])

    def norm_token_count(self, layer: int, pattention: str) -> int:
        """The n Pattention `pattention` of layer `layer` normalises with."""
        if self.norm_token_counts is None:
            return self.slot_num(pattention)
        return int(self.norm_token_counts[layer][pattention])


__all__ = ["TokenFormerConfig"]
