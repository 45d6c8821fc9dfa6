"""Tests of megatron.config: loading, validation, derivation, run-time checks and docs."""

import json
import pickle
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron.config import Config, ConfigError, check_run_inputs, inactive_keys, load_config, slow_keys
from megatron.config.docs import DOC_PATH, render
from tests.official_configs import official_configs, write_official_configs

REPO = Path(__file__).resolve().parents[1]
OUR_CONFIGS = {"150M": 8, "450M": 16, "900M": 32, "1-5B": 64}  # size -> GPUs of the official run

MINIMAL = {
    "num_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "qkv_slot_num": 32,
    "proj_slot_num": 32,
    "ffn_slot_num": 128,
    "seq_length": 32,
    "train_iters": 10,
    "optimizer": {"type": "Adam", "params": {"lr": 0.001}},
    "train_micro_batch_size_per_gpu": 2,
}


def write_yaml(tmp_path: Path, name: str, content: dict) -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(content), encoding="utf-8")
    return path


def config_error(match: str, *args, **kwargs) -> str:
    """Message of the ConfigError raised by Config.from_dict(*args, **kwargs); checks it contains `match`."""
    with pytest.raises(ConfigError) as info:
        Config.from_dict(*args, **kwargs)
    assert match in str(info.value), str(info.value)
    return str(info.value)


# --- loading and merging ---------------------------------------------------


def test_later_files_win_and_dicts_are_replaced_whole(tmp_path):
    first_optimizer = {"type": "Adam", "params": {"lr": 0.001, "betas": [0.8, 0.9]}}
    base = write_yaml(tmp_path, "base.yml", {**MINIMAL, "optimizer": first_optimizer})
    top = write_yaml(tmp_path, "top.yml", {"train_iters": 77, "optimizer": {"type": "AdamW", "params": {"lr": 0.002}}})
    cfg = load_config([base, top])
    assert cfg.train_iters == 77
    assert cfg.optimizer == {"type": "AdamW", "params": {"lr": 0.002}}
    assert cfg.lr == 0.002
    assert load_config([top, base]).train_iters == MINIMAL["train_iters"]


def test_dash_and_underscore_spellings_are_the_same_key(tmp_path):
    path = write_yaml(tmp_path, "a.yml", {**MINIMAL, "tokenizer-type": "HFTokenizer", "vocab-file": "tok.json"})
    cfg = load_config([path], overrides=["train-iters=5"])
    assert (cfg.tokenizer_type, cfg.vocab_file, cfg.train_iters) == ("HFTokenizer", "tok.json", 5)


def test_both_spellings_in_one_file_is_an_error(tmp_path):
    path = write_yaml(tmp_path, "a.yml", {**MINIMAL, "seq-length": 16, "seq_length": 32})
    with pytest.raises(ConfigError, match="same key"):
        load_config([path])


def test_overrides_are_parsed_as_yaml(tmp_path):
    path = write_yaml(tmp_path, "a.yml", MINIMAL)
    cfg = load_config(
        [path],
        overrides=[
            "train_iters=100",
            "min_lr=1e-5",
            "optimizer={type: Adam, params: {lr: 0.01, betas: [0.9, 0.95]}}",
            "data_path=/x/y",
            "extra_save_iters=[3, 5]",
        ],
    )
    assert cfg.train_iters == 100 and isinstance(cfg.train_iters, int)
    assert cfg.min_lr == 1e-5 and isinstance(cfg.min_lr, float)
    assert cfg.optimizer == {"type": "Adam", "params": {"lr": 0.01, "betas": [0.9, 0.95]}}
    assert cfg.lr == 0.01
    assert cfg.data_path == "/x/y"
    assert cfg.extra_save_iters == [3, 5]


def test_exponent_floats_in_files_are_floats(tmp_path):
    path = tmp_path / "a.yml"
    path.write_text(yaml.safe_dump(MINIMAL) + "layernorm_epsilon: 1e-6\n", encoding="utf-8")
    assert load_config([path]).layernorm_epsilon == 1e-6


def test_malformed_override_is_named(tmp_path):
    path = write_yaml(tmp_path, "a.yml", MINIMAL)
    with pytest.raises(ConfigError, match="'train_iters' must look like key=value"):
        load_config([path], overrides=["train_iters"])


def test_override_origin_is_named_in_errors(tmp_path):
    path = write_yaml(tmp_path, "a.yml", MINIMAL)
    with pytest.raises(ConfigError, match="override 'train_iters=many'"):
        load_config([path], overrides=["train_iters=many"])


def test_missing_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match=f"{tmp_path / 'nope.yml'} does not exist"):
        load_config([tmp_path / "nope.yml"])


def test_invalid_yaml_is_named(tmp_path):
    path = tmp_path / "bad.yml"
    path.write_text("num_layers: [1, 2\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=f"{path} is not valid YAML"):
        load_config([path])


def test_non_mapping_file_is_named(tmp_path):
    path = tmp_path / "list.yml"
    path.write_text("- 1\n- 2\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=f"{path} must contain a mapping"):
        load_config([path])


def test_config_files_keep_the_file_text(tmp_path):
    path = write_yaml(tmp_path, "a.yml", MINIMAL)
    assert load_config([path]).config_files == {str(path): path.read_text(encoding="utf-8")}


# --- key-level errors -------------------------------------------------------


def test_misspelled_key_names_key_file_and_suggestion(tmp_path):
    path = write_yaml(tmp_path, "typo.yml", {**MINIMAL, "num_layer": 3})
    with pytest.raises(ConfigError) as info:
        load_config([path])
    message = str(info.value)
    assert "'num_layer'" in message and str(path) in message and "did you mean 'num_layers'" in message


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [("train_iters", "100", "expected int"), ("num_layers", True, "expected int"), ("warmup", "0.1", "expected float"),
     ("no_weight_tying", 1, "expected bool"), ("extra_save_iters", [1, "2"], "expected list of int")],
)
def test_wrong_type_names_key_value_and_type(key, value, expected):
    message = config_error(expected, {**MINIMAL, key: value})
    assert key in message and repr(value) in message


def test_unknown_choice_lists_the_choices():
    message = config_error("'rope' is not one of: rotary, learned, none", {**MINIMAL, "pos_emb": "rope"})
    assert "pos_emb" in message


def test_out_of_range_value_is_named():
    config_error("warmup: 1.5 is outside the allowed range [0, 1]", {**MINIMAL, "warmup": 1.5})


@pytest.mark.parametrize(("key", "text", "shown"), [
    ("min_lr", ".nan", "nan"), ("warmup", "1e400", "inf"), ("layernorm_epsilon", "-.inf", "-inf"),
    ("train_data_weights", "[1.0, .nan]", "[1.0, nan]"),
])
def test_a_number_that_is_not_finite_is_named_as_such(tmp_path, key, text, shown):
    """`.nan` and `1e400` (which YAML reads as inf) are named as not finite, not as a float of the wrong type."""
    path = tmp_path / "numbers.yml"
    path.write_text(f"{key}: {text}\n")
    with pytest.raises(ConfigError) as error:
        load_config([REPO / "configs" / "demo.yml", path])
    assert f"{key}: {shown} is not a finite number; YAML reads .nan, .inf and numbers beyond about 1.8e308 " \
           f"(such as 1e400) as these: give a finite value (from {path})" in str(error.value)


def test_missing_required_key_is_named():
    config_error("num_layers is required", {k: v for k, v in MINIMAL.items() if k != "num_layers"})


def test_several_problems_are_reported_together():
    message = config_error("invalid configuration", {**MINIMAL, "num_layer": 1, "seq_length": "long"})
    assert "num_layer'" in message and "seq_length: expected int" in message


@pytest.mark.parametrize(
    ("optimizer", "expected"),
    [({"type": "SGD", "params": {"lr": 0.1}}, "not one of: Adam, AdamW"),
     ({"type": "Adam", "params": {}}, "optimizer.params.lr: expected a positive number"),
     ({"type": "Adam", "params": {"lr": 0.1, "weight_decay": 0.1}}, "top-level weight_decay"),
     ({"type": "Adam", "params": {"lr": 0.1, "beta": [0.9, 0.9]}}, "did you mean 'betas'"),
     ({"type": "Adam", "params": {"lr": 0.1, "betas": [0.9]}}, "optimizer.params.betas")],
)
def test_bad_optimizer_sections(optimizer, expected):
    config_error(expected, {**MINIMAL, "optimizer": optimizer})


def test_deepspeed_sections_are_checked_with_deepspeed():
    config_error("fp16.loss_scael", {**MINIMAL, "fp16": {"enabled": True, "loss_scael": 0}})
    config_error("zero_optimization.stage", {**MINIMAL, "zero_optimization": {"stage": 5}})


# --- cross-key rules and derived values -------------------------------------


@pytest.mark.parametrize(
    ("changes", "expected"),
    [({"num_attention_heads": 5}, "hidden_size 64 is not divisible by num_attention_heads 5"),
     ({"pos_emb": "rotary", "rotary_pct": 0.1}, "rotary dimensions"),
     ({"max_position_embeddings": 16}, "max_position_embeddings 16 is smaller than seq_length 32"),
     ({"min_lr": 0.01}, "min_lr 0.01 is larger than lr 0.001"),
     ({"split": "90,10"}, "split '90,10'"),
     ({"split": "0,0,0"}, "split '0,0,0'"),
     ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "fp16 and bf16 are both enabled"),
     ({"lr": 0.5}, "lr is 0.5 but optimizer.params.lr gives 0.001"),
     ({"precision": "bfloat16"}, "precision is 'bfloat16'"),
     ({"data_path": "a", "train_data_paths": ["b"]}, "data_path and train_data_paths are both set"),
     ({"train_data_paths": ["a", "b"], "train_data_weights": [1.0]}, "train_data_weights has 1 entries"),
     ({"train_data_paths": ["a", "b"], "train_data_weights": [1.0, -1.0]},
      "train_data_weights [1.0, -1.0]: each weight must be a positive number"),
     ({"valid_data_paths": ["a", "b"], "valid_data_weights": [0, 0]},
      "valid_data_weights [0.0, 0.0]: each weight must be a positive number (to leave a dataset out, remove it "
      "from valid_data_paths)"),
     ({"train_data_paths": ["a", "b"], "train_data_weights": [1e308, 1e308]},
      "train_data_weights [1e+308, 1e+308]: their sum overflows to inf"),
     ({"attention_config": [[["global"], 2]]}, "every layer of this framework is a TokenFormer layer")],
)
def test_impossible_values_are_rejected(changes, expected):
    config_error(expected, {**MINIMAL, **changes})


def test_derived_values():
    cfg = Config.from_dict({**MINIMAL, "norm": "layernorm_nonparam", "bf16": {"enabled": True}})
    assert cfg.lr == 0.001
    assert cfg.precision == "bfloat16"
    assert cfg.lr_decay_iters == MINIMAL["train_iters"]
    assert cfg.max_position_embeddings == MINIMAL["seq_length"]
    assert cfg.final_norm == "layernorm_nonparam"
    assert Config.from_dict({**MINIMAL, "fp16": {"fp16": True}}).precision == "fp16"
    assert Config.from_dict(MINIMAL).precision == "fp32"


def test_batch_sizes_that_do_not_multiply_out():
    message = config_error(
        "train_batch_size 10 != train_micro_batch_size_per_gpu 2 * gradient_accumulation_steps 3 "
        "* data-parallel size 2",
        {**MINIMAL, "train_batch_size": 10, "gradient_accumulation_steps": 3},
        world_size=2,
    )
    assert "(= 12)" in message


def test_world_size_must_be_divisible_by_model_copies():
    config_error(
        "world_size 6 is not divisible by model_parallel_size 4", {**MINIMAL, "model_parallel_size": 4}, world_size=6
    )


def test_indivisible_global_batch_is_rejected():
    message = "train_batch_size = 7 is not divisible by data-parallel size 2"
    config_error(message, {**MINIMAL, "train_batch_size": 7}, world_size=2)


def test_without_world_size_batch_arithmetic_is_skipped():
    cfg = Config.from_dict({**MINIMAL, "train_batch_size": 10, "gradient_accumulation_steps": 3})
    assert cfg.train_batch_size == 10 and cfg.world_size is None


@settings(max_examples=40, deadline=None)
@given(
    micro=st.integers(1, 16),
    accum=st.integers(1, 8),
    dp=st.integers(1, 8),
    mp=st.sampled_from([1, 2]),
    pp=st.sampled_from([0, 1, 2]),
)
def test_any_two_batch_sizes_determine_the_third(micro, accum, dp, mp, pp):
    world = dp * mp * max(pp, 1)
    base = {k: v for k, v in MINIMAL.items() if k != "train_micro_batch_size_per_gpu"}
    base.update(model_parallel_size=mp, pipe_parallel_size=pp, num_attention_heads=4)
    batch = micro * accum * dp
    expected = (batch, micro, accum)
    for given_keys in [
        {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": accum},
        {"train_batch_size": batch, "train_micro_batch_size_per_gpu": micro},
        {"train_batch_size": batch, "gradient_accumulation_steps": accum},
        {"train_batch_size": batch, "train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": accum},
    ]:
        cfg = Config.from_dict({**base, **given_keys}, world_size=world)
        assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == expected


def test_micro_batch_alone_means_no_accumulation():
    cfg = Config.from_dict(MINIMAL, world_size=3)
    assert (cfg.train_batch_size, cfg.gradient_accumulation_steps) == (6, 1)


# --- the Config object --------------------------------------------------------


def test_json_round_trip_and_pickle():
    cfg = Config.from_dict({**MINIMAL, "fp16": {"enabled": True}}, world_size=4)
    cfg.padded_vocab_size = 50304
    again = Config.from_json(cfg.to_json())
    assert again == cfg and again.to_dict() == cfg.to_dict()
    assert json.loads(cfg.to_json())["padded_vocab_size"] == 50304
    assert pickle.loads(pickle.dumps(cfg)) == cfg


def test_read_only_and_unknown_attributes():
    cfg = Config.from_dict(MINIMAL)
    with pytest.raises(AttributeError, match="read-only"):
        cfg.hidden_size = 128
    with pytest.raises(AttributeError, match="did you mean 'hidden_size'"):
        cfg.hidden_sise = 128
    with pytest.raises(AttributeError, match="did you mean 'hidden_size'"):
        _ = cfg.hidden_sise
    with pytest.raises(ConfigError, match="padded_vocab_size: expected int"):
        cfg.padded_vocab_size = "big"
    cfg.optimizer["params"]["lr"] = 1.0
    assert cfg.optimizer["params"]["lr"] == 0.001


def test_format_lists_every_key_sorted():
    cfg = Config.from_dict(MINIMAL)
    names = [line.split()[0] for line in cfg.format().splitlines()]
    assert names == sorted(cfg.to_dict())
    assert "hidden_size ...." in cfg.format()


# --- official and shipped configs --------------------------------------------


@pytest.fixture(scope="module")
def reference_dir(tmp_path_factory) -> Path:
    """The official release's 8 configs, in its format (tests/official_configs.py)."""
    directory = tmp_path_factory.mktemp("tokenformer-configs")
    write_official_configs(directory)
    return directory


def test_all_reference_configs_are_written(reference_dir):
    assert sorted(p.name for p in reference_dir.glob("*.yml")) == sorted(official_configs())


@pytest.mark.parametrize("name", sorted(official_configs()))
def test_reference_configs_load_unchanged(reference_dir, name):
    path = reference_dir / name
    loose = load_config([path])
    cfg = load_config([path], world_size=64)
    assert cfg.train_batch_size == cfg.train_micro_batch_size_per_gpu * cfg.gradient_accumulation_steps * 64
    assert (loose.precision, cfg.pos_emb, cfg.final_norm) == ("fp16", "rotary", "layernorm")
    assert "fp16" not in cfg.fp16  # GPT-NeoX's redundant flag is dropped; DeepSpeed rejects it
    reported = dict(inactive_keys(cfg, "cpu"))
    assert {"partition_activations", "attention_config", "distributed_backend"} <= set(reported)


@pytest.mark.parametrize(("size", "gpus"), OUR_CONFIGS.items())
def test_our_configs_load(reference_dir, size, gpus):
    files = [REPO / "configs" / f"{size}.yml", REPO / "configs" / "local_setup.yml"]
    official = load_config([reference_dir / f"{size}_train_pile.yml"], world_size=gpus)
    ours = load_config(files, world_size=gpus)
    for key in ("num_layers", "hidden_size", "num_attention_heads", "qkv_slot_num", "proj_slot_num", "ffn_slot_num",
                "seq_length", "rotary_pct", "norm", "final_norm", "norm_activation_type", "init_method",
                "output_layer_init_method", "optimizer", "min_lr", "train_iters", "lr_decay_style", "warmup",
                "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "precision"):
        assert getattr(ours, key) == getattr(official, key), key
    per_step = official.train_batch_size // official.train_micro_batch_size_per_gpu
    assert load_config(files, world_size=1).gradient_accumulation_steps == per_step
    assert inactive_keys(ours, "cuda") == []
    assert ours.data_path and ours.vocab_file and ours.save


# --- run-time checks and inactive keys ----------------------------------------


def runnable(tmp_path: Path, **changes) -> Config:
    prefix = tmp_path / "corpus_text_document"
    for suffix in (".bin", ".idx"):
        Path(f"{prefix}{suffix}").write_bytes(b"")
    vocab = tmp_path / "tokenizer.json"
    vocab.write_text("{}", encoding="utf-8")
    return Config.from_dict(
        {**MINIMAL, "data_path": str(prefix), "tokenizer_type": "HFTokenizer", "vocab_file": str(vocab), **changes}
    )


def test_run_inputs_pass_when_files_exist(tmp_path):
    check_run_inputs(runnable(tmp_path), device_name="cpu")


def test_missing_data_files_are_named(tmp_path):
    cfg = runnable(tmp_path, train_data_paths=[str(tmp_path / "gone")], data_path=None)
    with pytest.raises(ConfigError) as info:
        check_run_inputs(cfg, device_name="cpu")
    assert f"train_data_paths[0] = '{tmp_path / 'gone'}'" in str(info.value)
    assert f"{tmp_path / 'gone'}.bin" in str(info.value) and f"{tmp_path / 'gone'}.idx" in str(info.value)


def test_every_run_problem_is_listed_at_once(tmp_path):
    cfg = runnable(
        tmp_path, vocab_file=str(tmp_path / "missing.json"), eval_only=True, pretrain_partial_init="small/",
        fp16={"enabled": True},
    )
    with pytest.raises(ConfigError) as info:
        check_run_inputs(cfg, device_name="cpu")
    message = str(info.value)
    for expected in (
        "vocab_file = ",
        "eval_only needs load",
        "pretrain_partial_init = 'small/'",
        "fp16 is enabled but the device is CPU",
    ):
        assert expected in message
    check_run_inputs(runnable(tmp_path, fp16={"enabled": True}), device_name="cuda")


def test_no_data_at_all_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="no data: set data_path"):
        check_run_inputs(runnable(tmp_path, data_path=None), device_name="cpu")


def test_gpt2_tokenizer_needs_a_merge_file(tmp_path):
    with pytest.raises(ConfigError, match="merge_file is not set but tokenizer_type GPT2BPETokenizer needs it"):
        check_run_inputs(runnable(tmp_path, tokenizer_type="GPT2BPETokenizer"), device_name="cpu")


def test_inactive_keys_report_only_changed_values():
    cfg = Config.from_dict({**MINIMAL, "bias_gelu_fusion": True, "rope_fusion": False, "distributed_backend": "gloo"})
    assert [key for key, _ in inactive_keys(cfg, "cpu")] == ["bias_gelu_fusion"]
    nccl = Config.from_dict(MINIMAL)
    assert [key for key, _ in inactive_keys(nccl, "cpu")] == ["distributed_backend"]
    assert inactive_keys(nccl, "cuda") == []


def test_pattention_keys_of_a_dense_transformer_are_named_as_inactive():
    """A dense Transformer with slot counts and Θ set gets the note other inactive keys get: they have no effect."""
    dense = Config.from_dict({**MINIMAL, "model_type": "transformer", "norm_activation_type": "softmax",
                              "pattention_impl": "flash"})
    reported = dict(inactive_keys(dense, "cuda"))
    assert list(reported) == ["qkv_slot_num", "proj_slot_num", "ffn_slot_num", "norm_activation_type",
                              "pattention_impl"]
    assert set(reported.values()) == {"model_type transformer has no Pattention layers (its projections are "
                                      "linear), so the Pattention keys do not apply"}
    assert inactive_keys(Config.from_dict({**MINIMAL, "norm_activation_type": "softmax"}), "cuda") == []


@pytest.mark.parametrize("impl", ["flash", "fused", "auto"])
def test_triton_tiles_on_a_cpu_are_named_as_slow(impl):
    """fused runs Θ in Triton kernels as flash does, as 100x slow under the interpreter on a CPU."""
    cfg = load_config([REPO / "configs" / "demo.yml"], [f"pattention_impl={impl}", "flash_backend=triton"])
    [(key, why)] = slow_keys(cfg, "cpu")
    assert key == "flash_backend" and "Triton's interpreter" in why and "flash_backend: pytorch" in why
    assert f"pattention_impl {impl}'s kernels" in why
    assert slow_keys(cfg, "cuda") == []
    for fast in ([f"pattention_impl={impl}", "flash_backend=pytorch"], ["pattention_impl=plain", "flash_backend=triton"]):
        assert slow_keys(load_config([REPO / "configs" / "demo.yml"], fast), "cpu") == []


def test_compiling_on_a_cpu_is_named_as_silent_for_minutes():
    cfg = load_config([REPO / "configs" / "demo.yml"], ["compile={enable: true}"])
    [(key, why)] = slow_keys(cfg, "cpu")
    assert key == "compile" and "the first training step compiles every TokenFormer layer" in why
    assert slow_keys(cfg, "cuda") == []
    assert slow_keys(load_config([REPO / "configs" / "demo.yml"], ["compile={enable: false}"]), "cpu") == []


# --- generated documentation ----------------------------------------------------


@pytest.mark.parametrize("paths, expected", [
    ({}, "max_restarts = 2 restarts a failed run from its latest checkpoint, but save is unset: set save and load "
         "to the same directory"),
    ({"save": "run/ck"}, "max_restarts = 2 restarts a failed run from its latest checkpoint in load, but load = None "
                         "is not save = 'run/ck': set load = 'run/ck'"),
    ({"save": "run/ck", "load": "run/old"}, "but load = 'run/old' is not save = 'run/ck': set load = 'run/ck'"),
])
def test_restarts_need_load_to_be_save(paths, expected):
    config_error(expected, {**MINIMAL, "max_restarts": 2, **paths})
    assert Config.from_dict({**MINIMAL, "max_restarts": 2, "save": "run/ck/", "load": "run/ck"}).max_restarts == 2


def test_docs_are_up_to_date():
    assert DOC_PATH.read_text(encoding="utf-8") == render(), "run: python -m megatron.config.docs"


@pytest.mark.parametrize(("text", "message"), [
    ("num_layers: 2\nhidden_size: 64\nnum_layers: 4\n", "key 'num_layers' is given twice, on lines 1 and 3"),
    ("optimizer:\n  type: Adam\n  params: {lr: 0.1,\n           lr: 0.2}\n",
     "key 'lr' is given twice, on lines 3 and 4"),
])
def test_a_key_given_twice_in_one_file_names_both_lines(tmp_path, text, message):
    path = tmp_path / "twice.yml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=f"config file {path} is not valid YAML: {message}; keep one of them"):
        load_config([path])


@pytest.mark.parametrize(("text", "line", "key"), [
    ("fp16: {enabled:true}\n", 1, "enabled:true"),
    ("num_layers: 2\noptimizer: {type: Adam, params: {lr:0.1}}\n", 2, "lr:0.1"),
])
def test_flow_style_without_a_space_after_the_colon_says_so(tmp_path, text, line, key):
    path = tmp_path / "flow.yml"
    path.write_text(text)
    name, _, value = key.partition(":")
    with pytest.raises(ConfigError) as error:
        load_config([path])
    assert str(error.value) == (f"config file {path} is not valid YAML: {key!r} on line {line} reads as one key "
                                f"with no value: YAML needs a space after the colon ({{{name}: {value}}})")
    path.write_text(text.replace(":true", ": true").replace(":0.1", ": 0.1"))
    load_config([REPO / "configs" / "demo.yml", path])


def test_yaml_merge_keys_are_read_and_real_keys_given_twice_still_refused(tmp_path):
    """`<<: *base` (YAML 1.1, read by PyYAML's safe loader) is read, not refused as "not valid YAML"; the merged
    keys give way to the mapping's own, as YAML says, and a real key given twice is still named."""
    path = tmp_path / "merge.yml"
    cfg = load_config([REPO / "configs" / "demo.yml"],
                      ["optimizer={type: Adam, params: {<<: {lr: 0.1, eps: 1.0e-6}, lr: 0.002}}"])
    assert cfg.optimizer["params"] == {"lr": 0.002, "eps": 1.0e-6}
    path.write_text("optimizer:\n  type: Adam\n  params: {<<: {lr: 0.001, betas: [0.9, 0.95]}, eps: 1.0e-8}\n")
    cfg = load_config([REPO / "configs" / "demo.yml", path])
    assert cfg.optimizer["params"] == {"lr": 0.001, "betas": [0.9, 0.95], "eps": 1.0e-8}
    path.write_text("optimizer:\n  type: Adam\n  params: {<<: {lr: 0.001}, eps: 1.0e-8,\n           eps: 1.0e-6}\n")
    with pytest.raises(ConfigError, match=f"config file {path} is not valid YAML: key 'eps' is given twice, on "
                                          "lines 3 and 4; keep one of them"):
        load_config([path])
