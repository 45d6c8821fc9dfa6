"""deepy.py's checks before launch (megatron/launch/preflight.py), called directly on files made here: a synthetic
checkpoint in the Trainer's layout (benchmarks/synthetic_checkpoint.py), a dataset and the character tokenizer,
without a launch. Each case is a problem that must be named before launch, in one line: otherwise a run starts
from scratch without a word, ends in a traceback, or finds the problem only after launch."""

from __future__ import annotations

import json
import os
import shutil
import struct
import zipfile
from pathlib import Path

import pytest
import torch

from benchmarks.synthetic_checkpoint import write_synthetic_checkpoint
from megatron.checkpoint.manifest import checkpoint_files, record_file, write_manifest
from megatron.checkpoint.selection import resume_tag
from megatron.config import ConfigError, check_run_inputs, eval_tasks, load_config
from megatron.formats.consolidated import weights_location_problem
from megatron.formats.deepspeed.changed_settings import resume_warnings
from megatron.formats.deepspeed.files import CheckpointUnreadable
from megatron.formats.registry import read_state
from megatron.launch.preflight import nothing_left_to_train, preflight_notes, preflight_problems
from megatron.launch.resolve import resolve_run
from megatron.tokenizer import build_tokenizer, pad_vocab_size
from tests.conftest import REPO
from tests.distributed import free_port
from tests.test_dataset_check import write_dataset
from tools import convert_to_hf, export_checkpoint

TINY = REPO / "tests" / "tiny.yml"
# The synthetic checkpoint's layout (bf16, one pipeline stage, ZeRO-1 over two ranks) and the run's.
LAYOUT = ("bf16={enabled: true}", "pipe_parallel_size=1", "zero_optimization={stage: 1}")
TWO_RANKS = {"localhost": [0, 1]}
MODEL_SHARD = "mp_rank_00_model_states.pt"


def corpus(folder: Path) -> str:
    """100 documents of 100 tokens."""
    folder.mkdir(parents=True, exist_ok=True)
    return write_dataset(str(folder / "corpus_text_document"), [[7] * 100] * 100)


def run_config(tmp_path: Path, *overrides: str, world_size: int = 2):
    return load_config([TINY], [f"data_path={corpus(tmp_path / 'data')}", "tokenizer_type=CharLevelTokenizer",
                                f"save={tmp_path}/new_run", f"master_port={free_port()}", *LAYOUT, *overrides],
                       world_size=world_size)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    """A save directory holding global_step3 of tests/tiny.yml's model."""
    folder = tmp_path_factory.mktemp("synthetic")
    cfg = run_config(folder)
    cfg.padded_vocab_size = pad_vocab_size(build_tokenizer("CharLevelTokenizer", None, None).vocab_size, 128, 1)
    write_synthetic_checkpoint(cfg, folder / "run", 3)
    return folder / "run"


@pytest.fixture
def run(pristine, tmp_path) -> Path:
    """A copy of the pristine save directory, to change."""
    return Path(shutil.copytree(pristine, tmp_path / "run"))


def replace_file(tag_dir: Path, name: str, content: object, legacy: bool = False) -> None:
    """`name` rewritten with `content`, and the manifest with it, as someone who means harm would."""
    torch.save(content, tag_dir / name, _use_new_zipfile_serialization=not legacy)
    (tag_dir / "manifest.json").unlink()
    write_manifest(tag_dir, [record for file in checkpoint_files(tag_dir) for record in record_file(tag_dir, file)])


class RunsCode:
    """Unpickled, it would run a shell command (creating the file `marker`)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


# --- a `load` that holds no checkpoint ----------------------------------------------------------------------------

def test_a_load_holding_no_checkpoint_is_refused_with_the_fix(run, tmp_path):
    """Each of these `load`s would otherwise train from scratch, exit 0, without a word."""
    tag_dir = run / "global_step3"
    [problem] = preflight_problems(run_config(tmp_path, f"load={tag_dir}"), TWO_RANKS)
    assert problem == (f"load = {tag_dir} is one checkpoint of the run in {run}, but load is the save directory "
                       f"holding a run's checkpoints: set load={run}, which resumes global_step3 ({run}/latest names "
                       "it)")
    (run / "latest").write_text("global_step9")  # another checkpoint is the newest: how to resume this one
    [problem] = preflight_problems(run_config(tmp_path, f"load={tag_dir}"), TWO_RANKS)
    assert problem.endswith(f"set load={run}, which resumes global_step9 ({run}/latest names it); to resume "
                            f"global_step3 itself, write global_step3 into {run}/latest")

    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text('{"model_type": "tokenformer", "architectures": ["TokenFormerForCausalLM"]}')
    (hf / "model.safetensors").write_bytes(b"")
    [problem] = preflight_problems(run_config(tmp_path, f"load={hf}"), TWO_RANKS)
    assert problem == (f"load = {hf} is a Hugging Face model directory, not a training checkpoint: convert it with "
                       f"tools/convert_from_hf.py {hf} OUT --config YOUR.yml, then set load=OUT")
    exported = tmp_path / "exported"
    exported.mkdir()
    torch.save({"word_embeddings.weight": torch.zeros(2, 2)}, exported / "pytorch_model.bin")
    [problem] = preflight_problems(run_config(tmp_path, f"load={exported}"), TWO_RANKS)
    assert problem.startswith(f"load = {exported} holds exported weights ({exported}/pytorch_model.bin), not a "
                              "training checkpoint: set load to the save directory of the run they came from")

    fix = ("point load at the save directory of the run to resume (the folder holding global_stepN/ and `latest`), "
           "or set load to save (or unset it) to start from scratch")
    [problem] = preflight_problems(run_config(tmp_path, f"load={tmp_path / 'data'}"), TWO_RANKS)
    assert problem == (f"load = {tmp_path / 'data'} holds no checkpoint (no `latest`, no global_stepN/) and is not "
                       f"save ({tmp_path}/new_run), where a new run starts: {fix}")
    [problem] = preflight_problems(run_config(tmp_path, f"load={tmp_path / 'typo'}"), TWO_RANKS)
    assert problem == (f"load = {tmp_path / 'typo'} does not exist and is not save ({tmp_path}/new_run), where a new "
                       f"run starts: {fix}")


def test_load_equal_to_save_with_nothing_there_starts_afresh_saying_so(tmp_path, capsys):
    cfg = run_config(tmp_path, f"load={tmp_path}/new_run")
    assert preflight_problems(cfg, TWO_RANKS) == []
    assert resume_tag(cfg.load) is None
    said = capsys.readouterr().out
    assert said == f"load={tmp_path}/new_run holds no checkpoint yet: this run starts at iteration 0\n"


# --- a `latest` naming a path outside the save directory ----------------------------------------------------------

@pytest.mark.parametrize("named", ["../other_run/global_step3", "/etc"])
def test_a_latest_naming_a_path_outside_the_directory_is_skipped_with_a_warning(run, tmp_path, capsys, named):
    """A tag is a directory name inside the save directory: `../other_run/global_step5` must not resume another
    run's checkpoint, and `/etc` must not crash deepy.py."""
    shutil.copytree(run, tmp_path / "other_run")
    (run / "latest").write_text(named)
    assert preflight_problems(run_config(tmp_path, f"load={run}"), TWO_RANKS) == []
    assert resume_tag(str(run)) == "global_step3"
    assert (f"warning: resuming from global_step3 in {run}; skipped:\n  {named}: `latest` names it, but a checkpoint "
            f"is a directory inside {run} (such as global_step5), not a path elsewhere; not followed") \
        in capsys.readouterr().err
    assert weights_location_problem(run) == (
        f"{run}/latest names {named!r}, which is not a checkpoint directory inside {run} (such as global_step5); "
        "load that checkpoint by its own path if it is the one meant")


# --- unsafe or damaged files --------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", [MODEL_SHARD, "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt", "rng_state_1.pt"])
def test_a_file_that_would_run_code_is_refused_before_launch_with_the_safety_message(run, tmp_path, name):
    """Any shard that would run code (model, optimizer or RNG) is refused by deepy.py in one line, not by torch's
    UnpicklingError traceback nor by the ranks, one traceback each."""
    marker = tmp_path / "ran"
    replace_file(run / "global_step3", name, {"state": RunsCode(marker)})
    [problem] = preflight_problems(run_config(tmp_path, f"load={run}"), TWO_RANKS)
    assert problem.startswith(f"load={run}: no checkpoint there can be resumed from:\n  global_step3: {name} refers "
                              "to posix.system, which loading would run; a checkpoint holds only tensors and "
                              "DeepSpeed's checkpoint classes (megatron/checkpoint/safety.py)")
    assert not marker.exists()


def test_a_stray_zero_shard_outside_the_manifest_does_not_count_as_a_data_parallel_rank(run, tmp_path):
    """The checkpoint's layout is what its config.json and manifest say, not every file that looks like a shard:
    resumed on its own 2 ranks it is taken, on 3 refused before DeepSpeed's traceback on each rank."""
    tag_dir = run / "global_step3"
    shutil.copy(tag_dir / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt",
                tag_dir / "bf16_zero_pp_rank_2_mp_rank_00_optim_states.pt")
    assert preflight_problems(run_config(tmp_path, f"load={run}", "train_iters=6"), TWO_RANKS) == []
    three = run_config(tmp_path, f"load={run}", "train_iters=6", "train_batch_size=null", "reshard_on_resume=false",
                       world_size=3)
    assert preflight_problems(three, {"localhost": [0, 1, 2]}) == [
        f"load: {tag_dir} holds ZeRO optimizer state partitioned over 2 data-parallel ranks but this run has 3, and "
        "DeepSpeed cannot re-partition it: resume on 2 data-parallel ranks, or set reshard_on_resume: true (the "
        "default), which re-shards it beside the original, or re-shard it into this run's layout with "
        "tools/grow_checkpoint.py (the slot counts unchanged), whose output any data-parallel size loads"]


def test_a_model_shard_in_the_legacy_format_is_refused_before_launch(run, tmp_path):
    header = torch.load(run / "global_step3" / MODEL_SHARD, weights_only=False)
    replace_file(run / "global_step3", MODEL_SHARD, header, legacy=True)
    [problem] = preflight_problems(run_config(tmp_path, f"load={run}"), TWO_RANKS)
    assert (f"global_step3: {MODEL_SHARD} is in torch's legacy format (saved before torch 1.6), whose pickle cannot "
            "be screened without running it: if you trust it, load it with torch.load(weights_only=False) and "
            "torch.save it again") in problem


def test_tools_and_loading_report_a_file_that_would_run_code_in_one_line(run, tmp_path, capsys):
    """export_checkpoint.py, convert_to_hf.py (and generate.py, through load_model) name such a file in one line,
    not in torch's UnpicklingError traceback (nor safetensors' SafetensorError for a damaged file, below); and
    convert_to_hf's hint names its own option, --config, not load_model's `config=`."""
    marker = tmp_path / "ran"
    layer_file = "layer_01-model_00-model_states.pt"
    replace_file(run / "global_step3", layer_file, {"weight": RunsCode(marker)})
    unsafe = f"{layer_file} refers to posix.system, which loading would run"
    with pytest.raises(CheckpointUnreadable, match=unsafe):
        read_state(run)
    for tool in (export_checkpoint, convert_to_hf):
        with pytest.raises(SystemExit) as exit_:
            tool.main([str(run), str(tmp_path / f"out_{tool.__name__}")])
        [line] = capsys.readouterr().err.splitlines()
        assert exit_.value.code == 2 and unsafe in line, line
    assert not marker.exists()


def test_a_damaged_safetensors_file_is_one_line(tmp_path, capsys):
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    (damaged / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{broken}")
    with pytest.raises(SystemExit) as exit_:
        export_checkpoint.main([str(damaged), str(tmp_path / "out")])
    [line] = capsys.readouterr().err.splitlines()
    assert exit_.value.code == 2 and f"{damaged}/model.safetensors is not a readable safetensors file (truncated or " \
                                      "corrupted)" in line, line


def test_convert_to_hf_asks_for_its_own_option_when_weights_have_no_config(tmp_path, capsys):
    bare = tmp_path / "bare"
    bare.mkdir()
    torch.save({"word_embeddings.weight": torch.zeros(2, 2)}, bare / "pytorch_model.bin")
    with pytest.raises(SystemExit):
        convert_to_hf.main([str(bare), str(tmp_path / "hf")])
    assert f"{bare}/pytorch_model.bin has no config.json beside it; pass config= (load_model) or --config " \
           "(tools/*.py)" in capsys.readouterr().err


# --- what the ranks would find only after launch ------------------------------------------------------------------

def test_a_log_dir_under_a_file_is_refused_before_launch(tmp_path):
    (tmp_path / "notes").write_text("")
    [problem] = preflight_problems(run_config(tmp_path, f"log_dir={tmp_path}/notes/logs"), TWO_RANKS)
    assert problem == (f"log_dir = {tmp_path}/notes/logs: cannot be a directory ({tmp_path}/notes, where it would be "
                       f"created): {tmp_path}/notes is a file; choose another log_dir")


def test_generations_sample_output_file_under_a_file_is_refused_before_launch(run, tmp_path):
    (tmp_path / "notes").write_text("")
    cfg = run_config(tmp_path, "user_script=generate.py", f"load={run}", "num_gpus=1",
                     f"sample_output_file={tmp_path}/notes/samples.jsonl", world_size=1)
    [problem] = preflight_problems(cfg, {"localhost": [0]})
    assert problem == (f"sample_output_file = {tmp_path}/notes/samples.jsonl: its folder {tmp_path}/notes cannot hold "
                       f"it: {tmp_path}/notes is a file; choose another sample_output_file (or create the folder)")


def test_eval_only_with_a_checkpoints_own_directory_is_refused_before_launch(run, tmp_path):
    [problem] = preflight_problems(run_config(tmp_path, "eval_only=true", f"load={run}/global_step3"), TWO_RANKS)
    assert problem.startswith(f"load = {run}/global_step3 is one checkpoint of the run in {run}")


def test_train_iters_at_or_below_the_checkpoints_iteration_is_said_before_launch(run, tmp_path):
    """deepy.py says there is nothing to train and exits 0 without launching, rather than start the ranks only for
    them to say so (a finished run asked again is no error: a requeued job's, say)."""
    cfg = run_config(tmp_path, f"load={run}", "train_iters=3")
    assert preflight_problems(cfg, TWO_RANKS) == []
    assert nothing_left_to_train(cfg) == (
        f"nothing to train: the checkpoint this run resumes ({run}/global_step3) is at iteration 3 and train_iters = "
        "3; raise train_iters (and lr_decay_iters, for a longer schedule) to train on, or set eval_only=true to "
        "evaluate it")
    assert nothing_left_to_train(run_config(tmp_path, f"load={run}", "train_iters=4")) is None
    assert nothing_left_to_train(run_config(tmp_path, f"load={run}", "train_iters=3", "eval_only=true")) is None


# --- a train split read many times --------------------------------------------------------------------------------

def test_a_train_split_that_training_reads_many_times_gets_a_note(tmp_path):
    """A run that reads its train split many times gets a note before launch, not silence. 100 documents of 100
    tokens, half of them train's: 5,000 tokens; a global batch is 16 x 64 tokens."""
    cfg = run_config(tmp_path, "split='50,25,25'", "train_iters=300")
    assert preflight_notes(cfg) == [
        f"data_path = {cfg.data_path!r} with split = '50,25,25' gives the train split 50 documents of 5,000 tokens, "
        "which train_iters = 300 reads 62 times (300 x 16 sequences of 64 tokens); if that is not intended, give "
        "train a larger share of split or use more text"]
    assert preflight_notes(run_config(tmp_path, "split='50,25,25'", "train_iters=10")) == []  # 3 epochs


def test_a_norm_ramp_without_a_growth_record_that_says_where_it_starts_is_refused_before_launch(run, tmp_path):
    [problem] = preflight_problems(run_config(tmp_path, f"load={run}", "norm_token_count_ramp_iters=5"), TWO_RANKS)
    assert problem.startswith(f"{run}/global_step3: norm_token_count_ramp_iters 5 ramps n of √n from the count a "
                              "grown checkpoint holds") and problem.endswith("Or set norm_token_count_ramp_iters: 0")
    [fresh] = preflight_problems(run_config(tmp_path, "norm_token_count_ramp_iters=5"), TWO_RANKS)
    assert "it was not grown" in fresh
    grown = run_config(tmp_path, "norm_token_count_ramp_iters=5", f"pretrain_partial_init={run}")
    assert preflight_problems(grown, TWO_RANKS) == []  # the growth at the start records it
    (run / "global_step3" / "growth.json").write_text(json.dumps({"format": 1, "grown_from": {
        "qkv_slot_num": 32, "proj_slot_num": 32, "ffn_slot_num": 128}}))
    [old] = preflight_problems(run_config(tmp_path, f"load={run}", "norm_token_count_ramp_iters=5"), TWO_RANKS)
    assert "predates the ramp: grow the source again" in old


# --- the checkpoint deepy.py judges is the one the ranks resume ---------------------------------------------------

def flip_bytes(path: Path) -> None:
    """Bytes of the largest tensor in the torch file `path` changed, its size kept: what a disk or a copy can do
    unseen by sizes (the pickle stays readable)."""
    with zipfile.ZipFile(path) as archive:
        tensors = [info for info in archive.infolist() if "/data/" in info.filename]
    largest = max(tensors, key=lambda info: info.file_size)
    data = bytearray(path.read_bytes())
    name_length, extra_length = struct.unpack("<HH", data[largest.header_offset + 26:largest.header_offset + 30])
    start = largest.header_offset + 30 + name_length + extra_length + largest.file_size // 2
    data[start:start + 8] = bytes(byte ^ 0xFF for byte in data[start:start + 8])
    path.write_bytes(bytes(data))


def with_final_checkpoint(run: Path, tmp_path: Path, iteration: int = 5) -> Path:
    """`run` with global_step`iteration` after its global_step3, `latest` naming it."""
    cfg = run_config(tmp_path)
    cfg.padded_vocab_size = pad_vocab_size(build_tokenizer("CharLevelTokenizer", None, None).vocab_size, 128, 1)
    return write_synthetic_checkpoint(cfg, run, iteration)


def test_a_final_checkpoint_with_bytes_flipped_is_not_taken_for_a_finished_run(run, tmp_path):
    """"Nothing to train" rests on the final checkpoint's contents, not its sizes: the ranks would skip the damaged
    global_step5 and train on from global_step3, so a requeued job must not report itself done."""
    final = with_final_checkpoint(run, tmp_path)
    cfg = run_config(tmp_path, f"load={run}", "train_iters=5")
    assert nothing_left_to_train(cfg).startswith(f"nothing to train: the checkpoint this run resumes ({final})")
    flip_bytes(final / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt")
    assert preflight_problems(cfg, TWO_RANKS) == [] and nothing_left_to_train(cfg) is None  # launched: 3 to 5
    flip_bytes(run / "global_step3" / "layer_02-model_00-model_states.pt")  # none left to resume: refused
    with pytest.raises(ConfigError, match=f"load={run}: no checkpoint there can be resumed from:\n  global_step5: "
                                          "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt does not match its SHA-256"):
        nothing_left_to_train(run_config(tmp_path, f"load={run}", "train_iters=3"))


def test_a_newest_checkpoint_that_would_run_code_is_not_the_one_deepy_speaks_of(run, tmp_path):
    """What deepy.py says before launch ("resuming ... with ... changed") is of the checkpoint the ranks resume,
    global_step3, not of a newer one whose optimizer shard they refuse."""
    final = with_final_checkpoint(run, tmp_path)
    marker = tmp_path / "ran"
    replace_file(final, "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", {"state": RunsCode(marker)})
    cfg = run_config(tmp_path, f"load={run}", "train_iters=6", "weight_decay=0.05")
    assert preflight_problems(cfg, TWO_RANKS) == []
    warnings = resume_warnings(cfg)  # data_path too: the pristine run's data is elsewhere
    assert f"resuming {run / 'global_step3'} with weight_decay changed: saved 0.1, this run 0.05" in "\n".join(warnings)
    assert all(warning.startswith(f"resuming {run / 'global_step3'} with ") for warning in warnings), warnings
    assert not marker.exists()


def test_a_latest_that_is_not_text_leaves_the_checkpoints_beside_it_resumable(run, tmp_path, capsys):
    """A damaged `latest` is named and skipped, without a UnicodeDecodeError traceback: the checkpoints beside it
    stay resumable without fixing the file by hand."""
    (run / "latest").write_bytes(b"global_step\xff\xfe3\n")
    cfg = run_config(tmp_path, f"load={run}", "train_iters=3")
    assert preflight_problems(cfg, TWO_RANKS) == [] and all(f"{run}/global_step3 " in w for w in resume_warnings(cfg))
    assert nothing_left_to_train(cfg).startswith(f"nothing to train: the checkpoint this run resumes ({run}/global_"
                                                 "step3)")
    assert resume_tag(str(run)) == "global_step3"
    damaged = (f"{run}/latest is damaged: it holds b'global_step\\xff\\xfe3\\n', not a checkpoint's name such as "
               "global_step5")
    assert capsys.readouterr().err == (f"warning: resuming from global_step3 in {run}; skipped:\n  latest: {damaged}; "
                                       "not followed\n")
    assert weights_location_problem(run) == f"{damaged}; write the name of the checkpoint to load into it"


def test_an_empty_latest_is_said_to_be_empty_and_the_newest_checkpoint_resumed(run, tmp_path, capsys):
    """Not "a path elsewhere": the file is named as empty, and resuming takes the newest checkpoint that verifies."""
    (run / "latest").write_text("\n")
    assert resume_tag(str(run)) == "global_step3"
    empty = (f"{run}/latest is empty (a write cut short, or emptied by hand), not a checkpoint's name such as "
             "global_step5")
    assert capsys.readouterr().err == (f"warning: resuming from global_step3 in {run}; skipped:\n  latest: {empty}; "
                                       "not followed\n")
    assert weights_location_problem(run) == f"{empty}; write the name of the checkpoint to load into it"


def batch_warnings(cfg) -> list[str]:
    return [warning for warning in resume_warnings(cfg) if " with seq_length " in warning
            or " with train_micro_batch_size_per_gpu " in warning]


def test_resuming_with_another_sequence_length_or_micro_batch_is_warned_naming_the_key(run, tmp_path):
    """Each is warned naming the key: with seq_length halved, the data position the checkpoint restores points at
    other text."""
    cfg = run_config(tmp_path, f"load={run}", "train_iters=6", "seq_length=32", "train_micro_batch_size_per_gpu=2",
                     "train_batch_size=null")
    tag_dir = run / "global_step3"
    assert batch_warnings(cfg) == [
        f"resuming {tag_dir} with seq_length changed: saved 64, this run 32. The data position it holds counts "
        "samples of 64 tokens; samples of 32 are cut and shuffled otherwise, so from there the run reads other text "
        "than its saved run would have: some of it again, some never (set it as in its config.json if that is not "
        "intended)",
        f"resuming {tag_dir} with train_micro_batch_size_per_gpu changed: saved 4, this run 2; a step now trains on "
        "8 sequences instead of 16, while train_iters and the learning-rate schedule count steps: the run reads "
        "another amount of text from here (set it as in its config.json if that is not intended)"]
    same_batch = run_config(tmp_path, f"load={run}", "train_iters=6", "train_micro_batch_size_per_gpu=2",
                            "gradient_accumulation_steps=4")
    assert batch_warnings(same_batch) == [
        f"resuming {tag_dir} with train_micro_batch_size_per_gpu changed: saved 4, this run 2; the global batch "
        "stays 16 sequences, so a step trains on the same text as before (set it as in its config.json if that is "
        "not intended)"]


@pytest.mark.parametrize("pointed_at", ["the .bin file", "the directory"])
def test_a_data_path_naming_the_bin_file_or_its_directory_gets_the_prefix_it_means(tmp_path, pointed_at):
    """The error names the prefix meant, not "missing ....bin.bin ...; prepare the dataset first"."""
    prefix = corpus(tmp_path / "data")
    given = f"{prefix}.bin" if pointed_at == "the .bin file" else str(tmp_path / "data")
    with pytest.raises(ConfigError) as error:
        check_run_inputs(run_config(tmp_path, f"data_path={given}"), "cpu")
    rule = ("the data prefix is the path without .bin/.idx (e.g. data/demo/demo_text_document), produced by "
            "tools/preprocess_data.py")
    meant = (f"for {given} that is {prefix}" if pointed_at == "the .bin file"
             else f"{given} is a directory, holding the dataset {prefix}")
    assert f"data_path = {given!r}: missing {given}.bin, {given}.idx; {rule}; {meant}" in str(error.value)


def test_a_train_iters_no_run_can_count_is_refused_before_launch_naming_the_runs_global_batch():
    """train_iters beyond what the 64-bit sample counts hold is refused before launch, as deepy.py resolves the
    run: naming its global batch (tiny.yml: 4 x 2 accumulation x 2 processes = 16), not the 1 of the reading
    before the world size is known."""
    with pytest.raises(ConfigError, match=r"train_iters = 1000000000000000000000000000000 is beyond any run: 1.6e\+31 "
                                          r"samples of train_batch_size 16, more than the data index and the "
                                          r"checkpoints can count \(2\^63 - 1\)"):
        resolve_run([TINY], [f"train_iters={10**30}"], "train.py", device="cpu")


def flip_safetensors_bytes(path: Path) -> None:
    """Bytes in the middle of the tensors of the safetensors file `path` changed, its size, header and modification
    time kept, as bit rot leaves them."""
    written = path.stat()
    data = bytearray(path.read_bytes())
    start = 8 + struct.unpack("<Q", data[:8])[0] + (len(data) - 8 - struct.unpack("<Q", data[:8])[0]) // 2
    data[start:start + 8] = bytes(byte ^ 0xFF for byte in data[start:start + 8])
    path.write_bytes(bytes(data))
    os.utime(path, ns=(written.st_atime_ns, written.st_mtime_ns))


@pytest.mark.parametrize("export", ["export_checkpoint", "convert_to_hf"])
def test_an_export_whose_weights_have_bytes_flipped_is_refused_in_one_line(run, tmp_path, capsys, export):
    """Both exporters write a manifest beside the weights, which every reader checks: flipped bytes in
    model.safetensors are refused in one line, not converted (or loaded) without a word."""
    exported = tmp_path / "exported"
    if export == "export_checkpoint":
        export_checkpoint.main([str(run), str(exported), "--safetensors"])
    else:
        convert_to_hf.main([str(run), str(exported)])
    assert read_state(exported, TINY)[0]  # intact: reads
    flip_safetensors_bytes(exported / "model.safetensors")
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        export_checkpoint.main([str(exported), str(tmp_path / "again"), "--config", str(TINY)])
    [line] = capsys.readouterr().err.splitlines()
    assert exit_.value.code == 2 and line.endswith(
        f"{exported}/model.safetensors does not match its SHA-256 in the manifest (corrupted): it changed since "
        "manifest.json was written without being rewritten (it is not newer); export the weights again"), line


def test_an_eval_task_no_task_file_names_is_refused_before_lm_eval_builds_its_index(monkeypatch):
    """A name in no task file (eval_tasks=[piqaa]) is refused from the files' text, before lm-eval builds its slow
    index of thousands of task files."""
    def index(*args, **kwargs):
        raise AssertionError("lm-eval's task index was built")

    monkeypatch.setattr(eval_tasks, "task_manager", index)
    assert eval_tasks.eval_task_problems(["piqaa"], None) == [
        "eval_tasks: 'piqaa' is not a task lm-eval knows (nor one of eval_include_path's); did you mean 'piqa'?"]
