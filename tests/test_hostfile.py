"""Hostfiles and include/exclude: bad input is one clear error before any process starts; good input launches."""

from __future__ import annotations

import pytest

from megatron.config import ConfigError, load_config
from megatron.launch.resources import process_slots
from megatron.launch.ssh import check_reachable
from megatron.launch.hostfile import read_hostfile
from tests.launch_checks import TINY, run_rank_check


def config(*overrides: str):
    return load_config(TINY, list(overrides))


def write(tmp_path, text: str) -> str:
    path = tmp_path / "hostfile"
    path.write_text(text)
    return str(path)


def test_hostfile_lines_comments_and_order(tmp_path):
    path = write(tmp_path, "# the pool\nworker-1 slots=4\n\nworker-0   slots=2  # fewer GPUs\n")
    assert list(read_hostfile(path).items()) == [("worker-1", 4), ("worker-0", 2)]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("worker-0 slots=2\nworker-1 slot=2\n", ":2: 'worker-1 slot=2' is not 'HOST slots=N'"),
        ("worker-0 slots=2\nworker-1\n", ":2: 'worker-1' is not 'HOST slots=N'"),
        ("worker-0 slots=two\n", ":1: 'worker-0 slots=two' is not 'HOST slots=N'"),
        ("worker-0 slots=0\n", ":1: worker-0 has slots=0"),
        ("worker-0 slots=2\nworker-0 slots=4\n", ":2: host 'worker-0' is listed twice"),
        ("# nothing here\n\n", "lists no hosts"),
    ],
)
def test_malformed_hostfile_names_file_and_line(tmp_path, text, expected):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as error:
        read_hostfile(path)
    assert f"hostfile {path}" in str(error.value) and expected in str(error.value)


def test_missing_hostfile_says_how_to_fix_it(tmp_path):
    with pytest.raises(ConfigError, match="does not exist; write one 'HOST slots=N' line per node"):
        process_slots(config(f"hostfile={tmp_path}/nowhere"), "cpu", 1)


def test_include_exclude_num_nodes_and_num_gpus_select_slots(tmp_path):
    path = write(tmp_path, "a slots=4\nb slots=4\nc slots=4\n")
    assert process_slots(config(f"hostfile={path}", "num_gpus=2"), "cpu", 1) == {h: [0, 1] for h in "abc"}
    assert process_slots(config(f"hostfile={path}", "num_gpus=4", "num_nodes=2"), "cpu", 1) == {
        "a": [0, 1, 2, 3], "b": [0, 1, 2, 3]}
    assert process_slots(config(f"hostfile={path}", "include=b:1,3@c"), "cpu", 1) == {"b": [1, 3], "c": [0, 1, 2, 3]}
    assert process_slots(config(f"hostfile={path}", "exclude=a@c:0"), "cpu", 1) == {"b": [0, 1, 2, 3], "c": [1, 2, 3]}


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["num_gpus=8"], r"num_gpus=8 processes per node, but hostfile .* has fewer slots on \{'a': 4, 'b': 4\}"),
        (["num_nodes=3"], "num_nodes=3 but hostfile .* offers 2 hosts"),
        (["include=z"], "Hostname 'z' not found in hostfile"),
        (["include=a:7"], "No slot '7' specified on host 'a'"),
        (["include=a", "exclude=b"], "mutually exclusive"),
        (["exclude=a@b"], "leave no slots"),
    ],
)
def test_more_processes_than_slots_or_bad_filters_are_errors(tmp_path, overrides, expected):
    path = write(tmp_path, "a slots=4\nb slots=4\n")
    with pytest.raises(ConfigError, match=expected):
        process_slots(config(f"hostfile={path}", *overrides), "cpu", 1)


def test_unreachable_host_is_named_unless_ssh_check_is_off(tmp_path):
    path = write(tmp_path, "localhost slots=2\nnode-7.invalid slots=2\n")
    cfg = config(f"hostfile={path}", "launcher=openmpi")
    slots = process_slots(cfg, "cpu", 1)
    with pytest.raises(ConfigError, match=r"passwordless ssh cannot reach node-7\.invalid: .*no_ssh_check: true"):
        check_reachable(cfg, slots)
    check_reachable(config(f"hostfile={path}", "launcher=openmpi", "no_ssh_check=true"), slots)


def test_deepy_rejects_a_bad_hostfile_before_starting_anything(demo_data, tmp_path):
    path = write(tmp_path, "localhost slots=2\nlocalhost-2 slots 2\n")
    result = run_rank_check(demo_data, f"hostfile={path}", check=False)
    assert result.returncode == 2
    assert f"hostfile {path}:2: 'localhost-2 slots 2' is not 'HOST slots=N'" in result.stderr
    assert "Traceback" not in result.stderr and "launching" not in result.stdout
