"""Every accepted configuration key, declared once.

The loader, the validator, the `Config` object and the generated docs/config.md
all read this table, so adding a key here is the only step needed to accept it.
Names and defaults follow GPT-NeoX so its YAML files work unchanged; keys that
GPT-NeoX accepts but this framework does not act on are kept (so those files
still load) and carry the reason in `inactive`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

GPT_NEOX_PORT = 29500  # rank 0's port where nothing chose one (master_port below)

GROUPS = (
    "model",
    "optimizer",
    "training",
    "data",
    "checkpoint",
    "logging",
    "parallelism",
    "launcher",
    "inference",
    "cluster check",
)


@dataclass(frozen=True)
class Range:
    """Closed or half-open numeric interval a value must lie in."""

    low: float = -math.inf
    high: float = math.inf
    low_open: bool = False
    high_open: bool = False

    def contains(self, value: float) -> bool:
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return above and below

    def __str__(self) -> str:
        if self.high == math.inf:
            return f"> {self.low:g}" if self.low_open else f">= {self.low:g}"
        left = "(" if self.low_open else "["
        right = ")" if self.high_open else "]"
        return f"{left}{self.low:g}, {self.high:g}{right}"


AT_LEAST_ONE = Range(1)
NON_NEGATIVE = Range(0)
POSITIVE = Range(0, low_open=True)
PROBABILITY = Range(0, 1, high_open=True)
FRACTION = Range(0, 1)


@dataclass(frozen=True)
class Key:
    """One configuration key: its type, default, meaning and constraints.

    `type` is one of bool, int, float, str, list, dict (`item` gives the type of
    list elements or mapping values). A default of None means "unset" and null is then accepted.
    `derived` explains how the value is computed when not given; `inactive` is
    the reason the key has no effect in this framework. `pattention` marks a setting of the Pattention layers
    (the dense baseline has none); `token_count` one of their parameter-token counts, a `slot_key` of
    megatron/model/spec.py (tests/test_model_spec.py pins the two equal): required of a TokenFormer and split
    by tensor parallelism.
    """

    name: str
    type: type
    default: Any
    group: str
    meaning: str
    choices: tuple[str, ...] = ()
    valid_range: Range | None = None
    item: type | None = None
    required: bool = False
    derived: str = ""
    inactive: str = ""
    pattention: bool = False
    token_count: bool = False


# flash_backend's values that run Triton on any device (on a CPU, under Triton's interpreter).
TRITON_FLASH_BACKENDS = ("triton", "kernels")
_NO_FUSED_KERNELS = "no fused CUDA kernels here; the plain PyTorch operations are always used"
_INIT_METHODS = (
    "normal",
    "scaled_normal",
    "xavier_uniform",
    "xavier_normal",
    "wang_init",
    "small_init",
)

_MODEL = (
    Key("model_type", str, "tokenformer", "model",
        "tokenformer: every projection a Pattention; transformer: the dense baseline, GPT-NeoX's layer (linear "
        "Q/K/V and output projections, a 4 x hidden_size GeLU MLP, with biases) in the same model, norms, rotary, "
        "vocabulary and trainer; it has no parameter tokens, so the *_slot_num keys do not apply and growth, "
        "the official format and the TokenFormer HF export refuse it.", choices=("tokenformer", "transformer")),
    Key("num_layers", int, None, "model", "Number of TokenFormer layers.", valid_range=AT_LEAST_ONE, required=True),
    Key("hidden_size", int, None, "model", "Width of the residual stream (token dimension).",
        valid_range=AT_LEAST_ONE, required=True),
    Key("num_attention_heads", int, None, "model", "Token-token attention heads; must divide hidden_size.",
        valid_range=AT_LEAST_ONE, required=True),
    Key("qkv_slot_num", int, None, "model", "Key/value parameter tokens of the Pattention layers producing Q, K and V "
        "(required for model_type tokenformer).", valid_range=AT_LEAST_ONE, pattention=True, token_count=True),
    Key("proj_slot_num", int, None, "model", "Key/value parameter tokens of the attention output Pattention layer "
        "(required for model_type tokenformer).", valid_range=AT_LEAST_ONE, pattention=True, token_count=True),
    Key("ffn_slot_num", int, None, "model", "Key/value parameter tokens of the feed-forward Pattention layer "
        "(required for model_type tokenformer).", valid_range=AT_LEAST_ONE, pattention=True, token_count=True),
    Key("seq_length", int, None, "model", "Tokens per training sample.", valid_range=AT_LEAST_ONE, required=True),
    Key("max_position_embeddings", int, None, "model", "Longest sequence the position encoding supports.",
        valid_range=AT_LEAST_ONE, derived="seq_length when not set"),
    Key("pos_emb", str, "learned", "model", "Position encoding.", choices=("rotary", "learned", "none")),
    Key("rotary_pct", float, 1.0, "model", "Fraction of each head's dimensions that get rotary encoding.",
        valid_range=Range(0, 1, low_open=True)),
    Key("rotary_emb_base", int, 10000, "model", "Base of the rotary frequencies.", valid_range=AT_LEAST_ONE),
    Key("norm", str, "layernorm", "model", "Normalisation inside each layer.",
        choices=("layernorm", "layernorm_nonparam")),
    Key("final_norm", str, None, "model", "Normalisation after the last layer.",
        choices=("layernorm", "layernorm_nonparam"), derived="norm when not set"),
    Key("layernorm_epsilon", float, 1.0e-5, "model", "Epsilon of every layer norm.", valid_range=POSITIVE),
    Key("no_weight_tying", bool, False, "model",
        "Use a separate output matrix instead of the transposed input embedding."),
    Key("norm_activation_type", str, "l2_norm_gelu", "model",
        "Score normalisation of Pattention: Theta in Theta(tau * X * K^T).",
        choices=("l2_norm_gelu", "gelu_l2_norm", "softmax"), pattention=True),
    Key("pattention_tau", float, 1.0, "model",
        "Factor on the Pattention scores X * K^T before Theta. Not the paper's tau: there tau is the sqrt(n) "
        "factor, which l2_norm_gelu and gelu_l2_norm apply themselves; this key has no effect under "
        "l2_norm_gelu (the L2 normalisation cancels it) and the official layout cannot hold a value other than "
        "1 (export refuses it).", valid_range=POSITIVE, pattention=True),
    Key("pattention_impl", str, "auto", "model",
        "How every Pattention is computed (the same function and gradients, different memory and time; "
        "docs/performance.md): auto takes fused unless the memory model says a training step of the configured "
        "micro-batch would not fit the device with it, and flash then (the run's first lines say which and why; "
        "inference and conversion take fused); flash keeps its input and O(tokens) statistics for backward, "
        "visiting the input rows in blocks at the cost of recomputing the scores; fused keeps one [tokens, n] "
        "score matrix per Pattention and is faster where "
        "memory does not limit the batch (on a CPU, always); plain is the "
        "reference formula under autograd (about three score matrices).",
        choices=("auto", "plain", "fused", "flash"), pattention=True),
    Key("flash_backend", str, "auto", "model",
        "How Θ runs: triton runs Θ in Triton kernels on flash's blocks of scores and on fused's score matrix; "
        "pytorch runs them in PyTorch; kernels is triton, with pattention_impl=flash's l2 Θ as whole-Pattention "
        "Triton kernels that keep no score tile in device memory (they recompute the scores: a 4-layer 1-5B step ran "
        "44x slower than fused on an H200, where flash's blocks ran 1.8x slower on an H100; auto never picks them). "
        "auto: triton on CUDA, pytorch otherwise; triton and kernels also run on a CPU, under Triton's "
        "interpreter (slow, for testing the kernels).",
        choices=("auto", "pytorch", "triton", "kernels"), pattention=True),
    Key("init_method", str, "normal", "model", "Initialisation of every weight except layer outputs.",
        choices=_INIT_METHODS),
    Key("output_layer_init_method", str, "scaled_normal", "model",
        "Initialisation of the weights writing into the residual stream.",
        choices=_INIT_METHODS),
    Key("init_method_std", float, 0.02, "model", "Standard deviation of the normal initialisations.",
        valid_range=POSITIVE),
    Key("make_vocab_size_divisible_by", int, 128, "model",
        "Pad the vocabulary to a multiple of this (times model_parallel_size).",
        valid_range=AT_LEAST_ONE),
    Key("padded_vocab_size", int, None, "model", "Vocabulary size after padding.",
        valid_range=AT_LEAST_ONE, derived="set by the tokenizer when a run starts; leave unset"),
    Key("hidden_dropout", float, 0.0, "model", "Dropout on each layer's output.", valid_range=PROBABILITY),
    Key("attention_dropout", float, 0.0, "model", "Dropout on the attention probabilities.", valid_range=PROBABILITY),
    Key("attention_config", list, None, "model",
        "Per-layer attention types (GPT-NeoX); only 'tokenformer' is accepted.",
        inactive="every layer is a TokenFormer layer, so the list only has to agree with num_layers"),
    Key("gpt_j_residual", bool, False, "model", "GPT-J parallel residual.",
        inactive="layers always use the sequential residual x + attn(ln(x)), then x + ffn(ln(x))"),
    Key("use_bias_in_attn_linear", bool, True, "model", "Biases in the attention linear layers.",
        inactive="TokenFormer replaces those linear layers with Pattention, which has no bias"),
    Key("output_layer_parallelism", str, "column", "model",
        "How the output layer is split across model-parallel ranks.",
        choices=("column",), inactive="the output layer is always split over the vocabulary"),
    Key("scaled_upper_triang_masked_softmax_fusion", bool, False, "model", "Fused causal softmax kernel.",
        inactive=_NO_FUSED_KERNELS),
    Key("scaled_masked_softmax_fusion", bool, False, "model", "Fused masked softmax kernel.",
        inactive=_NO_FUSED_KERNELS),
    Key("bias_gelu_fusion", bool, False, "model", "Fused bias + GeLU kernel.", inactive=_NO_FUSED_KERNELS),
    Key("bias_dropout_fusion", bool, False, "model", "Fused bias + dropout kernel.", inactive=_NO_FUSED_KERNELS),
    Key("rope_fusion", bool, False, "model", "Fused rotary embedding kernel.", inactive=_NO_FUSED_KERNELS),
    Key("layernorm_fusion", bool, False, "model", "Fused layer norm kernel.", inactive=_NO_FUSED_KERNELS),
)

_OPTIMIZER = (
    Key("optimizer", dict, None, "optimizer", "{type: Adam|AdamW, params: {lr, betas, eps}}.", required=True),
    Key("lr", float, None, "optimizer", "Peak learning rate.", valid_range=POSITIVE, derived="optimizer.params.lr"),
    Key("min_lr", float, 0.0, "optimizer", "Floor of the decayed learning rate; must not exceed lr.",
        valid_range=NON_NEGATIVE),
    Key("lr_decay_style", str, "linear", "optimizer", "Learning-rate decay after warmup.",
        choices=("constant", "linear", "cosine")),
    Key("lr_decay_iters", int, None, "optimizer", "Iterations over which the learning rate decays.",
        valid_range=AT_LEAST_ONE, derived="train_iters when not set"),
    Key("warmup", float, 0.01, "optimizer", "Warmup length as a fraction of lr_decay_iters.", valid_range=FRACTION),
    Key("weight_decay", float, 0.1, "optimizer", "Decoupled weight decay coefficient.", valid_range=NON_NEGATIVE),
    Key("gradient_clipping", float, 1.0, "optimizer", "Clip the global gradient norm to this; 0 disables.",
        valid_range=NON_NEGATIVE),
    Key("zero_optimization", dict, None, "optimizer", "DeepSpeed ZeRO section, passed to DeepSpeed as is."),
    Key("fp16", dict, None, "optimizer", "DeepSpeed fp16 section ({enabled: true, loss_scale: 0, ...})."),
    Key("bf16", dict, None, "optimizer", "DeepSpeed bf16 section ({enabled: true})."),
    Key("precision", str, None, "optimizer", "Training precision.",
        choices=("fp32", "fp16", "bfloat16"), derived="fp16 or bfloat16 from the enabled fp16/bf16 section, else fp32"),
)

_TRAINING = (
    Key("train_batch_size", int, None, "training", "Samples per optimizer step over all data-parallel ranks.",
        valid_range=AT_LEAST_ONE, derived="micro batch * accumulation steps * data-parallel size"),
    Key("train_micro_batch_size_per_gpu", int, None, "training", "Samples per forward/backward pass on one rank.",
        valid_range=AT_LEAST_ONE, derived="train_batch_size / (accumulation steps * data-parallel size)"),
    Key("gradient_accumulation_steps", int, None, "training", "Micro batches accumulated per optimizer step.",
        valid_range=AT_LEAST_ONE, derived="train_batch_size / (micro batch * data-parallel size), or 1"),
    Key("train_iters", int, None, "training", "Optimizer steps to train for.", valid_range=AT_LEAST_ONE, required=True),
    Key("eval_interval", int, 1000, "training", "Evaluate on the validation split every this many steps.",
        valid_range=AT_LEAST_ONE),
    Key("eval_iters", int, 100, "training", "Batches per evaluation.", valid_range=NON_NEGATIVE),
    Key("eval_only", bool, False, "training", "Evaluate the checkpoint in `load` on the validation split and exit."),
    Key("eval_at_start", bool, False, "training",
        "Evaluate on the validation split before the first training step, at the loaded iteration: a grown "
        "checkpoint scored in the launch that trains it (tools/progressive_scaling.py sets it after a growth). "
        "Not a GPT-NeoX key."),
    Key("seed", int, 1234, "training", "Seed for Python, NumPy and PyTorch.", valid_range=NON_NEGATIVE),
    Key("deterministic", bool, False, "training",
        "Deterministic kernels only (torch.use_deterministic_algorithms, a fixed cuBLAS workspace): two runs of "
        "one config then give bitwise-equal losses on a GPU, as on a CPU; an op with no deterministic kernel stops "
        "the run naming it. Slower; Megatron's --deterministic-mode."),
    Key("checkpoint_activations", bool, False, "training",
        "Recompute layer activations in the backward pass to save memory."),
    Key("checkpoint_num_layers", int, 1, "training", "Layers per activation-checkpointed chunk.",
        valid_range=AT_LEAST_ONE),
    Key("compile", dict, None, "training",
        "torch.compile each TokenFormer layer (torchtitan's `compile` section): {enable: true, backend: inductor, "
        "components: [model]}; enable defaults to false, backend to inductor, components to [model] (the "
        "layers; the loss is a hand-written kernel, not compiled). Compiling fuses each Pattention's Θ and norms "
        "with the surrounding element-wise work; the first steps pay the compilation (minutes on a CPU, the "
        "layers of one run share it), a grown layer recompiles. Works with tensor and pipeline parallelism and "
        "activation checkpointing (megatron/model/compile.py)."),
    Key("lean_step", bool, True, "training",
        "With at most one pipeline stage, at any data-parallel size, in fp32, bf16 or fp16 (DeepSpeed's loss "
        "scaler) with ZeRO stage 1 (or stage 0 in fp32), run the training step on DeepSpeed's model, fp32 masters "
        "and optimizer state without its per-step machinery: the gradients accumulated in one flat buffer and "
        "all-reduced in DeepSpeed's buckets (reduce_bucket_size) as backward finishes each, the norm of the rank's "
        "partition and clipping as multi-tensor operations in fp32 on the device, fused AdamW on the rank's "
        "partition, DeepSpeed's all-gather, no one-stage pipeline schedule, one read of the loss and norm a step "
        "(megatron/training/lean_step.py). The same update and checkpoint files as DeepSpeed's step (the clipping "
        "factor can differ in its last bits: DeepSpeed accumulates the norm in float64); any other layout or "
        "precision, or a device without torch's fused AdamW (hpu, npu, mlu), takes DeepSpeed's step. false: "
        "always DeepSpeed's step."),
    Key("partition_activations", bool, False, "training", "Split checkpointed activations across model-parallel ranks.",
        inactive="activation partitioning across model-parallel ranks is not implemented"),
    Key("synchronize_each_layer", bool, False, "training", "Device synchronisation around each checkpointed layer.",
        inactive="per-layer device synchronisation is not implemented"),
    Key("adlr_autoresume", bool, False, "training", "NVIDIA ADLR cluster auto-resume.",
        inactive="ADLR auto-resume is not supported; resume by pointing `load` at the checkpoints"),
    Key("exit_signal_handler", bool, True, "training",
        "On one of exit_signals, every rank saves a checkpoint at the next iteration boundary and the run exits 0 "
        "(Megatron's exit signal handling; docs/reliability.md)."),
    Key("exit_signals", list, ["SIGTERM", "SIGUSR1"], "training",
        "Signals exit_signal_handler acts on. SLURM sends SIGTERM at preemption and the time limit, and SIGUSR1 "
        "ahead of time with --signal=USR1@SECONDS.", item=str),
    Key("hang_timeout", float, 600.0, "training",
        "Seconds a rank may go without finishing a training step before the job is ended as hung "
        "(runtime/hang_watch.py): every rank's Python stack goes to log_dir/hangs, one line names the ranks that "
        "did not arrive, and the job exits 124. Evaluation, checkpoint saves and the first step (compilation) are "
        "not timed, but a rank whose heartbeat stops for this long ends the job during them too; the start keeps "
        "torch's 30-minute rendezvous timeout. 600 s covers a slow step and the skew between ranks leaving a 1.5B "
        "save, against 30 minutes of idling; 0 turns the watch off. cluster_check.py: a rank that does not come "
        "back from a section this long after another did, or whose heartbeat stops this long, fails the section "
        "and ends the check.",
        valid_range=NON_NEGATIVE),
    Key("exit_interval", int, None, "training",
        "Save a checkpoint and exit 0 after an iteration divisible by this.", valid_range=AT_LEAST_ONE),
    Key("exit_duration_in_mins", float, None, "training",
        "Save a checkpoint and exit 0 at the first iteration boundary after this many minutes of training.",
        valid_range=POSITIVE),
    Key("max_skipped_steps", int, 10, "training",
        "Stop the run after this many steps in a row with a non-finite loss or gradient norm (each such step is "
        "skipped, never applied). fp16 runs leave the stop to DeepSpeed's loss scaler.", valid_range=AT_LEAST_ONE),
    Key("freeze_old_param_tokens", bool, False, "training",
        "After growth, train only the parameter tokens growth appended: every Pattention's tokens from before "
        "growth (the growth.json of the checkpoint in `load`, or pretrain_partial_init's slot counts) get no "
        "update from gradients, weight decay or momentum. Embeddings and norms still train."),
    Key("norm_token_count_ramp_iters", int, 0, "training",
        "After a growth that kept the old n of sqrt(n) (growth_norm_token_count old, preserve's default): move each "
        "Pattention's n linearly from the count the grown checkpoint holds to its token count over this many "
        "iterations from the growth's (its growth.json), so the run starts with the source's function exactly and "
        "ends normalised as a model of its size from scratch. 0: n stays as grown. docs/growth.md.",
        valid_range=NON_NEGATIVE),
)

_DATA = (
    Key("data_path", str, None, "data", "Prefix of one PREFIX.bin/PREFIX.idx dataset, split by `split`."),
    Key("train_data_paths", list, None, "data", "Prefixes of training datasets (instead of data_path).", item=str),
    Key("valid_data_paths", list, None, "data", "Prefixes of validation datasets.", item=str),
    Key("test_data_paths", list, None, "data", "Prefixes of test datasets.", item=str),
    Key("train_data_weights", list, None, "data",
        "Sampling weight of each train_data_paths entry; unset weighs each by its token count.", item=float),
    Key("valid_data_weights", list, None, "data",
        "Sampling weight of each valid_data_paths entry; unset weighs each by its token count.", item=float),
    Key("test_data_weights", list, None, "data",
        "Sampling weight of each test_data_paths entry; unset weighs each by its token count.", item=float),
    Key("data_impl", str, "mmap", "data", "Indexed dataset format.", choices=("mmap",)),
    Key("split", str, "969, 30, 1", "data", "Train, validation, test proportions of data_path, e.g. '969, 30, 1'."),
    Key("tokenizer_type", str, "GPT2BPETokenizer", "data", "Tokenizer implementation.",
        choices=("HFTokenizer", "GPT2BPETokenizer", "CharLevelTokenizer", "SPMTokenizer")),
    Key("vocab_file", str, None, "data",
        "Tokenizer file: tokenizer.json (HF), vocab.json (GPT-2 BPE) or SentencePiece model."),
    Key("merge_file", str, None, "data", "BPE merges file (GPT2BPETokenizer only)."),
    Key("num_workers", int, 2, "data", "Data loader worker processes.",
        valid_range=NON_NEGATIVE, inactive="batches are read from memory-mapped files in the training process"),
)

_CHECKPOINT = (
    Key("save", str, None, "checkpoint", "Directory checkpoints are written to."),
    Key("load", str, None, "checkpoint", "Directory to resume from (or to evaluate with eval_only)."),
    Key("reshard_on_resume", bool, True, "checkpoint",
        "Resume a checkpoint saved on another model_parallel_size, pipe_parallel_size or data-parallel size: "
        "deepy.py writes it re-sharded into this run's layout beside it (global_stepN-tp1pp1dp4, the original "
        "untouched; reused by the next resume on that layout) and keeps its global batch "
        "(docs/cluster.md, \"When your allocation changes\"). false: such a resume is refused."),
    Key("checkpoint_factor", int, None, "checkpoint", "Save a checkpoint every this many steps.",
        valid_range=AT_LEAST_ONE),
    Key("extra_save_iters", list, None, "checkpoint", "Additional steps at which to save a checkpoint.", item=int),
    Key("keep_last_n_checkpoints", int, None, "checkpoint",
        "Delete older checkpoints beyond this many; unset keeps all.",
        valid_range=AT_LEAST_ONE),
    Key("pretrain_partial_init", str, None, "checkpoint",
        "Checkpoint (a `save` directory) of a smaller model to grow from when `load` holds no checkpoint: its "
        "parameter tokens are grown to this config's slot counts in memory, as tools/grow_checkpoint.py grows "
        "them (docs/growth.md). Weights and Adam moments carry over; iteration, data position and LR schedule "
        "start at 0, a new stage as in the official TokenFormer code. How new tokens are made: growth_mode."),
    Key("pretrain_partial_init_reset_optimizer", bool, False, "checkpoint",
        "With pretrain_partial_init: start the optimizer afresh (no Adam moments, step 0) instead of carrying "
        "the smaller model's state over (tools/grow_checkpoint.py --reset-optimizer), whether or not anything "
        "grows. Implied by growth_mode official (where something grows) unless growth_optimizer is carry; the "
        "same as growth_optimizer: reset."),
    Key("growth_mode", str, "official", "checkpoint",
        "How growth (pretrain_partial_init, tools/grow_checkpoint.py) makes new parameter tokens. official: as "
        "the official TokenFormer code (custom_load_fn_incremental): the old rows copied into a freshly "
        "initialised larger model, so new keys and values come from the init and sqrt(n) is the new count (the "
        "function changes), a fresh optimizer and iteration 0; softmax can grow. preserve: zero keys, values "
        "from the init, and sqrt(n) kept at the old token count, so the grown model computes the same function; "
        "Adam state carried over. growth_optimizer and growth_norm_token_count change one of these at a time. "
        "docs/growth.md compares the modes.", choices=("preserve", "official")),
    Key("growth_optimizer", str, None, "checkpoint",
        "What growth does with Adam's state: carry (the old tokens' moments and the step count kept, the new "
        "tokens' moments zero) or reset (a fresh optimizer). Unset: the growth mode's (preserve carries, official "
        "resets); pretrain_partial_init_reset_optimizer: true means reset. Where nothing grows (a same-size "
        "pretrain_partial_init, a re-shard by tools/grow_checkpoint.py) only an explicit reset applies.",
        choices=("carry", "reset")),
    Key("growth_norm_token_count", str, None, "checkpoint",
        "The n of Θ's sqrt(n) after growth: old (the source's, which keeps the function of the l2 variants) or new "
        "(the grown token count, as a model of that size from scratch: the function changes). Unset: the growth "
        "mode's (preserve old, official new).", choices=("old", "new")),
    Key("growth_schedule", list, None, "checkpoint",
        "Grow the parameter tokens inside the running job: a list of {iteration, qkv_slot_num, proj_slot_num, "
        "ffn_slot_num} (counts left out stay as they were). After each listed iteration the run saves a checkpoint "
        "of the model before growth, grows every rank's shards as tools/grow_checkpoint.py grows a checkpoint "
        "(growth_mode, growth_optimizer and growth_norm_token_count as for the tool), rebuilds the engine and goes "
        "on with the same data, iteration count and LR schedule; a resume builds the model grown as listed before "
        "its iteration. The config's own slot counts are the model the run starts with. docs/growth.md.",
        item=dict),
    Key("eval_ckpt", str, None, "checkpoint",
        "Weights file generate.py and eval.py load instead of `load`: the official release's pytorch_model.bin "
        "or an export (model.safetensors, pytorch_model.bin; docs/inference.md)."),
    Key("checkpoint_validation_with_forward_pass", bool, False, "checkpoint",
        "Re-run a forward pass to check a loaded checkpoint.",
        inactive="not implemented"),
)

_LOGGING = (
    Key("log_dir", str, None, "logging", "Directory for text logs."),
    Key("log_interval", int, 100, "logging", "Log training metrics every this many steps.", valid_range=AT_LEAST_ONE),
    Key("steps_per_print", int, 10, "logging", "DeepSpeed prints its progress every this many steps.",
        valid_range=AT_LEAST_ONE,
        inactive="DeepSpeed's own progress prints are off; metrics are logged every log_interval"),
    Key("peak_tflops", float, None, "logging",
        "Dense bf16/fp16 peak TFLOP/s of one device, for the MFU in the training log. Unset: the table of "
        "megatron/training/utilization.py by GPU name (A100, H100 SXM/PCIe/NVL, H200, B200; the dense figure, "
        "half the data sheet's sparse one); on a CPU, or a GPU not in the table, no MFU is logged.",
        valid_range=POSITIVE),
    Key("tensorboard_dir", str, None, "logging", "Write TensorBoard events here; unset disables TensorBoard."),
    Key("use_wandb", bool, False, "logging", "Log to Weights & Biases (off by default: runs are often offline)."),
    Key("wandb_project", str, "neox", "logging", "Weights & Biases project."),
    Key("wandb_group", str, None, "logging", "Weights & Biases run group."),
    Key("wandb_team", str, None, "logging", "Weights & Biases team (entity)."),
    Key("wandb_host", str, "https://api.wandb.ai", "logging", "Weights & Biases server.",
        inactive="wandb takes its server from its own login settings (WANDB_BASE_URL)"),
    Key("wall_clock_breakdown", bool, False, "logging", "DeepSpeed forward/backward/step timings.",
        inactive="per-phase timings are not reported; log_interval reports step time"),
)

_PARALLELISM = (
    Key("model_parallel_size", int, 1, "parallelism",
        "Tensor (model) parallel ranks per model replica; must divide num_attention_heads and every slot count, "
        "and times pipe_parallel_size divide the number of processes (docs/tensor_parallel.md).",
        valid_range=AT_LEAST_ONE),
    Key("pipe_parallel_size", int, 0, "parallelism",
        "Pipeline stages: 0 trains the plain model, 1 or more runs DeepSpeed's pipeline engine with that many "
        "stages (ZeRO stage 0 or 1; docs/parallelism.md).",
        valid_range=NON_NEGATIVE),
    Key("pipe_partition_method", str, "type:transformer|mlp", "parallelism",
        "How layers are divided among pipeline stages: 'parameters' (balance parameter counts), 'uniform' "
        "(balance layer counts) or 'type:REGEX' (balance the layers whose class name matches REGEX; the "
        "TokenFormer blocks are TransformerLayerPipe)."),
    Key("distributed_backend", str, "nccl", "parallelism", "torch.distributed backend; CPU runs use gloo.",
        choices=("nccl", "gloo")),
    Key("world_size", int, None, "parallelism", "Total number of processes.",
        valid_range=AT_LEAST_ONE, derived="given by the launcher when the config is resolved"),
)

_LAUNCHER = (
    Key("num_gpus", int, None, "launcher", "Processes per node (GPUs per node; on CPU the number of local processes).",
        valid_range=AT_LEAST_ONE),
    Key("num_nodes", int, -1, "launcher", "Nodes to use from the hostfile; -1 uses all.", valid_range=Range(-1)),
    Key("hostfile", str, None, "launcher", "File listing 'host slots=N' lines."),
    Key("include", str, None, "launcher", "Hosts/slots to use, e.g. 'worker-0@worker-1:0,2'."),
    Key("exclude", str, None, "launcher", "Hosts/slots to leave out, same format as include."),
    Key("master_addr", str, None, "launcher", "Address of rank 0; inferred when unset."),
    Key("master_port", int, None, "launcher",
        "Port of rank 0. Unset: a free port on a launch from this machine (chosen by deepy.py, below the "
        f"kernel's range for outgoing connections), GPT-NeoX's {GPT_NEOX_PORT} otherwise.",
        valid_range=Range(1, 65535)),
    Key("launcher", str, "pdsh", "launcher", "Multi-node launcher.", choices=("pdsh", "slurm", "openmpi", "mpich")),
    Key("deepspeed_slurm", bool, False, "launcher", "Read ranks and addresses from the SLURM environment."),
    Key("no_ssh_check", bool, False, "launcher", "Skip the ssh reachability check of the head node."),
    Key("comment", str, None, "launcher", "Passed to the launcher as --comment (some clusters require it)."),
    Key("max_restarts", int, 0, "launcher",
        "Times a failed training job starts again inside the job (the same allocation under SLURM): when a rank "
        "fails (exits non-zero: an error, a kill, a hang the run ends), deepy.py ends every rank and starts them "
        "all again from the latest checkpoint in load, which must be save's directory. Each restart is said in "
        "the log (which rank, how, from which checkpoint) and recorded in metrics.jsonl (split: restart); a stop "
        "you asked for (SIGTERM, Ctrl-C, SIGUSR1) is never restarted. 0: a failure ends the job "
        "(docs/reliability.md).", valid_range=NON_NEGATIVE),
    Key("user_script", str, None, "launcher", "Script each rank runs.", derived="set by the launcher"),
    Key("launch_id", str, None, "launcher",
        "This launch's identity, which every rank checks at the rendezvous: a rank that reached another run's "
        "master_port stops instead of joining it.", derived="set by deepy.py"),
    Key("config_files", dict, None, "launcher", "Text of each config file, keyed by path, kept with checkpoints.",
        derived="set by load_config", item=str),
)

# generate.py and eval.py (docs/inference.md); GPT-NeoX's names and defaults except where noted.
_INFERENCE = (
    Key("text_gen_type", str, "unconditional", "inference",
        "What generate.py samples from: nothing (unconditional), each prompt of sample_input_file (input-file), "
        "or prompts typed on standard input (interactive).",
        choices=("unconditional", "input-file", "interactive")),
    Key("maximum_tokens", int, 64, "inference", "Most tokens generated per sample.", valid_range=AT_LEAST_ONE),
    Key("prompt_end", str, "\n", "inference", "Separator of the prompts in sample_input_file."),
    Key("temperature", float, 0.0, "inference",
        "Sampling temperature; with top_k and top_p all 0, generation is greedy.", valid_range=NON_NEGATIVE),
    Key("top_k", int, 0, "inference", "Sample from the k most likely tokens only; 0 disables.",
        valid_range=NON_NEGATIVE),
    Key("top_p", float, 0.0, "inference", "Sample from the smallest set of tokens whose probability reaches p; "
        "0 disables.", valid_range=FRACTION),
    Key("num_samples", int, 1, "inference", "Samples generated in unconditional mode.", valid_range=AT_LEAST_ONE),
    Key("recompute", bool, False, "inference",
        "Recompute the whole sequence at every step instead of using the KV cache (same tokens, slower)."),
    Key("sample_input_file", str, None, "inference", "Prompts for text_gen_type input-file, separated by prompt_end."),
    Key("sample_output_file", str, "samples.jsonl", "inference",
        "Where generate.py writes one JSON object per sample (GPT-NeoX's default is samples.txt)."),
    Key("eval_tasks", list, None, "inference", "lm-eval task names eval.py scores, e.g. [lambada_openai, piqa].",
        item=str),
    Key("eval_include_path", str, None, "inference",
        "Directory of extra lm-eval task YAML files, e.g. tasks reading local copies of their datasets "
        "(not a GPT-NeoX key)."),
    Key("eval_results_prefix", str, "", "inference",
        "eval.py writes PREFIX_eval_results.json (eval_results.json when empty)."),
)

# cluster_check.py's sections, in the order they run (docs/cluster.md).
CLUSTER_CHECK_SECTIONS = ("environment", "collectives", "numerics", "golden", "throughput")

_CLUSTER_CHECK = (
    Key("cluster_check_sections", list, list(CLUSTER_CHECK_SECTIONS), "cluster check",
        "The sections cluster_check.py runs (always in the order of the default), e.g. [collectives] to measure "
        "the network again; docs/cluster.md.", item=str),
    Key("cluster_check_golden", str, None, "cluster check",
        "A golden loss curve file (python -m megatron.cluster_check.golden --write FILE) that cluster_check.py's "
        "golden section reproduces on every device; unset: the repository's curve, made on a CPU."),
    Key("cluster_check_busbw_floor", float, None, "cluster check",
        "Least bus bandwidth (GB/s, nccl-tests' busbw) cluster_check.py accepts for every collective and group it "
        "measures, at its largest message size; unset: no floor.", valid_range=POSITIVE),
    Key("cluster_check_mfu_floor", float, 0.1, "cluster check",
        "Least model FLOP utilization (MFU) the throughput section accepts: its tokens/s against what the FLOP model "
        "gives at the device's peak (peak_tflops, or the table's figure for known GPUs). The default is a quarter or "
        "less of what GPU reports of this framework measured at the 1-5B width (26-40.5 % on an H200), so a device "
        "below it is throttled, faulty or misconfigured rather than held back by the model's shape; 0: no "
        "floor. CPU processes, and devices without a known peak, are reported only.", valid_range=FRACTION),
)

SCHEMA: dict[str, Key] = {
    key.name: key
    for key in _MODEL + _OPTIMIZER + _TRAINING + _DATA + _CHECKPOINT + _LOGGING + _PARALLELISM + _LAUNCHER
    + _INFERENCE + _CLUSTER_CHECK
}
PATTENTION_KEYS = tuple(name for name, key in SCHEMA.items() if key.pattention)
TOKEN_COUNT_KEYS = tuple(name for name, key in SCHEMA.items() if key.token_count)


def defaults() -> dict[str, Any]:
    """A fresh mapping of every key to its default."""
    return {name: key.default for name, key in SCHEMA.items()}
