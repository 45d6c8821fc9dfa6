"""The growth plan: how many parameter tokens each kind of Pattention has before and after, checked first.

Growth (TokenFormer §3.3) appends parameter tokens to Pattention layers; re-sharding cuts the model into
another tensor/pipeline layout; one run of the tool may do both. Neither can change anything else that
shapes the weights or defines the function the model computes, so the source checkpoint's config and the
target config must agree on every such key. Every problem (a differing key, an unannounced shrink, a
token count the target's tensor ranks cannot split, function-preserving growth under softmax) is reported in
one ConfigError before any tensor is read.

Two modes make the new tokens (grow.py, docs/growth.md): `preserve` keeps the function the model computes,
`official` does what the official TokenFormer code does. They differ in three things, each of which can be set
on its own: the new keys (zero or from the init: the mode), the n of Θ's √n (`growth_norm_token_count`: old or
new) and Adam's state (`growth_optimizer`: carry or reset). They apply where a Pattention grows: a plan that
grows nothing (a re-shard, a shrink, weights loaded as they are) keeps the n of √n, Adam's state and the
iteration in every mode, unless a reset is asked for explicitly (growth_optimizer: reset,
pretrain_partial_init_reset_optimizer: true, the tool's --reset-optimizer).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property

from megatron.checkpoint.growth_record import FORMAT as RECORD_FORMAT
from megatron.config import Config, ConfigError
from megatron.config.validate import raise_if_any
from megatron.model import TokenFormerArgs, TokenFormerModel
from megatron.model.args import ARCHITECTURE_KEYS, GROWTH_MODES
from megatron.model.init_methods import parameter_roles
from megatron.model.init_roles import InitRole
from megatron.model.spec import pattention_entry as spec_entry
from megatron.model.spec import slot_keys
from megatron.mpu import full_shape
from megatron.tokenizer import build_tokenizer, pad_vocab_size

NORM_TOKEN_COUNTS = ("old", "new")
OPTIMIZER_CHOICES = ("carry", "reset")
MODE_DEFAULTS = {"preserve": {"norm": "old", "optimizer": "carry"}, "official": {"norm": "new", "optimizer": "reset"}}

SOFTMAX_GROWTH = (
    "norm_activation_type softmax cannot grow: a new parameter token with a zero key scores 0 for every "
    "input, and softmax gives it weight exp(0) in the normaliser, so it takes probability mass from the old "
    "tokens and the grown model computes another function (no key is zero for every input, so no choice of "
    "new keys avoids it). The l2 variants (l2_norm_gelu, gelu_l2_norm) grow exactly: a zero score adds 0 to "
    "the L2 norm and GeLU(0) = 0. Keep the slot counts to re-shard only, or grow as the official code does "
    "(growth_mode official: new keys from the init, the function changes)"
)


def padded_vocabulary(config: Config) -> int:
    """The embedding's row count: the config's `padded_vocab_size` when a run has set it (a checkpoint's
    config.json), else the tokenizer's vocabulary padded for the config's model_parallel_size, as a run pads it."""
    if config.padded_vocab_size is not None:
        return config.padded_vocab_size
    tokenizer = build_tokenizer(config.tokenizer_type, config.vocab_file, config.merge_file)
    return pad_vocab_size(tokenizer.vocab_size, config.make_vocab_size_divisible_by, config.model_parallel_size)


def pattention_entry(name: str) -> tuple[str, str] | None:
    """(slot key, leaf) of a Pattention's state-dict entry, e.g. ("ffn_slot_num", "key_param_tokens") for
    layers.3.mlp.key_param_tokens (the Pattentions: model/spec.py); None for every other entry."""
    entry = spec_entry(name)
    return None if entry is None else (entry[0].slot_key, entry[1])


@dataclass(frozen=True)
class GrowthPlan:
    """Old and new token counts, the target config (new slot counts, padded vocabulary set) and what the
    target model's entries look like: full shapes (as one rank holds them with tensor parallelism 1) and
    init roles, for the new value tokens' initialisation."""

    source: Config
    target: Config
    old_tokens: dict[str, int]
    new_tokens: dict[str, int]
    target_shapes: dict[str, tuple[int, ...]]
    roles: dict[str, InitRole]
    zero_new_values: bool
    mode: str  # GROWTH_MODES
    norm: str  # the n of √n after growth: the source's (old) or the grown count (new)
    optimizer: str  # Adam's state: carried over (new rows zero) or reset

    @property
    def resets_optimizer(self) -> bool:
        return self.optimizer == "reset"

    @property
    def resets_iteration(self) -> bool:
        """Official growth starts a new run at iteration 0, as the official code does; nothing else does."""
        return self.mode == "official" and self.grows

    @property
    def keeps_function(self) -> bool:
        """Zero new keys and the old n (the l2 variants compute what the source computed), or nothing grown."""
        return (self.mode == "preserve" and self.norm == "old") or not (self.grows or self.shrinks)

    def describe(self) -> str:
        """'preserve' or 'official', with what differs from the mode, e.g. 'preserve, √n of the new count'; for a
        plan that grows nothing, that no mode applies."""
        if not self.grows:
            return "none applies (nothing grows)"
        defaults, changed = MODE_DEFAULTS[self.mode], [self.mode]
        if self.norm != defaults["norm"]:
            changed.append(f"√n of the {self.norm} count")
        if self.optimizer != defaults["optimizer"]:
            changed.append("optimizer reset" if self.resets_optimizer else "optimizer carried over")
        return ", ".join(changed)

    @cached_property
    def model_args(self) -> TokenFormerArgs:
        return TokenFormerArgs.from_config(self.target)

    @property
    def grows(self) -> bool:
        return any(self.new_tokens[key] > self.old_tokens[key] for key in slot_keys())

    @property
    def shrinks(self) -> bool:
        return any(self.new_tokens[key] < self.old_tokens[key] for key in slot_keys())

    def source_shape(self, name: str) -> tuple[int, ...]:
        """The shape the source checkpoint's config gives entry `name`."""
        shape = self.target_shapes[name]
        entry = pattention_entry(name)
        if entry is None or entry[1] == "norm_token_count":
            return shape
        return (self.old_tokens[entry[0]], *shape[1:])

    def growth_record(self, source_record: dict | None) -> dict | None:
        """The grown checkpoint's growth.json (checkpoint/growth_record.py): each kind's token count before this
        growth (all of its tokens where it did not grow, those of an earlier growth where the source was grown
        before); None when neither grew. `frozen` describes the source run's optimizer state, not the output's:
        dropped."""
        earlier = (source_record or {}).get("grown_from", {})
        grew = [key for key in slot_keys() if self.new_tokens[key] > self.old_tokens[key]]
        if not grew and not earlier:
            return None
        grown_from = {key: self.old_tokens[key] if key in grew else
                      min(earlier.get(key, self.old_tokens[key]), self.new_tokens[key]) for key in slot_keys()}
        kept = {key: value for key, value in (source_record or {}).items() if key != "frozen"}
        return {**kept, "format": RECORD_FORMAT, "grown_from": grown_from}

    def summary(self) -> list[str]:
        """One line per slot key, e.g. 'ffn_slot_num 256 -> 512'."""
        return [f"{key} {self.old_tokens[key]} -> {self.new_tokens[key]}" for key in slot_keys()]


def _fixed_keys(source: Config) -> list[str]:
    keys = [key for key in ARCHITECTURE_KEYS if key not in slot_keys()]
    return keys + (["max_position_embeddings"] if source.pos_emb == "learned" else [])


def _differences(source: Config, target: Config, source_vocab: int, target_vocab: int) -> list[str]:
    different = [f"{key} (source {getattr(source, key)!r}, target {getattr(target, key)!r})"
                 for key in _fixed_keys(source) if getattr(source, key) != getattr(target, key)]
    if source_vocab != target_vocab:
        different.append(
            f"padded vocabulary (source {source_vocab}, target {target_vocab} = the tokenizer's vocabulary "
            f"rounded up to a multiple of make_vocab_size_divisible_by {target.make_vocab_size_divisible_by} × "
            f"model_parallel_size {target.model_parallel_size}; choose a make_vocab_size_divisible_by that "
            f"keeps it {source_vocab}, and the source's tokenizer)")
    if not different:
        return []
    return ["the target config differs from the source checkpoint's in what growth cannot change: "
            + "; ".join(different) + f". Only {', '.join(slot_keys())} and the parallel layout may change: set the "
            "other keys as in the source's config.json"]


def _token_count_problems(old: Mapping[str, int], new: Mapping[str, int], target: Config, allow_shrink: bool,
                          mode: str) -> list[str]:
    problems = []
    tp = target.model_parallel_size
    for key in slot_keys():
        if new[key] < old[key] and not allow_shrink:
            problems.append(f"{key} {old[key]} -> {new[key]} shrinks the model; pass --allow-shrink to drop the "
                            f"last {old[key] - new[key]} tokens of each such Pattention (lossy: the model changes)")
        if new[key] % tp:
            lower, higher = new[key] // tp * tp, -(-new[key] // tp) * tp
            choices = f"{lower} or {higher}" if lower else f"{higher}"
            problems.append(f"{key} {new[key]} is not divisible by the target's model_parallel_size {tp}, which "
                            f"splits each Pattention's tokens evenly: use a multiple of {tp}, e.g. {choices}")
    grows = any(new[key] > old[key] for key in slot_keys())
    if mode == "preserve" and target.norm_activation_type == "softmax" and grows:
        problems.append(SOFTMAX_GROWTH)
    return problems


def _mode_problems(mode: str, zero_new_values: bool, norm: str, optimizer: str) -> list[str]:
    problems = [f"{what} {value!r} is not one of {', '.join(choices)}" for what, value, choices in (
        ("growth mode", mode, GROWTH_MODES), ("growth_norm_token_count", norm, NORM_TOKEN_COUNTS),
        ("growth_optimizer", optimizer, OPTIMIZER_CHOICES)) if value not in choices]
    if mode == "official" and zero_new_values:
        problems.append("zero new values do not go with growth_mode official, which draws new keys and values from "
                        "the init as the official code does: drop --zero-new-values, or grow with growth_mode preserve")
    return problems


OPTIMIZER_CONTRADICTION = ("pretrain_partial_init_reset_optimizer: true and growth_optimizer: carry contradict each "
                           "other: keep one (growth_optimizer: reset is the same as the former)")


def growth_choices(target: Config, mode: str | None = None, norm: str | None = None,
                   optimizer: str | None = None, grows: bool = True) -> tuple[str, str, str]:
    """(mode, norm, optimizer) of a growth into `target`: the arguments where given, else the target config's
    growth_mode, growth_norm_token_count and growth_optimizer (pretrain_partial_init_reset_optimizer: reset), else
    the mode's own. Where nothing `grows`, the mode's defaults do not apply: n is kept ("old") and the optimizer
    state carried unless an explicit choice (argument or config) says reset, as the schema promises. ConfigError
    where the config asks for both carry and reset."""
    mode = target.growth_mode if mode is None else mode
    if target.pretrain_partial_init_reset_optimizer and target.growth_optimizer == "carry":
        raise ConfigError(OPTIMIZER_CONTRADICTION)
    configured = "reset" if target.pretrain_partial_init_reset_optimizer else target.growth_optimizer
    if not grows:
        return mode, norm or "old", optimizer or configured or "carry"
    defaults = MODE_DEFAULTS.get(mode, MODE_DEFAULTS["preserve"])
    norm = norm or target.growth_norm_token_count or defaults["norm"]
    optimizer = optimizer or configured or defaults["optimizer"]
    return mode, norm, optimizer


def plan_growth(source: Config, target: Config, slot_overrides: Mapping[str, int | None] | None = None, *,
                allow_shrink: bool = False, zero_new_values: bool = False, mode: str | None = None,
                norm: str | None = None, optimizer: str | None = None) -> GrowthPlan:
    """The plan growing a checkpoint saved with `source` into the model `target` describes, with
    `slot_overrides` (e.g. {"ffn_slot_num": 512}; None entries ignored) taking precedence over its slot counts,
    in growth mode `mode`, with √n of the `norm` count and the optimizer state as `optimizer` says (each unset:
    growth_choices).

    Raises one ConfigError naming every problem.
    """
    dense = [f"{which} config has model_type {c.model_type}" for which, c in (("the checkpoint's", source),
                                                                           ("the target", target))
             if c.model_type != "tokenformer"]
    if dense:
        raise ConfigError(f"growth appends parameter tokens to Pattentions, but {' and '.join(dense)}, which has "
                          "none: grow a TokenFormer (model_type: tokenformer)")
    overrides = {key: value for key, value in (slot_overrides or {}).items() if value is not None}
    unknown = sorted(set(overrides) - set(slot_keys()))
    if unknown:
        raise ConfigError(f"slot overrides {unknown} are not slot counts; use {', '.join(slot_keys())}")
    raise_if_any([f"{key} {value!r} is not a parameter-token count: give a positive integer"
                  for key, value in overrides.items()
                  if isinstance(value, bool) or not isinstance(value, int) or value < 1])
    old = {key: getattr(source, key) for key in slot_keys()}
    new = {key: overrides.get(key, getattr(target, key)) for key in slot_keys()}
    source_vocab, target_vocab = padded_vocabulary(source), padded_vocabulary(target)
    grows = any(new[key] > old[key] for key in slot_keys())
    mode, norm, optimizer = growth_choices(target, mode, norm, optimizer, grows)
    raise_if_any(_mode_problems(mode, zero_new_values, norm, optimizer)
                 + _differences(source, target, source_vocab, target_vocab)
                 + _token_count_problems(old, new, target, allow_shrink, mode))
    final = Config.from_dict({**target.to_dict(), **new, "padded_vocab_size": target_vocab, "growth_mode": mode})
    model = TokenFormerModel(TokenFormerArgs.from_config(final), device="meta")
    shapes = {name: full_shape(tensor) for name, tensor in [*model.named_parameters(), *model.named_buffers()]}
    return GrowthPlan(source, final, old, new, shapes, parameter_roles(model), zero_new_values, mode, norm, optimizer)
