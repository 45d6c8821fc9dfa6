"""Parameter counts of a TokenFormerModel by component (works on meta-device models: only shapes are read)."""

from torch import nn

from megatron.model.spec import pattention_entry

COMPONENTS = ("embedding", "attention", "ffn", "norms", "output")


def component_of(parameter_name: str) -> str:
    """The component a parameter belongs to: a Pattention's is the one spec.py declares for it; the others follow
    the state_dict names documented in tokenformer.py (and dense.py's for the dense baseline)."""
    if (entry := pattention_entry(parameter_name)) is not None:
        return entry[0].component
    if parameter_name.startswith(("word_embeddings.", "position_embeddings.")):
        return "embedding"
    if ".attention." in parameter_name:
        return "attention"
    if ".mlp." in parameter_name:
        return "ffn"
    if parameter_name.startswith("final_linear."):
        return "output"
    if parameter_name.startswith("final_norm.") or "layernorm." in parameter_name:
        return "norms"
    raise ValueError(f"parameter {parameter_name!r} belongs to no known component {COMPONENTS}")


def count_parameters_by_component(model: nn.Module) -> dict[str, int]:
    """{component: count for each of COMPONENTS, "total_params": sum}; tied weights are counted once."""
    counts = dict.fromkeys(COMPONENTS, 0)
    for name, parameter in model.named_parameters():
        counts[component_of(name)] += parameter.numel()
    counts["total_params"] = sum(counts.values())
    return counts
