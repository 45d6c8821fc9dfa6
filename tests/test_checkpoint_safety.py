"""The unpickling screen lets through what DeepSpeed really writes, and nothing that would run code.

Debian 12's Python 3.11.2 (the Docker image's CPU base) pickles ZeRO's stage, an int-mixin enum, as
getattr(ZeroStageEnum, "optimizer_states"): such shards must resume and load, while any other getattr
stays refused. Other Pythons pickle the member by value, so the tests write the by-name form themselves.
"""

from __future__ import annotations

import os
import pickle

import pytest
import torch
from deepspeed.runtime.fp16.loss_scaler import LossScaler
from deepspeed.runtime.zero.config import ZeroStageEnum

from megatron.checkpoint.safety import enum_member, load_checkpoint_file, unpickling_problems


class ByName:
    """Pickles as getattr(owner, name), as Python 3.11.2 pickles an int-mixin enum member."""

    def __init__(self, owner: object, name: str) -> None:
        self.owner, self.name = owner, name

    def __reduce__(self):
        return getattr, (self.owner, self.name)


def shard(tmp_path, stage: object, name: str = "zero_pp_rank_0_mp_rank_00_optim_states.pt") -> str:
    torch.save({"optimizer_state_dict": {"zero_stage": stage, "state": torch.ones(3)}}, tmp_path / name)
    return name


def test_a_stage_pickled_by_name_passes_the_screen_and_loads_as_the_member(tmp_path):
    name = shard(tmp_path, ByName(ZeroStageEnum, "optimizer_states"))
    assert b"getattr" in (tmp_path / name).read_bytes()
    assert unpickling_problems(tmp_path, name) == []
    loaded = load_checkpoint_file(tmp_path / name)["optimizer_state_dict"]
    assert loaded["zero_stage"] is ZeroStageEnum.optimizer_states
    assert torch.equal(loaded["state"], torch.ones(3))


def test_stages_pickled_by_name_pass_the_screen_from_many_threads_at_once(tmp_path):
    """verified_file_problems screens a checkpoint's files on several threads: each lookup's allowance must hold for
    its own load while the others' come and go."""
    from concurrent.futures import ThreadPoolExecutor

    names = [shard(tmp_path, ByName(ZeroStageEnum, "optimizer_states"), f"zero_pp_rank_{i}_mp_rank_00_optim_states.pt")
             for i in range(8)]
    with ThreadPoolExecutor(8) as pool:
        found = list(pool.map(lambda name: unpickling_problems(tmp_path, name), names * 8))
    assert found == [[]] * len(found)


@pytest.mark.parametrize("owner, attribute", [
    (ZeroStageEnum, "__init__"),          # not a member: a way to functions and their globals
    (ZeroStageEnum, "mro"),
    (LossScaler, "backward"),             # an allowed class, but not an enum
    (ZeroStageEnum, "no_such_stage"),
])
def test_any_other_getattr_is_refused(tmp_path, owner, attribute):
    name = shard(tmp_path, ByName(owner, attribute))
    [problem] = unpickling_problems(tmp_path, name)
    assert f"{name} refers to builtins.getattr, which loading would run" in problem
    with pytest.raises(pickle.UnpicklingError):
        load_checkpoint_file(tmp_path / name)


def test_an_enum_lookup_beside_code_is_still_refused(tmp_path):
    name = shard(tmp_path, [ByName(ZeroStageEnum, "optimizer_states"), ByName(os.system, "__call__")])
    [problem] = unpickling_problems(tmp_path, name)
    assert f"{name} refers to builtins.getattr, posix.system, which loading would run" in problem


def test_enum_member_is_getattr_for_members_only():
    assert enum_member(ZeroStageEnum, "gradients") is ZeroStageEnum.gradients
    for owner, attribute in [(ZeroStageEnum, "__class__"), (dict, "get"), (ZeroStageEnum, 1)]:
        with pytest.raises(pickle.UnpicklingError):
            enum_member(owner, attribute)
