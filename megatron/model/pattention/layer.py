"""The Pattention layer, usable on its own in any PyTorch code: no process group, no config.

    from megatron.model.pattention import Pattention
    layer = Pattention(d_in, d_out, n)        # theta="l2_norm_gelu", impl="fused", keys and values N(0, 0.02²)
    y = layer(x)                              # x [..., d_in] -> [..., d_out], whatever the leading dimensions
    layer.grow(2 * n)                         # twice the parameter tokens, as the official code grows them

The parameters keep the official names, `key_param_tokens` [n, d_in] and `value_param_tokens` [n, d_out];
the int64 buffer `norm_token_count` (the n of Θ's √n and ·n) is saved in the state_dict with them. Sizes and
every input are checked at the boundary, each problem one error naming it (boundary.py); under torch.autocast
the layer computes in autocast's dtype, as an nn.Linear does.

The default implementation is `fused`: the plain formula's values and gradients with a third of its activation
memory, the fastest wherever the [tokens, n] scores fit (benchmarks/RESULTS.md), and nothing to install
beyond torch. `flash` keeps no score matrix, for when they do not fit; `plain` is the reference and supports
double backward. A model built outside training takes fused for `pattention_impl: auto` too
(TokenFormerArgs.from_config); the framework passes its configured implementation, so this default does not
change what a training run computes.
"""

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from megatron.model.args import DEFAULT_GROWTH_MODE, FLASH_BACKENDS, GROWTH_MODES, PATTENTION_IMPLS
from megatron.model.pattention.boundary import checked_dtype, checked_input, checked_int, checked_positive_finite
from megatron.model.pattention.grown_parameters import append_rows
from megatron.model.pattention.registry import check_choice, pattentions_function
from megatron.model.pattention.theta import Reduce, check_theta, identity

DEFAULT_IMPL = "fused"
# Stand-alone initialisation of keys and values: N(0, INIT_STD²), GPT-NeoX's `init_method_std` default drawn by
# the official `normal` init method. In a TokenFormerModel, initialize_parameters redraws every parameter from
# the config's init methods and seed.
INIT_STD = 0.02


def _draw_init(tensor: Tensor) -> None:
    """Fill `tensor` from the stand-alone init; on the meta device there is nothing to draw."""
    if not tensor.is_meta:
        nn.init.normal_(tensor, mean=0.0, std=INIT_STD)


class Pattention(nn.Module):
    """A Pattention layer d_in -> d_out with n key/value parameter tokens: Θ(τ · x · K_Pᵀ) · V_P.

    `theta` is Θ (theta.py: l2_norm_gelu, gelu_l2_norm or softmax), `tau` the score scale τ. `norm_token_count`
    is the n Θ normalises by, `n` unless given (a tensor-parallel block holds fewer tokens than the layer it
    normalises as). `impl` and `flash_backend` choose how it is computed (registry.py); `device` and `dtype` where
    the parameter tokens are made, as for nn.Linear.
    """

    def __init__(
        self,
        d_in: int,
        d_out: int,
        n: int,
        theta: str = "l2_norm_gelu",
        tau: float = 1.0,
        *,
        impl: str = DEFAULT_IMPL,
        flash_backend: str = "auto",
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
        norm_token_count: int | None = None,
    ) -> None:
        super().__init__()
        d_in = checked_int(f"Pattention(d_in={d_in!r})", d_in, "the width of the input")
        d_out = checked_int(f"Pattention(d_out={d_out!r})", d_out, "the width of the output")
        n = checked_int(f"Pattention(n={n!r})", n, "the number of parameter tokens")
        if norm_token_count is not None:
            norm_token_count = checked_int(f"Pattention(norm_token_count={norm_token_count!r})", norm_token_count,
                                           "the n that Θ normalises by")
        tau = checked_positive_finite(f"Pattention(tau={tau!r})", tau, "the score scale")
        dtype = checked_dtype(f"Pattention(dtype={dtype!r})", dtype)
        check_theta(theta)
        check_choice("pattention_impl", impl, PATTENTION_IMPLS)
        check_choice("flash_backend", flash_backend, FLASH_BACKENDS)
        self.theta = theta
        self.tau = tau
        self.impl = impl
        self.flash_backend = flash_backend
        self.key_param_tokens = nn.Parameter(torch.empty(n, d_in, device=device, dtype=dtype))
        self.value_param_tokens = nn.Parameter(torch.empty(n, d_out, device=device, dtype=dtype))
        self.register_buffer("norm_token_count", torch.tensor(n if norm_token_count is None else norm_token_count,
                                                              dtype=torch.int64, device=device))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Keys and values drawn from N(0, INIT_STD²), so that a layer is usable right after construction."""
        _draw_init(self.key_param_tokens)
        _draw_init(self.value_param_tokens)

    def grow(self, new_count: int, mode: str = DEFAULT_GROWTH_MODE) -> None:
        """Append parameter tokens up to `new_count`, as docs/growth.md's two modes grow a checkpoint:

            official  (the default, as growth_mode) new keys and values from the init, `norm_token_count` =
                      new_count, as the official code normalises by its current token count: the function changes
            preserve  new keys zero, new values from the init, `norm_token_count` kept: the l2 variants compute
                      the same function (a zero key scores 0, which adds nothing to ‖A‖₂, and GeLU(0) = 0)

        The token matrices keep their Parameter objects and gain rows (grown_parameters.py): an optimizer built
        before trains the new tokens too, and one that already holds state of the old size is refused at its next
        step. Shrinking is refused, and so is preserve growth of softmax, which no new keys keep unchanged.
        """
        check_choice("mode", mode, GROWTH_MODES)
        new_count = checked_int(f"grow(new_count={new_count!r})", new_count, "the new number of parameter tokens",
                                positive=False)
        old_count = len(self.key_param_tokens)
        if new_count < old_count:
            raise ValueError(f"grow(new_count={new_count}): the layer has {old_count} parameter tokens, and growth "
                             "only appends tokens; build a smaller layer instead of shrinking this one")
        if mode == "preserve" and self.theta == "softmax":
            raise ValueError("grow(mode='preserve') of a softmax Pattention: a new token scores the same for every "
                             "input whatever its key (zero: exp(0) = 1), so it takes softmax mass from the old tokens "
                             "and the function changes; use an l2 theta, or mode='official' (the function changes)")
        extra = new_count - old_count
        keys = self.key_param_tokens.new_zeros(extra, self.key_param_tokens.shape[1])
        values = self.value_param_tokens.new_empty(extra, self.value_param_tokens.shape[1])
        _draw_init(values)
        if mode == "official":
            _draw_init(keys)
            self.norm_token_count.fill_(new_count)
        with torch.no_grad():
            append_rows(self.key_param_tokens, keys)
            append_rows(self.value_param_tokens, values)

    def run(self, layers: Sequence["Pattention"], x: Tensor, reduce_sum: Reduce = identity,
            reduce_max: Reduce = identity) -> Tensor:
        """`layers` (this one's settings; equal shapes) on the same input x: [len(layers), ..., d_out]."""
        keys, values = [p.key_param_tokens for p in layers], [p.value_param_tokens for p in layers]
        autocast = checked_input(x, keys[0].shape[1], keys[0].dtype)
        compute = pattentions_function(self.impl, self.flash_backend)
        counts = [p.norm_token_count for p in layers]
        if autocast is None:
            return compute(x, keys, values, self.theta, self.tau, counts, reduce_sum, reduce_max)
        # As torch.autocast runs an nn.Linear: input and tokens cast to its dtype, their gradients flowing back.
        with torch.autocast(x.device.type, enabled=False):
            return compute(x.to(autocast), [k.to(autocast) for k in keys], [v.to(autocast) for v in values],
                           self.theta, self.tau, counts, reduce_sum, reduce_max)

    def forward(self, x: Tensor) -> Tensor:
        """x [..., d_in] -> [..., d_out]."""
        return self.run([self], x).squeeze(0)

    def extra_repr(self) -> str:
        n, d_in = self.key_param_tokens.shape
        return (f"{d_in} -> {self.value_param_tokens.shape[1]}, tokens={n}, theta={self.theta}, tau={self.tau}, "
                f"impl={self.impl}")
