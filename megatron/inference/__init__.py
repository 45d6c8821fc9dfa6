"""Inference: load a model saved in any format as one model, generate text, score lm-eval tasks (the formats
themselves: megatron/formats).

    from megatron.inference import SamplingParams, generate, load_model
    model = load_model("demo_run/checkpoints")
    [sample] = generate(model, prompt_tokens, maximum_tokens=50, sampling=SamplingParams(temperature=0.8))

The lm-eval adapter (megatron.inference.lm_eval_adapter) needs the eval extra. docs/inference.md.
"""

from megatron.inference.generation import Generation, generate
from megatron.inference.loading import build_model, load_model
from megatron.inference.sampling import SamplingParams

__all__ = ["Generation", "SamplingParams", "build_model", "generate", "load_model"]
