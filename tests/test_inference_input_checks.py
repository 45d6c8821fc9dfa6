"""Bad input to the inference tools, as a new user would give it.

A checkpoint whose files fail its manifest is refused by load_model, generate.py and the exports, naming the
files and the fix (no fallback to an older checkpoint); a prompt that is not UTF-8 (prompt file or
interactive input) is named once and skipped, and generation goes on; export_checkpoint.py's errors are one
line on stderr with exit status 2. Damage is always done to a copy of the shared trained checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron import mpu
from megatron.config import load_config
from megatron.formats.deepspeed.reader import CheckpointUnreadable
from megatron.inference import load_model
from megatron.inference.text_generation import generate_samples
from megatron.model import TokenFormerArgs, TokenFormerModel
from megatron.tokenizer import build_tokenizer
from tests.conftest import REPO
from tests.distributed import free_port, run_on_ranks
from tests.inference_fixtures import PROBE, TINY
from tests.test_generation import ARCHITECTURE
from tests.test_tokenizer import train_tokenizer
from tools import convert_official_checkpoint, export_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")
MODEL_FILE = "mp_rank_01_model_states.pt"


def flip_a_byte(path: Path) -> None:
    """A bit-rotted file of the right size: torch.load reads it without complaint, with a wrong weight."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


def damaged_copy(save: Path, tmp_path: Path, damage=flip_a_byte, name: str = MODEL_FILE) -> Path:
    """A copy of the save directory `save` with `name` of its global_step2 damaged."""
    copy = Path(shutil.copytree(save, tmp_path / "checkpoints"))
    damage(copy / "global_step2" / name)
    return copy


# --- 1. a checkpoint that fails its manifest is refused by name -------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("damage", [flip_a_byte, truncate, Path.unlink], ids=["corrupted", "truncated", "missing"])
def test_load_model_refuses_a_damaged_checkpoint_naming_the_file_and_an_intact_one(
        damage, tensor_parallel_checkpoint, tmp_path):
    save = Path(shutil.copytree(tensor_parallel_checkpoint.save, tmp_path / "checkpoints"))
    shutil.copytree(save / "global_step2", save / "global_step1")  # an older intact checkpoint beside it
    size = (save / "global_step2" / MODEL_FILE).stat().st_size
    damage(save / "global_step2" / MODEL_FILE)
    reason = {flip_a_byte: "does not match its SHA-256", truncate: f"has {size // 2} bytes, the manifest says {size}",
              Path.unlink: "is missing"}[damage]
    for path in (save, save / "global_step2"):  # `latest` names the damaged one: no silent fallback to step 1
        with pytest.raises(CheckpointUnreadable) as refused:
            load_model(path)
        assert f"global_step2 is damaged: {MODEL_FILE} {reason}" in str(refused.value)
        assert f"Restore the damaged files from a copy, or load another checkpoint: pass its directory, e.g. " \
               f"load={save / 'global_step1'}" in str(refused.value)
    older = load_model(save / "global_step1")  # the fix the message names works
    torch.testing.assert_close(older(PROBE), tensor_parallel_checkpoint.logits, rtol=1e-5, atol=1e-5)


def _load_error_on_tensor_ranks(path: Path) -> str:
    mpu.initialize_model_parallel(2)
    try:
        load_model(path)
    except CheckpointUnreadable as error:
        return str(error)
    finally:
        mpu.destroy_model_parallel()
    return "loaded"


@pytest.mark.slow
def test_every_rank_refuses_a_file_another_rank_hashed(tensor_parallel_checkpoint, tmp_path):
    # The records read are config.json, mp_rank_00, mp_rank_01: rank 1 hashes mp_rank_00 (work_split.py).
    save = damaged_copy(tensor_parallel_checkpoint.save, tmp_path, name="mp_rank_00_model_states.pt")
    errors = run_on_ranks(2, _load_error_on_tensor_ranks, save)
    assert errors[0] == errors[1]
    assert "global_step2 is damaged: mp_rank_00_model_states.pt does not match its SHA-256" in errors[0]


@pytest.mark.slow
def test_generate_script_stops_on_a_damaged_checkpoint_with_one_message(tensor_parallel_checkpoint, tmp_path):
    save = damaged_copy(tensor_parallel_checkpoint.save, tmp_path)
    launched = subprocess.run(
        [sys.executable, "deepy.py", "generate.py", "tests/tiny.yml", "configs/text_generation.yml",
         *tensor_parallel_checkpoint.overrides, f"load={save}", "num_gpus=1", "model_parallel_size=1",
         f"master_port={free_port()}",
         f"sample_output_file={tmp_path}/samples.jsonl"],
        cwd=REPO, capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert launched.returncode != 0
    assert f"error: {save / 'global_step2'} is damaged: {MODEL_FILE} does not match its SHA-256" in launched.stderr
    assert "Traceback" not in launched.stderr
    assert not (tmp_path / "samples.jsonl").exists()


@pytest.mark.slow
def test_exports_refuse_a_damaged_checkpoint(tensor_parallel_checkpoint, tmp_path, capsys):
    save = damaged_copy(tensor_parallel_checkpoint.save, tmp_path)
    exported = subprocess.run([sys.executable, "tools/export_checkpoint.py", str(save), str(tmp_path / "out")],
                              cwd=REPO, capture_output=True, text=True, timeout=300)
    assert exported.returncode == 2
    [line] = exported.stderr.splitlines()
    assert line.startswith("export_checkpoint.py: error: ") and f"{MODEL_FILE} does not match its SHA-256" in line
    assert not (tmp_path / "out").exists()
    message = exit_message(capsys, "--export", "--input", str(save), "--save", str(tmp_path / "o.bin"),
                           tool=convert_official_checkpoint)
    assert f"{MODEL_FILE} does not match its SHA-256" in message and not (tmp_path / "o.bin").exists()


# --- 2. a prompt that is not UTF-8 is named and skipped -----------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory) -> str:
    return train_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.json", ["<|endoftext|>", "<|padding|>"])


def generate_from(tokenizer_file: str, tmp_path: Path, *overrides: str, stdin=None) -> list[dict]:
    """generate_samples with a random tiny model; the records written to sample_output_file."""
    cfg = load_config([TINY], [*ARCHITECTURE, "maximum_tokens=3", f"vocab_file={tokenizer_file}",
                               f"sample_output_file={tmp_path}/samples.jsonl", *overrides])
    tokenizer = build_tokenizer(cfg.tokenizer_type, cfg.vocab_file)
    model = TokenFormerModel(TokenFormerArgs.from_config(cfg, padded_vocab_size=512)).eval()
    records = generate_samples(cfg, model, tokenizer, torch.device("cpu"), stdin)
    written = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [r["context"] for r in written] == [r["context"] for r in records]
    return records


def test_a_prompt_file_line_that_is_not_utf8_is_named_and_skipped(tokenizer_file, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_bytes(b"def main():\nprint('caf\xe9')\n\nimport os\n")  # line 2 is Latin-1
    records = generate_from(tokenizer_file, tmp_path, "text_gen_type=input-file", f"sample_input_file={prompts}")
    assert [r["context"] for r in records] == ["def main():", "import os"]
    [message] = capsys.readouterr().err.splitlines()
    assert message == (f"error: {prompts} line 2 is not UTF-8 text (an undecodable byte at column 11); skipped it, "
                       "generating the next prompt. Save prompts as UTF-8")


def test_a_prompt_of_several_lines_is_named_by_the_line_of_its_bad_byte(tokenizer_file, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_bytes(b"# one\nx = 1\n<END>\n# two\n\xc3\n<END>\n# three \xe2\x9c\x93\n")  # line 5: \xc3 cut short
    records = generate_from(tokenizer_file, tmp_path, "text_gen_type=input-file", f"sample_input_file={prompts}",
                            "prompt_end=<END>")
    assert [r["context"] for r in records] == ["# one\nx = 1", "# three ✓"]
    assert f"{prompts} line 5 is not UTF-8" in capsys.readouterr().err


def test_a_prompt_longer_than_the_model_is_named_and_the_others_generated(tokenizer_file, tmp_path, capsys):
    """max_position_embeddings is 40 here: the long prompt is skipped with a line, not a traceback that would lose
    every other prompt's output."""
    prompts = tmp_path / "prompts.txt"
    long = " ".join(["word"] * 60)
    prompts.write_text(f"first prompt\n{long}\nlast prompt\n")
    records = generate_from(tokenizer_file, tmp_path, "text_gen_type=input-file", f"sample_input_file={prompts}")
    assert [r["context"] for r in records] == ["first prompt", "last prompt"]
    [message] = capsys.readouterr().err.splitlines()
    assert message.startswith("error: prompt 2 ('word word word word word word word word ...') has ")
    assert message.endswith("tokens, which leave no room to generate: max_position_embeddings=40; skipped it, "
                            "generating the next prompt. Shorten it")


def test_generation_shows_progress_to_a_person_and_says_where_it_wrote(tokenizer_file, tmp_path, capsys,
                                                                       monkeypatch):
    monkeypatch.setenv("TOKENFORMER_STDERR_IS_A_TERMINAL", "1")  # deepy.py's stderr is a terminal
    records = generate_from(tokenizer_file, tmp_path, "text_gen_type=unconditional", "num_samples=3")
    captured = capsys.readouterr()
    assert len(records) == 3 and "generating: 100%" in captured.err and "3/3" in captured.err
    assert captured.out.splitlines()[-1] == f"wrote 3 samples to {tmp_path}/samples.jsonl"


@pytest.mark.parametrize("errors", ["surrogateescape", "strict"])  # sys.stdin's under C/POSIX and other locales
def test_an_interactive_line_that_is_not_utf8_is_named_and_skipped(errors, tokenizer_file, tmp_path, capsys):
    typed = tmp_path / "typed"
    typed.write_bytes(b"def main\r\n\xff\xfe\x00bad\n\nimport os\n")
    with open(typed, encoding="utf-8", errors=errors) as stdin:
        records = generate_from(tokenizer_file, tmp_path, "text_gen_type=interactive", stdin=stdin)
    assert [r["context"] for r in records] == ["def main", "import os"]
    assert capsys.readouterr().err.splitlines() == [
        "error: interactive input line 2 is not UTF-8 text (an undecodable byte at column 1); skipped it, "
        "generating the next prompt. Save prompts as UTF-8"]


@pytest.mark.slow
def test_generate_script_skips_a_typed_line_that_is_not_utf8(tensor_parallel_checkpoint, tmp_path):
    launched = subprocess.run(
        [sys.executable, "deepy.py", "generate.py", "tests/tiny.yml", "configs/text_generation.yml",
         *tensor_parallel_checkpoint.overrides, f"load={tensor_parallel_checkpoint.save}", "num_gpus=1",
         "model_parallel_size=1", f"master_port={free_port()}", "text_gen_type=interactive", "maximum_tokens=4",
         f"sample_output_file={tmp_path}/typed.jsonl"],
        input=b"def main\ncaf\xe9\nimport os\n", cwd=REPO, capture_output=True, timeout=300,
        env=dict(os.environ, OMP_NUM_THREADS="1", LC_ALL="C.UTF-8"))
    stderr = launched.stderr.decode(errors="replace")
    assert launched.returncode == 0, stderr
    assert stderr.count("interactive input line 2 is not UTF-8") == 1
    written = [json.loads(line) for line in (tmp_path / "typed.jsonl").read_text().splitlines()]
    assert [r["context"] for r in written] == ["def main", "import os"]


# --- 3. export_checkpoint.py's errors are one line ------------------------------------------------------------


def exit_message(capsys, *argv: str, tool=export_checkpoint) -> str:
    """The tool's message after `PROG: error: `, checking it is the only line and the exit status 2."""
    with pytest.raises(SystemExit) as exited:
        tool.main(list(argv))
    assert exited.value.code == 2
    [line] = capsys.readouterr().err.splitlines()
    return line.split(": error: ", 1)[1]


def test_export_errors_are_one_line(tmp_path, capsys):
    assert exit_message(capsys, str(tmp_path / "nowhere"), str(tmp_path / "out")) == (
        f"{tmp_path / 'nowhere'} does not exist: pass a checkpoint directory or an "
        "exported weights file")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "pytorch_model.bin").write_bytes(b"an earlier export")
    assert exit_message(capsys, str(tmp_path / "nowhere"), str(tmp_path / "out")) == (
        f"the output directory {tmp_path / 'out'} exists and is not empty; choose a "
        "new or empty directory (nothing is overwritten)")
    assert (tmp_path / "out" / "pytorch_model.bin").read_bytes() == b"an earlier export"


def test_official_conversion_errors_are_one_line(tmp_path, capsys):
    config = str(REPO / "tests" / "tiny.yml")
    assert exit_message(capsys, "--input", str(tmp_path / "nowhere.bin"), "--config", config, "--save",
                        str(tmp_path / "ckpt"), tool=convert_official_checkpoint) == (
        f"weights file {tmp_path / 'nowhere.bin'} does not exist")
    torch.save({"not": torch.zeros(1)}, tmp_path / "other.bin")
    assert "it is not the official release's pytorch_model.bin" in exit_message(
        capsys, "--input", str(tmp_path / "other.bin"), "--config", config, "--save", str(tmp_path / "ckpt"),
        tool=convert_official_checkpoint)
    assert not (tmp_path / "ckpt").exists()
