"""megatron/training/zero_check.py: a ZeRO engine built with our AdamW does not import DeepSpeed's Muon optimizer
(nor inductor's compiler through it), every optimizer gets DeepSpeed's own answer from the check, and DeepSpeed's
check is back after the block."""

import os
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import REPO
from tests.distributed import free_port

# One process, a gloo world of one: a ZeRO-1 engine built inside the block, the check's answers compared, then an
# engine built outside it.
SCRIPT = textwrap.dedent("""
    import sys
    import deepspeed, torch
    import deepspeed.runtime.engine as engine_module
    from megatron.runtime.process_group import without_deepspeeds_inference_comm_op
    from megatron.training.zero_check import zero_check_without_muon

    MUON = "deepspeed.runtime.zero.muon.muon_optimizer"
    without_deepspeeds_inference_comm_op()  # as the ranks do: no C++ op built
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    config = {"train_batch_size": 1, "zero_optimization": {"stage": 1}}

    def engine():
        model = torch.nn.Linear(4, 4)
        return deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()), config=config)[0]

    deepspeeds = engine_module.is_zero_supported_optimizer
    with zero_check_without_muon():
        engine()
        print("imported inside:", MUON in sys.modules, "torch._inductor.compile_fx" in sys.modules)
        ours = engine_module.is_zero_supported_optimizer
        optimizers = [kind([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
                      for kind in (torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD, torch.optim.RMSprop)]
        answers = [ours(optimizer) for optimizer in optimizers]
    print("answers:", answers, [deepspeeds(optimizer) for optimizer in optimizers])
    print("restored:", engine_module.is_zero_supported_optimizer is deepspeeds)
    engine()
    print("imported outside:", MUON in sys.modules)
""")


@pytest.mark.slow
def test_a_zero_engine_built_with_adamw_imports_neither_muon_nor_inductors_compiler():
    environment = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
                       LOCAL_RANK="0")
    result = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, env=environment, capture_output=True,
                            text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert "imported inside: False False" in lines
    assert "answers: [True, True, False, False] [True, True, False, False]" in lines
    assert "restored: True" in lines
    # DeepSpeed's own check still imports Muon; once it no longer does, zero_check.py can go.
    assert "imported outside: True" in lines
