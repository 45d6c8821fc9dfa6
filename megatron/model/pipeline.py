"""TokenFormer as a DeepSpeed PipelineModule: TokenFormerModel's computation as a list of layers that
DeepSpeed's pipeline engine cuts into stages (docs/parallelism.md).

The list is numbered as GPT-NeoX (and the official TokenFormer release) number their pipeline, so layer i
of a checkpoint is the file `layer_{i:02d}-model_{tensor rank:02d}-model_states.pt` holding these keys:

    i          layer                   keys in its file                       TokenFormerModel name
    0          EmbeddingPipe           word_embeddings.weight                 the same
                                       position_embeddings.weight (learned)   the same
    1          pass-through            -                                      (GPT-NeoX transposes here)
    2 .. L+1   TransformerLayerPipe    attention.query.key_param_tokens, ...  layers.{i-2}.<key>
    L+2        pass-through            -
    L+3        NormPipe                norm.weight, norm.bias                 final_norm.weight, .bias
    L+4        tied:   EmbeddingPipe.logits   (none: layer 0's weight; the last stage's copy is kept equal)
               untied: OutputPipe      final_linear.weight                    the same

Parameters are initialised once the stages are built, each from its TokenFormerModel name, so a stage
holds exactly the values of those parameters in the single-stage model.
"""

from collections.abc import Callable

import torch
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from deepspeed.runtime.pipe.topology import ProcessTopology
from torch import Tensor, nn

from megatron import mpu
from megatron.model.args import TokenFormerArgs
from megatron.model.embedding import embed, input_embeddings
from megatron.model.init_methods import initialize_parameters, parameter_roles
from megatron.model.layer import TokenFormerLayer
from megatron.model.norms import make_layer_norm
from megatron.model.tokenformer import TokenFormerModel

_TIED_EMBEDDING = "embed"


class EmbeddingPipe(nn.Module):
    """Layer 0, token ids [b, s] -> hidden [b, s, d]; with tied weights also the last layer (`logits`)."""

    def __init__(self, args: TokenFormerArgs) -> None:
        super().__init__()
        self.args = args
        self.word_embeddings, self.position_embeddings = input_embeddings(args)

    def forward(self, tokens: Tensor) -> Tensor:
        return embed(tokens, self.word_embeddings, self.position_embeddings, self.args, self.training)

    def logits(self, hidden: Tensor) -> Tensor:
        return mpu.vocab_parallel_logits(hidden, self.word_embeddings.weight)


class TransformerLayerPipe(TokenFormerLayer):
    """One TokenFormer block as a pipeline layer. The name is what `pipe_partition_method: type:REGEX` and
    activation checkpointing select; GPT-NeoX's default `type:transformer|mlp` matches it."""


class NormPipe(nn.Module):
    """The final layer norm, under GPT-NeoX's key `norm`."""

    def __init__(self, args: TokenFormerArgs) -> None:
        super().__init__()
        self.norm = make_layer_norm(args.final_norm, args.hidden_size, args.layernorm_epsilon)

    def forward(self, hidden: Tensor) -> Tensor:
        return self.norm(hidden)


class OutputPipe(nn.Module):
    """The untied output layer: hidden [b, s, d] -> this rank's vocabulary block of the logits."""

    def __init__(self, args: TokenFormerArgs) -> None:
        super().__init__()
        self.final_linear = mpu.VocabParallelOutput(args.hidden_size, args.padded_vocab_size)

    def forward(self, hidden: Tensor) -> Tensor:
        return self.final_linear(hidden)


def pass_through(hidden: Tensor) -> Tensor:
    """Layers 1 and L+2: GPT-NeoX transposes activations there; keeping the places keeps its numbering."""
    return hidden


def layer_specs(args: TokenFormerArgs) -> list:
    """The layer list of the module docstring, as DeepSpeed specs (each stage builds only its own)."""
    if args.no_weight_tying:
        embedding, output = LayerSpec(EmbeddingPipe, args), LayerSpec(OutputPipe, args)
    else:
        tied = ["word_embeddings.weight"]
        embedding = TiedLayerSpec(_TIED_EMBEDDING, EmbeddingPipe, args, tied_weight_attr=tied)
        output = TiedLayerSpec(_TIED_EMBEDDING, EmbeddingPipe, args, forward_fn=EmbeddingPipe.logits,
                               tied_weight_attr=tied)
    layers = [LayerSpec(TransformerLayerPipe, args) for _ in range(args.num_layers)]
    return [embedding, pass_through, *layers, pass_through, LayerSpec(NormPipe, args), output]


def model_parameter_name(layer_index: int, key: str, num_layers: int) -> str:
    """TokenFormerModel's name of entry `key` of pipeline layer `layer_index` (the table above)."""
    if 2 <= layer_index < num_layers + 2:
        return f"layers.{layer_index - 2}.{key}"
    if layer_index == num_layers + 3:
        return "final_norm." + key.removeprefix("norm.")
    return key


def pipeline_place(name: str, num_layers: int) -> tuple[int, str]:
    """(pipeline layer, key in its layer) of TokenFormerModel entry `name`: model_parameter_name inverted, for
    writers of pipeline checkpoints (one file per layer)."""
    head, _, rest = name.partition(".")
    if head == "layers":
        index, _, key = rest.partition(".")
        place = (int(index) + 2, key)
    elif head == "final_norm":
        place = (num_layers + 3, f"norm.{rest}")
    else:
        place = (num_layers + 4 if head == "final_linear" else 0, name)
    assert model_parameter_name(*place, num_layers) == name, name
    return place


def pipeline_parameter_model_name(pipeline_name: str, num_layers: int) -> str:
    """TokenFormerModel's name of a PipelineModule parameter: DeepSpeed registers layer i as child `i`,
    and a tied layer (the embedding, layer 0) under `tied_modules.<key>`."""
    head, _, rest = pipeline_name.partition(".")
    if head == "tied_modules":
        return rest.partition(".")[2]
    return model_parameter_name(int(head), rest, num_layers)


def build_pipeline(args: TokenFormerArgs, topology: ProcessTopology, loss_fn: Callable[[Tensor, Tensor], Tensor],
                   partition_method: str) -> PipelineModule:
    """This rank's stage of the TokenFormer pipeline, initialised as the single-stage model is.

    With activation checkpointing, runs of `checkpoint_num_layers` TransformerLayerPipes are recomputed in the
    backward pass (mpu.checkpoint, which replays the tensor-parallel dropout stream).
    """
    # DeepSpeed broadcasts the tied weight in place; outside no_grad autograd would record the broadcast
    # (which has no backward) into the weight's history.
    with torch.no_grad():
        pipeline = PipelineModule(
            layers=layer_specs(args),
            topology=topology,
            loss_fn=loss_fn,
            partition_method=partition_method,
            activation_checkpoint_interval=args.checkpoint_num_layers if args.checkpoint_activations else 0,
            activation_checkpoint_func=mpu.checkpoint,
            checkpointable_layers=[TransformerLayerPipe.__name__],
        )
    names = {name: pipeline_parameter_model_name(name, args.num_layers) for name, _ in pipeline.named_parameters()}
    roles = parameter_roles(TokenFormerModel(args, device="meta"))
    initialize_parameters(pipeline, args.seed, args, model_names=names, model_roles=roles)
    return pipeline
