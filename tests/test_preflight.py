"""deepy.py refuses, before any process starts, what the ranks would fail on after their start-up: a busy
master_port, a vocab_file that is not a tokenizer, a split that gives training no documents, a save directory
that cannot be written, and a checkpoint in `load` that does not fit the run (another tensor-parallel size, ZeRO
state of another data-parallel size, another architecture read from the pipeline's layer files, missing files).
Each is one message and exit code 2, with no process launched."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess

import pytest

from tests.conftest import REPO, run_deepy
from tests.distributed import free_port
from tests.test_training_e2e import data_overrides

pytestmark = pytest.mark.slow

TINY = str(REPO / "tests" / "tiny.yml")


def refused(demo_data, *overrides: str) -> str:
    """deepy.py train.py with the tiny config: it must stop before launching; its error output."""
    result = run_deepy("train.py", TINY, *data_overrides(demo_data), *overrides, check=False, timeout=120)
    assert result.returncode == 2 and "launching" not in result.stdout, result.stdout + result.stderr
    assert "Traceback" not in result.stderr and result.stderr.startswith("config error: "), result.stderr
    return result.stderr


def test_a_busy_master_port_is_named(demo_data):
    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen()
        port = busy.getsockname()[1]
        message = refused(demo_data, f"master_port={port}")
    assert f"master_port {port} is in use on this machine (another run?); set master_port= to a free port" in message


def test_a_vocab_file_that_is_not_a_tokenizer_is_named(demo_data, tmp_path):
    (tmp_path / "notes.txt").write_text("not a tokenizer\n")
    message = refused(demo_data, f"vocab_file={tmp_path / 'notes.txt'}", f"master_port={free_port()}")
    assert f"vocab_file = '{tmp_path / 'notes.txt'}' cannot be read as a HFTokenizer tokenizer" in message


def test_a_split_that_gives_training_no_documents_is_named(demo_data):
    message = refused(demo_data, "split='0,1,0'", f"master_port={free_port()}")
    assert "with split = '0,1,0' leaves the train split no documents (of " in message
    assert 'give train a share of split (e.g. "969,30,1")' in message
    # A weight of 0 whose rounding hands train one document: refused, not trained on one document
    message = refused(demo_data, "split='0,50,50'", f"master_port={free_port()}")
    assert "with split = '0,50,50' leaves the train split no documents (of " in message
    # Too little text for one global batch (16 sequences of 64 tokens) in the tiny config
    message = refused(demo_data, "split='1,1499,0'", f"master_port={free_port()}")
    assert "with split = '1,1499,0' leaves the train split 1 documents of " in message
    assert "fewer than one global batch reads (16 sequences of 64 tokens: 1,025)" in message


@pytest.fixture
def read_only_directory(tmp_path):
    """A read-only tmpfs as root (who may write anywhere else), a directory without write permission otherwise."""
    folder = tmp_path / "read-only"
    folder.mkdir()
    if os.geteuid() != 0:
        folder.chmod(0o555)
        yield folder, "Permission denied"
        folder.chmod(0o755)
        return
    subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(folder)], check=True)
    yield folder, "Read-only file system"
    subprocess.run(["umount", "--lazy", str(folder)], check=True)


def test_a_save_directory_that_cannot_be_written_is_named(demo_data, tmp_path, read_only_directory):
    folder, reason = read_only_directory
    message = refused(demo_data, f"save={folder}/checkpoints", f"master_port={free_port()}")
    assert (f"save = {folder}/checkpoints: not writable ({folder}, where it would be created): {reason}; choose a "
            "writable save directory or fix its permissions") in message
    (tmp_path / "notes").write_text("")
    message = refused(demo_data, f"save={tmp_path}/notes/checkpoints", f"master_port={free_port()}")
    assert (f"save = {tmp_path}/notes/checkpoints: cannot be a directory ({tmp_path}/notes, where it would be "
            f"created): {tmp_path}/notes is a file; choose another save directory") in message


def test_another_tensor_parallel_size_is_refused_with_the_fix(demo_data, tensor_parallel_checkpoint):
    message = refused(demo_data, f"load={tensor_parallel_checkpoint.save}", "reshard_on_resume=false",
                      f"master_port={free_port()}")
    assert "was saved with model_parallel_size=2 but this run has model_parallel_size=1" in message
    assert "tools/grow_checkpoint.py" in message


def test_zero_state_of_another_data_parallel_size_points_to_the_grow_tool(demo_data, zero_data_parallel_checkpoint):
    message = refused(demo_data, f"load={zero_data_parallel_checkpoint.save}", "num_gpus=1",
                      "reshard_on_resume=false", f"master_port={free_port()}")
    assert ("holds ZeRO optimizer state partitioned over 2 data-parallel ranks but this run has 1, and DeepSpeed "
            "cannot re-partition it") in message and "tools/grow_checkpoint.py" in message


def test_another_architecture_lists_every_tensor_of_the_pipeline_layer_files(demo_data, pipeline_checkpoint):
    message = refused(demo_data, f"load={pipeline_checkpoint.save}", "pipe_parallel_size=2", "model_parallel_size=2",
                      "num_gpus=4", "ffn_slot_num=128", f"master_port={free_port()}")
    assert "its config.json differs in ffn_slot_num (saved 256, this run 128). 4 tensors differ" in message
    for layer in (0, 1):  # blocks of 2 tensor ranks, read from layer_II-model_XX files
        assert f"layers.{layer}.mlp.key_param_tokens: checkpoint [128, 64], this config [64, 64]" in message


def test_missing_checkpoint_files_are_named(demo_data, zero_data_parallel_checkpoint, tmp_path):
    checkpoints = tmp_path / "checkpoints"
    shutil.copytree(zero_data_parallel_checkpoint.save, checkpoints)
    (checkpoints / "global_step2" / "mp_rank_00_model_states.pt").unlink()
    message = refused(demo_data, f"load={checkpoints}", f"master_port={free_port()}")
    assert f"load={checkpoints}: no checkpoint there can be resumed from" in message
    assert "global_step2: mp_rank_00_model_states.pt is missing" in message


def refused_inference(script: str, *overrides: str) -> str:
    """deepy.py generate.py / eval.py with the tiny config: stopped before launching; its error output."""
    result = run_deepy(script, TINY, "num_gpus=1", *overrides, check=False, timeout=300)
    assert result.returncode == 2 and "launching" not in result.stdout, result.stdout + result.stderr
    assert "Traceback" not in result.stderr and result.stderr.startswith("config error: "), result.stderr
    return result.stderr


def test_generation_and_evaluation_inputs_are_checked_before_launch(demo_data, tmp_path):
    """Each of these is refused before launch: launched, it would fail in the ranks (a traceback per rank, or an
    unknown task's KeyError), or end with exit 0 and an empty output."""
    vocab = f"vocab_file={demo_data}/tokenizer.json"
    (tmp_path / "empty").mkdir()
    message = refused_inference("generate.py", vocab, f"load={tmp_path / 'empty'}")
    assert (f"load: {tmp_path / 'empty'} holds neither a checkpoint (latest, global_stepN/) nor exported weights "
            "(model.safetensors, pytorch_model.bin)") in message
    (tmp_path / "prompts.txt").write_text("\n  \n\n")
    message = refused_inference("generate.py", vocab, f"load={tmp_path / 'empty'}", "text_gen_type=input-file",
                                f"sample_input_file={tmp_path / 'prompts.txt'}")
    assert f"sample_input_file = '{tmp_path / 'prompts.txt'}' holds no prompts (it is empty or blank)" in message
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "tiny_task.yaml").write_text("task: tiny_task\ndataset_path: json\n")
    message = refused_inference("eval.py", vocab, f"load={tmp_path / 'empty'}", "eval_tasks=[tiny_tsk]",
                                f"eval_include_path={tmp_path / 'tasks'}")
    assert ("eval_tasks: 'tiny_tsk' is not a task lm-eval knows (nor one of eval_include_path's); did you mean "
            "'tiny_task'?") in message
    # A built-in task whose dataset is on the hub, which this test makes unreachable (launched, a long traceback,
    # late); a local task passes the check
    (tmp_path / "tasks" / "local.jsonl").write_text('{"text": "a"}\n')
    files = f"{{data_files: {{validation: {tmp_path}/tasks/local.jsonl}}}}"
    (tmp_path / "tasks" / "tiny_task.yaml").write_text(
        f"task: tiny_task\ndataset_path: json\ndataset_kwargs: {files}\n")
    (tmp_path / "tasks" / "hub_task.yaml").write_text("task: hub_task\ndataset_path: nobody/no_such_dataset\n")
    result = run_deepy("eval.py", TINY, "num_gpus=1", vocab, f"load={tmp_path / 'empty'}",
                       "eval_tasks=[tiny_task,hub_task]", f"eval_include_path={tmp_path / 'tasks'}", check=False,
                       timeout=300, env=dict(os.environ, HF_ENDPOINT="http://127.0.0.1:9", HF_HOME=str(tmp_path)))
    assert result.returncode == 2 and "tiny_task" not in result.stderr, result.stderr
    assert ("eval_tasks: 'hub_task' reads the dataset 'nobody/no_such_dataset' from the Hugging Face hub, which this "
            "machine does not reach, and it is not in the datasets cache; make it a local task (docs/inference.md, "
            '"Offline / local datasets")') in result.stderr
