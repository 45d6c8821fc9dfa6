"""Inference: load any checkpoint as one model, generate text, score lm-eval tasks (checkpoint files
themselves: megatron/checkpoint).

    from megatron.inference import SamplingParams, generate, load_model
    model = load_model("demo_run/checkpoints")
    [sample] = generate(model, prompt_tokens, maximum_tokens=50, sampling=SamplingParams(temperature=0.8))

The lm-eval adapter (megatron.inference.lm_eval_adapter) needs the eval extra. docs/inference.md.
"""

from megatron.inference.generation import Generation, generate
from megatron.inference.loading import build_model, load_model, load_state
from megatron.inference.sampling import SamplingParams

__all__ = ["Generation", "SamplingParams", "build_model", "generate", "load_model", "load_state"]
