"""The official TokenFormer release's configs, written out for the tests in the release's own format.

The release ships GPT-NeoX YAML files: JSON-like mappings with `#` comments, Python-style `True`/`False`,
and dashed keys (`tokenizer-type`). These are written from its published hyper-parameters (the paper's
Table 1 sizes and the released training recipes), so the tests need nothing outside this repository.

    write_official_configs(directory)  ->  {name: path} for the 8 files
"""

from __future__ import annotations

import json
from pathlib import Path

# size -> (num_layers, hidden_size, num_attention_heads); qkv/proj slots = hidden_size, ffn slots = 4 * hidden.
SIZES = {"150M": (12, 768, 12), "450M": (24, 1024, 16), "900M": (32, 1280, 16), "1-5B": (40, 1536, 16)}
# size -> (micro-batch per GPU, gradient accumulation) of the Pile runs: 1024 sequences per step.
PILE_BATCH = {"150M": (32, 4), "450M": (16, 4), "900M": (8, 4), "1-5B": (8, 2)}


def _common(layers: int, hidden: int, heads: int, slots: int, ffn_slots: int, seq: int) -> dict:
    return {
        "pipe_parallel_size": 1, "model_parallel_size": 1,
        "num_layers": layers, "hidden_size": hidden, "num_attention_heads": heads,
        "qkv_slot_num": slots, "proj_slot_num": slots, "ffn_slot_num": ffn_slots,
        "seq_length": seq, "max_position_embeddings": seq, "pos_emb": "rotary", "rotary_pct": 0.25,
        "no_weight_tying": False, "norm": "layernorm_nonparam", "final_norm": "layernorm", "gpt_j_residual": False,
        "output_layer_parallelism": "column", "use_bias_in_attn_linear": False,
        "attention_config": [[["tokenformer"], layers]], "norm_activation_type": "l2_norm_gelu",
        "scaled_upper_triang_masked_softmax_fusion": False, "bias_gelu_fusion": False, "rope_fusion": False,
        "layernorm_fusion": False, "init_method": "normal", "output_layer_init_method": "wang_init",
        "optimizer": {"type": "Adam", "params": {"lr": 0.0006, "betas": [0.9, 0.95], "eps": 1.0e-8}},
        "min_lr": 0.00006,
        "zero_optimization": {"stage": 1, "allgather_partitions": True, "allgather_bucket_size": 500000000,
                              "overlap_comm": True, "reduce_scatter": True, "reduce_bucket_size": 500000000,
                              "contiguous_gradients": True, "cpu_offload": False},
        "data_impl": "mmap", "num_workers": 4,
        "checkpoint_activations": True, "checkpoint_num_layers": 1, "partition_activations": True,
        "synchronize_each_layer": True, "gradient_clipping": 1.0, "weight_decay": 0.1, "hidden_dropout": 0,
        "attention_dropout": 0,
        "fp16": {"fp16": True, "enabled": True, "loss_scale": 0, "loss_scale_window": 1000,
                 "initial_scale_power": 12, "hysteresis": 2, "min_loss_scale": 1},
        "distributed_backend": "nccl", "lr_decay_style": "cosine", "warmup": 0.01, "checkpoint_factor": 500,
        "extra_save_iters": [0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512], "eval_interval": 5000, "eval_iters": 100,
        "wall_clock_breakdown": True, "keep_last_n_checkpoints": 6,
        "checkpoint_validation_with_forward_pass": False, "adlr_autoresume": True,
        "tokenizer-type": "HFTokenizer", "vocab-file": "./tokenizer.json",
        "launcher": "slurm", "deepspeed_slurm": False, "no_ssh_check": True,
        "tensorboard_dir": "tensorboard", "use_wandb": False, "wandb_host": "https://api.wandb.ai",
        "wandb_project": "neox",
    }


def _run(name: str, log: str, iters: int, batch: tuple[int, int], print_every: int, data: str) -> dict:
    work = f"./work_dirs/{name}"
    return {"train_micro_batch_size_per_gpu": batch[0], "gradient_accumulation_steps": batch[1],
            "train_iters": iters, "lr_decay_iters": iters, "log_interval": print_every, "steps_per_print": print_every,
            "save": f"{work}/checkpoints", "load": f"{work}/checkpoints", "log_dir": f"{work}/{log}",
            "data_path": data}


def official_configs() -> dict[str, dict]:
    """File name -> the mapping it holds."""
    pile = "./data/pile/pile_0.87_deduped_text_document"
    owt2 = "./data/openwebtext2/openwebtext2_text_document"
    configs = {}
    for size, (layers, hidden, heads) in SIZES.items():
        model = _common(layers, hidden, heads, hidden, 4 * hidden, 2048)
        configs[f"{size}_train_pile.yml"] = {**model, **_run(f"{size}_TokenFormer_Pile", "logs_train", 143000,
                                                             PILE_BATCH[size], 1, pile)}
        if size in ("150M", "1-5B"):
            configs[f"{size}_eval.yml"] = {**model, **_run(f"{size}_TokenFormer_Pile", "logs_eval", 143000, (8, 2),
                                                           500, pile.replace("./data", "./dataset/language_dataset")),
                                           "eval_ckpt": f"./TokenFormer-{size}/pytorch_model.bin"}
    base = _common(24, 1024, 16, 768, 3072, 1024)  # the 150M's token counts at width 1024
    configs["354M_train_openwebtext2_basemodel.yml"] = {
        **base, **_run("354M_TokenFormer_Openwebtext2_basemodel", "logs_train", 600000, (16, 2), 100, owt2)}
    grown = _common(24, 1024, 16, 1792, 7168, 1024)
    configs["354M_to_757M_train_openwebtext2_60k.yml"] = {
        **grown, **_run("354M_to_757M_TokenFormer_Openwebtext2_60k", "logs_train", 60000, (8, 1), 500, owt2),
        "keep_last_n_checkpoints": 4, "pretrain_partial_init": "./354M_TokenFormer_Openwebtext2/checkpoints"}
    return configs


def _value(value: object) -> str:
    """A value as the release writes it: JSON, but Python's True/False for booleans and floats YAML reads as
    floats (`1.0e-08`, not `1e-08`)."""
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, float):
        mantissa, _, exponent = repr(value).partition("e")
        mantissa = mantissa if "." in mantissa else mantissa + ".0"
        return mantissa + ("e" + exponent if exponent else "")
    if isinstance(value, list):
        return "[" + ", ".join(map(_value, value)) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k)}: {_value(v)}" for k, v in value.items()) + "}"
    return json.dumps(value)


def render(config: dict) -> str:
    """The release's layout: one key a line, a trailing `#` comment on the Θ choice."""
    lines = []
    for key, value in config.items():
        comment = '  # "l2_norm_gelu", "gelu_l2_norm", "softmax"' if key == "norm_activation_type" else ""
        lines.append(f"  {json.dumps(key)}: {_value(value)},{comment}")
    lines[-1] = lines[-1].rstrip(",")
    return "{\n" + "\n".join(lines) + "\n}\n"


def write_official_configs(directory: Path) -> dict[str, Path]:
    directory.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, config in official_configs().items():
        paths[name] = directory / name
        paths[name].write_text(render(config), encoding="utf-8")
    return paths
