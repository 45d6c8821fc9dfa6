"""The dense baseline (`model_type: transformer`, megatron/model/dense.py) as a Hugging Face GPTNeoXForCausalLM:
transformers runs it with its own code, no remote code, so a dense run's model is compared, evaluated and shared
like any GPT-NeoX model. huggingface.py writes the directory (config.json from `gpt_neox_config`, weights from
`gpt_neox_state`; the run's fields, generation config and tokenizer as for a TokenFormer).

The layer is GPT-NeoX's with a sequential residual (`use_parallel_residual: false`), rotary on `rotary_pct` of
each head, GeLU, biases on every linear layer; names map one to one:

    word_embeddings.weight                  gpt_neox.embed_in.weight
    layers.i.<attention|mlp>.<linear>.*     gpt_neox.layers.i.<attention|mlp>.<linear>.*   (same layout)
    layers.i.<input|post_attention>_layernorm.*, final_norm.*
                                            gpt_neox.layers.i.…_layernorm.*, gpt_neox.final_layer_norm.*
                                            (a non-parametric norm: weight 1, bias 0)
    final_linear.weight (untied) or the embedding (tied)   embed_out.weight
"""

from __future__ import annotations

import torch
from torch import Tensor

from megatron.cli import InputError
from megatron.model import TokenFormerArgs

MODEL_TYPE = "gpt_neox"
_LINEARS = ("attention.query_key_value", "attention.dense", "mlp.dense_h_to_4h", "mlp.dense_4h_to_h")
_NORMS = ("input_layernorm", "post_attention_layernorm")


def check_exportable(args: TokenFormerArgs) -> None:
    """Refuse, in one line, a dense model GPTNeoX cannot compute."""
    if args.pos_emb != "rotary":
        raise InputError(f"pos_emb={args.pos_emb!r}: transformers' GPTNeoX has rotary positions only; a dense model "
                         "exports to it with pos_emb: rotary")


def _norm(state: dict[str, Tensor], ours: str, theirs: str, width: int) -> dict[str, Tensor]:
    weight = state.pop(f"{ours}.weight", None)
    bias = state.pop(f"{ours}.bias", None)
    return {f"{theirs}.weight": torch.ones(width) if weight is None else weight,
            f"{theirs}.bias": torch.zeros(width) if bias is None else bias}


def gpt_neox_state(state: dict[str, Tensor], args: TokenFormerArgs) -> dict[str, Tensor]:
    """GPTNeoXForCausalLM's weights of a dense model's whole state dict; every entry is used, or it refuses."""
    left = dict(state)
    d = args.hidden_size
    embedding = left.pop("word_embeddings.weight")
    out = {"gpt_neox.embed_in.weight": embedding}
    for i in range(args.num_layers):
        for name in _LINEARS:
            for kind in ("weight", "bias"):
                out[f"gpt_neox.layers.{i}.{name}.{kind}"] = left.pop(f"layers.{i}.{name}.{kind}")
        for name in _NORMS:
            out.update(_norm(left, f"layers.{i}.{name}", f"gpt_neox.layers.{i}.{name}", d))
    out.update(_norm(left, "final_norm", "gpt_neox.final_layer_norm", d))
    output = left.pop("final_linear.weight", None)
    out["embed_out.weight"] = embedding.clone() if output is None else output  # safetensors stores no aliases
    if left:
        raise InputError(f"the dense model has weights GPTNeoX has no place for: {sorted(left)[:5]}")
    return out


def gpt_neox_config(args: TokenFormerArgs) -> dict:
    """config.json's architecture of GPTNeoXForCausalLM computing the dense model `args` describe (transformers 5
    reads rope_parameters, earlier versions rotary_pct and rotary_emb_base: both are written); huggingface.py adds
    the run's fields and token ids, as for a TokenFormer."""
    return {
        "model_type": MODEL_TYPE,
        "architectures": ["GPTNeoXForCausalLM"],
        "vocab_size": args.padded_vocab_size,
        "hidden_size": args.hidden_size,
        "num_hidden_layers": args.num_layers,
        "num_attention_heads": args.num_attention_heads,
        "intermediate_size": 4 * args.hidden_size,
        "hidden_act": "gelu",
        "rotary_pct": args.rotary_pct,
        "rotary_emb_base": args.rotary_emb_base,
        "rope_parameters": {"rope_type": "default", "rope_theta": float(args.rotary_emb_base),
                            "partial_rotary_factor": args.rotary_pct},
        "max_position_embeddings": args.max_position_embeddings,
        "layer_norm_eps": args.layernorm_epsilon,
        "use_parallel_residual": False,
        "attention_bias": True,
    }
