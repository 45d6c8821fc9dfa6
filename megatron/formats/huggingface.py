"""A TokenFormer state dict and Config <-> a Hugging Face model directory (tools/convert_to_hf.py,
tools/convert_from_hf.py). Needs no `transformers`: the directory is files written here. The dense baseline
(`model_type: transformer`) exports as transformers' own GPTNeoXForCausalLM instead (gpt_neox.py; no remote code,
and no conversion back).

    DIR/config.json                      model_type "tokenformer", every architecture field, auto_map to:
    DIR/configuration_tokenformer.py     TokenFormerConfig       (copies of megatron/hf/; torch + transformers only)
    DIR/modeling_tokenformer.py          TokenFormerForCausalLM
    DIR/model.safetensors                fp32 weights (above --max-shard-size: model-0000i-of-0000N.safetensors
                                         and model.safetensors.index.json)
    DIR/generation_config.json           end-of-document token as eos; padded vocabulary rows suppressed
    DIR/manifest.json                    size and SHA-256 of the .safetensors files, checked when read back
    DIR/tokenizer.json, tokenizer_config.json   the run's tokenizer.json (HFTokenizer), or a GPT-2 BPE or
                                         SentencePiece tokenizer converted to one (megatron/tokenizer/
                                         fast_conversion.py) when it encodes a check text as the run's does

Names: every entry of this framework's state dict gains the prefix `model.`, except `final_linear.weight`
(untied output), which is `lm_head.weight`; a tied output has no entry of its own (transformers ties
`lm_head.weight` to `model.word_embeddings.weight`). The `norm_token_count` buffers are not weights there: they
are config.json's `norm_token_counts`, one {query, key, value, proj, mlp} mapping per layer (the spec's `hf_name`s,
megatron/model/spec.py, whose slot keys and module paths config.json's `pattention_slot_keys` and
`pattention_paths` give; the remote code builds each), so a grown model keeps its √n. Converting back adds them
again, so framework -> HF -> framework gives back every tensor.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer
from torch import Tensor

from megatron.checkpoint.output_directory import require_new_or_empty
from megatron.cli import InputError
from megatron.config import Config
from megatron.formats import gpt_neox
from megatron.formats.consolidated import (
    CONFIG_NAME,
    PASS_CONFIG,
    read_config,
    read_weights,
    record_weights,
    weights_in_directory,
    write_safetensors_shards,
)
from megatron.model import TokenFormerArgs
from megatron.model.spec import layer_pattentions, slot_keys
from megatron.tokenizer import build_tokenizer
from megatron.tokenizer.fast_conversion import fast_tokenizer, verified

REMOTE_CODE = Path(__file__).resolve().parents[1] / "hf"  # the transformers code written beside the weights
CODE_FILES = ("configuration_tokenformer.py", "modeling_tokenformer.py")
MODEL_TYPE = "tokenformer"
COUNT = "norm_token_count"
# This framework's architecture keys (megatron/model/args.py ARCHITECTURE_KEYS) -> config.json's names.
HF_NAMES = {"num_layers": "num_hidden_layers", "no_weight_tying": "tie_word_embeddings"}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str) -> int:
    """Bytes of a size such as "5GB" (10⁹, as transformers counts), "500MiB" or "1000000"."""
    match = _SIZE.match(text)
    if not match or float(match.group(1)) <= 0:
        raise InputError(f"--max-shard-size {text!r} is not a size; write e.g. 5GB, 500MB, 2GiB or a byte count")
    return int(float(match.group(1)) * _UNITS[(match.group(2) or "B").upper()])


# --- names and config ---------------------------------------------------------------------------------------

def to_hf_state(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """The transformers model's weights of this framework's state dict (norm_token_count left out)."""
    return {"lm_head.weight" if name == "final_linear.weight" else f"model.{name}": tensor
            for name, tensor in state.items() if not name.endswith(f".{COUNT}")}


def token_counts(state: dict[str, Tensor], num_layers: int) -> list[dict[str, int]]:
    """config.json's norm_token_counts: each Pattention's n, layer by layer."""
    return [{spec.hf_name: int(state[f"layers.{i}.{spec.path}.{COUNT}"]) for spec in layer_pattentions()}
            for i in range(num_layers)]


def from_hf_state(hf_state: dict[str, Tensor], hf_config: dict, source: Path | str) -> dict[str, Tensor]:
    """This framework's state dict of a transformers model's weights and config.json (norm_token_count added)."""
    tied = hf_config.get("tie_word_embeddings", True)
    state, unknown = {}, []
    for name, tensor in hf_state.items():
        if name == "lm_head.weight":
            if not tied:  # a tied lm_head.weight (saved by some versions) is the embedding again
                state["final_linear.weight"] = tensor
        elif name.startswith("model."):
            state[name.removeprefix("model.")] = tensor
        else:
            unknown.append(name)
    if unknown:
        raise InputError(f"{source} holds weights that are not TokenFormerForCausalLM's: {sorted(unknown)[:5]}; "
                         "convert the model directory tools/convert_to_hf.py wrote (or one saved from it)")
    counts = hf_config.get("norm_token_counts")
    for i in range(hf_config["num_hidden_layers"]):
        for spec in layer_pattentions():
            n = counts[i][spec.hf_name] if counts else hf_config[spec.slot_key]
            state[f"layers.{i}.{spec.path}.{COUNT}"] = torch.tensor(n, dtype=torch.int64)
    return state


def architecture_of(hf_config: dict, source: Path | str) -> dict:
    """The values of this framework's ARCHITECTURE_KEYS that config.json describes."""
    from megatron.model.args import ARCHITECTURE_KEYS

    missing = [HF_NAMES.get(key, key) for key in ARCHITECTURE_KEYS if HF_NAMES.get(key, key) not in hf_config]
    if missing:
        raise InputError(f"{source} has no {missing}: it is not a config.json tools/convert_to_hf.py wrote")
    values = {key: hf_config[HF_NAMES.get(key, key)] for key in ARCHITECTURE_KEYS}
    values["no_weight_tying"] = not values["no_weight_tying"]
    return values


@dataclass(frozen=True)
class RunTokenizer:
    """What the exported model needs to know of the run's tokenizer."""

    vocab_size: int
    eod: int
    pad: int
    fast: Tokenizer | None  # its tokenizer.json form, checked to encode as the run's tokenizer; None: none written
    tokenizer_json: Path | None = None  # the run's own tokenizer.json (HFTokenizer): copied as it is


def run_tokenizer(cfg: Config, padded_vocab_size: int) -> tuple[RunTokenizer | None, str]:
    """The run's tokenizer, and a line saying what the export does with it (or why it has none)."""
    try:
        tokenizer = build_tokenizer(cfg.tokenizer_type, cfg.vocab_file, getattr(cfg, "merge_file", None))
    except (OSError, ValueError) as error:
        return None, f"no tokenizer written ({error}); the model works without one"
    if tokenizer.vocab_size > padded_vocab_size:
        return None, (f"no tokenizer written: {cfg.tokenizer_type} has {tokenizer.vocab_size} tokens, more than the "
                      f"model's {padded_vocab_size} embedding rows")
    ids = f"eos = end-of-document id {tokenizer.eod}"
    try:
        fast = fast_tokenizer(tokenizer)
        problem = verified(tokenizer, fast)
    except (OSError, ValueError) as error:
        fast, problem = None, str(error)
    if problem is not None:
        return (RunTokenizer(tokenizer.vocab_size, tokenizer.eod, tokenizer.pad, None),
                f"no tokenizer files written: {problem}; the model works without them ({ids})")
    is_json = cfg.tokenizer_type == "HFTokenizer"
    info = RunTokenizer(tokenizer.vocab_size, tokenizer.eod, tokenizer.pad, fast,
                        Path(cfg.vocab_file) if is_json else None)
    how = "copied" if is_json else "converted to tokenizer.json; it encodes and decodes a check text as the run's does"
    return info, f"tokenizer: {cfg.tokenizer_type} {cfg.vocab_file} ({how}; {ids})"


def run_fields(args: TokenFormerArgs) -> dict:
    """config.json's fields that any exported model takes from the run: tying, dropout (which acts only when
    fine-tuning), init range, cache, dtype."""
    return {"tie_word_embeddings": not args.no_weight_tying, "hidden_dropout": args.hidden_dropout,
            "attention_dropout": args.attention_dropout, "initializer_range": args.init_method_std,
            "use_cache": True, "dtype": "float32"}


def token_ids(tokenizer: RunTokenizer | None) -> dict:
    """bos/eos = the end-of-document token, and pad, as config.json and generation_config.json give them."""
    if tokenizer is None:
        return {}
    return {"bos_token_id": tokenizer.eod, "eos_token_id": tokenizer.eod, "pad_token_id": tokenizer.pad}


def hf_config(args: TokenFormerArgs, counts: list[dict[str, int]], tokenizer: RunTokenizer | None) -> dict:
    """config.json of the model `args` describes (args as TokenFormerArgs.from_config gives them: the run's
    dropout, which acts only when fine-tuning)."""
    return {
        "model_type": MODEL_TYPE,
        "architectures": ["TokenFormerForCausalLM"],
        "auto_map": {"AutoConfig": "configuration_tokenformer.TokenFormerConfig",
                     "AutoModelForCausalLM": "modeling_tokenformer.TokenFormerForCausalLM"},
        "vocab_size": args.padded_vocab_size,
        "tokenizer_vocab_size": tokenizer.vocab_size if tokenizer else None,
        "hidden_size": args.hidden_size,
        "num_hidden_layers": args.num_layers,
        "num_attention_heads": args.num_attention_heads,
        **{key: getattr(args, key) for key in slot_keys()},
        "pattention_slot_keys": {spec.hf_name: spec.slot_key for spec in layer_pattentions()},
        "pattention_paths": {spec.hf_name: spec.path for spec in layer_pattentions()},
        "norm_token_counts": counts,
        "max_position_embeddings": args.max_position_embeddings,
        "pos_emb": args.pos_emb,
        "rotary_pct": args.rotary_pct,
        "rotary_emb_base": args.rotary_emb_base,
        "norm": args.norm,
        "final_norm": args.final_norm,
        "layernorm_epsilon": args.layernorm_epsilon,
        "norm_activation_type": args.norm_activation_type,
        "pattention_tau": args.pattention_tau,
        **run_fields(args),
        **token_ids(tokenizer),
    }


def generation_config(padded_vocab_size: int, tokenizer: RunTokenizer | None) -> dict:
    """generation_config.json: stop at the end-of-document token; never choose a padded vocabulary row
    (as generate.py), so greedy decoding picks generate.py's tokens."""
    config = token_ids(tokenizer)
    if tokenizer is not None and tokenizer.vocab_size < padded_vocab_size:
        config["suppress_tokens"] = list(range(tokenizer.vocab_size, padded_vocab_size))
    return config


def _tokenizer_files(tokenizer: RunTokenizer, directory: Path, max_length: int) -> None:
    """tokenizer.json (the run's, copied, or its converted form) and a tokenizer_config.json AutoTokenizer
    reads offline."""
    if tokenizer.tokenizer_json is not None:
        shutil.copyfile(tokenizer.tokenizer_json, directory / "tokenizer.json")
    else:
        tokenizer.fast.save(str(directory / "tokenizer.json"))
    eod, pad = tokenizer.fast.id_to_token(tokenizer.eod), tokenizer.fast.id_to_token(tokenizer.pad)
    settings = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": eod, "eos_token": eod, "unk_token": eod,
                "pad_token": pad, "model_max_length": max_length, "add_bos_token": False, "add_eos_token": False,
                "clean_up_tokenization_spaces": False}
    _write_json(directory / "tokenizer_config.json", settings)


def _write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2) + "\n", encoding="utf-8")


# --- directories --------------------------------------------------------------------------------------------

def write_hf_directory(state: dict[str, Tensor], cfg: Config, out: str | Path, max_shard_bytes: int) -> list[str]:
    """Write the model (`state`, whole, as read_state returns it; `cfg` its config) into `out`, a new or empty
    directory, under a temporary name renamed to `out` when complete. Returns what was written, one line each."""
    padded = state["word_embeddings.weight"].shape[0]
    args = TokenFormerArgs.from_config(cfg, padded_vocab_size=padded, checkpoint_activations=False)
    dense = args.model_type == "transformer"
    if dense:
        gpt_neox.check_exportable(args)
    out = require_new_or_empty(out, "OUTPUT_DIR")
    tokenizer, tokenizer_line = run_tokenizer(cfg, padded)
    if dense:
        config = {**gpt_neox.gpt_neox_config(args), **run_fields(args), **token_ids(tokenizer)}
        weights_of, code_files = gpt_neox.gpt_neox_state(state, args), ()
    else:
        config = hf_config(args, token_counts(state, args.num_layers), tokenizer)
        weights_of, code_files = to_hf_state(state), CODE_FILES
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(f".{out.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)  # this process's name: a leftover of nothing else
    partial.mkdir()
    try:
        _write_json(partial / CONFIG_NAME, config)
        _write_json(partial / "generation_config.json", generation_config(padded, tokenizer))
        weights = write_safetensors_shards(weights_of, partial, max_shard_bytes)
        record_weights(partial, weights)
        for name in code_files:
            shutil.copyfile(REMOTE_CODE / name, partial / name)
        if tokenizer is not None and tokenizer.fast is not None:
            _tokenizer_files(tokenizer, partial, args.max_position_embeddings)
        if out.exists():
            out.rmdir()  # empty (checked above): the rename needs the name free
        partial.rename(out)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    kind = "GPTNeoXForCausalLM (transformers' own code)" if dense else "TokenFormerForCausalLM (remote code)"
    return [f"wrote {out}: {kind}: {', '.join([CONFIG_NAME, *(p.name for p in weights), *code_files])}, "
            "generation_config.json", tokenizer_line]


def read_hf_directory(directory: str | Path) -> tuple[dict[str, Tensor], dict]:
    """This framework's state dict (fp32) and the config.json of a TokenFormer model directory (one
    tools/convert_to_hf.py wrote, or transformers' save_pretrained of such a model)."""
    directory = Path(directory)
    config_path = directory / CONFIG_NAME
    if not config_path.is_file():
        raise FileNotFoundError(f"{directory} has no {CONFIG_NAME}: pass a Hugging Face model directory")
    try:
        hf_config = json.loads(config_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise InputError(f"{config_path} is not JSON ({error}); pass a Hugging Face model directory whose "
                         "config.json transformers wrote") from None
    model_type = hf_config.get("model_type") if isinstance(hf_config, dict) else None
    if model_type != MODEL_TYPE:
        raise InputError(f"{config_path} has model_type {model_type!r}, not {MODEL_TYPE!r}: only "
                         "TokenFormer models convert (e.g. a directory tools/convert_to_hf.py wrote)")
    weights = weights_in_directory(directory)
    if weights is None:
        raise FileNotFoundError(f"{directory} holds no model.safetensors, pytorch_model.bin or their .index.json")
    state = from_hf_state(read_weights(weights), hf_config, weights)
    return {name: t.float() if t.is_floating_point() else t for name, t in state.items()}, hf_config


NAME = "huggingface"


def recognises(path: Path) -> bool:
    """A directory whose config.json is a Hugging Face TokenFormer's: model_type "tokenformer" and `architectures`
    (a framework checkpoint's config.json has model_type too, the config key, but no `architectures`)."""
    config_path = path / CONFIG_NAME
    if not (path.is_dir() and config_path.is_file()):
        return False
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
        return config.get("model_type") == MODEL_TYPE and "architectures" in config
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        return False


def read(path: Path, config: Config | str | Path | None) -> tuple[dict[str, Tensor], Config]:
    """The canonical state of a model directory, and `config` (a run's: the directory has none), which must
    describe the directory's architecture."""
    if config is None:
        raise InputError(f"{path} is a Hugging Face model directory, which holds no run config: {PASS_CONFIG} (the "
                         "YAML of the run it came from, or of one to train it on)")
    state, hf_config = read_hf_directory(path)
    vocab = state["word_embeddings.weight"].shape[0]
    architecture = architecture_of(hf_config, path)
    cfg = read_config(config) if isinstance(config, (str, Path)) else config
    cfg.padded_vocab_size = vocab
    different = [f"{key} {getattr(cfg, key)!r} (config.json: {HF_NAMES.get(key, key)}={value!r})"
                 for key, value in architecture.items() if getattr(cfg, key) != value]
    if different:
        raise InputError(f"the config given does not describe the model in {path}: " + "; ".join(different)
                         + ". Set those keys to the model's values")
    return state, cfg
