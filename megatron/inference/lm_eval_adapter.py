"""A TokenFormer behind lm-evaluation-harness's model interface (`lm_eval.api.model.TemplateLM`).

    lm = TokenFormerLM(load_model("demo_run/checkpoints"), tokenizer, batch_size=8)
    lm_eval.simple_evaluate(model=lm, tasks=["piqa"])

- loglikelihood: log P(continuation | context), summed over the continuation's tokens, and whether each of
  them is the argmax; sequences run in batches of `batch_size`, longest first, right-padded (causal attention
  keeps the padding out of every real position). Log-probabilities cover the whole padded vocabulary, as
  the official GPT-NeoX/TokenFormer evaluation computes them. Inputs longer than max_position_embeddings
  keep their last tokens.
- loglikelihood_rolling: the document cut into lm-eval's rolling windows of max_position_embeddings
  tokens (the first predicted from the end-of-document token), each scored as above.
- generate_until: generation with the KV cache (greedy unless `do_sample`), stopped at any of `until`, the
  end-of-document token or max_gen_toks; requests with the same context length and arguments share a batch.
Under tensor parallelism every rank runs the same requests; lm-eval sees a single process.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import TypeVar

import torch
import torch.nn.functional as F
from lm_eval.api.model import TemplateLM
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from megatron.inference.generation import generate
from megatron.inference.sampling import SamplingParams
from megatron.model import TokenFormerModel
from megatron.mpu import gather_from_region
from megatron.tokenizer import AbstractTokenizer

_GENERATION_ARGUMENTS = ("until", "max_gen_toks", "do_sample", "temperature", "top_k", "top_p")
Item = TypeVar("Item")


def _chunks(items: Sequence[Item], size: int) -> list[Sequence[Item]]:
    return [items[start:start + size] for start in range(0, len(items), size)]


class TokenFormerLM(TemplateLM):
    def __init__(self, model: TokenFormerModel, tokenizer: AbstractTokenizer, batch_size: int = 1,
                 max_gen_toks: int = 256, seed: int = 1234, device: str | torch.device = "cpu") -> None:
        super().__init__()
        self.model, self.tokenizer, self.batch_size = model, tokenizer, batch_size
        self.max_length = model.args.max_position_embeddings
        self.max_gen_toks = max_gen_toks
        self._device = torch.device(device)
        self.generator = torch.Generator(self.device).manual_seed(seed)

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eod

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.tokenizer.tokenize(string)

    def tok_decode(self, tokens: list[int]) -> str:
        return self.tokenizer.detokenize(tokens)

    @torch.no_grad()
    def _score(self, sequences: list[tuple[list[int], int]]) -> list[tuple[float, bool]]:
        """For each (tokens, n): log-probability of the last n tokens given those before, and whether all n
        are the most likely tokens."""
        scores: list[tuple[float, bool]] = [(0.0, True)] * len(sequences)
        longest_first = sorted(range(len(sequences)), key=lambda i: -len(sequences[i][0]))
        for chunk in _chunks(longest_first, self.batch_size):
            inputs = [sequences[i][0][-(self.max_length + 1):][:-1] for i in chunk]
            padded = torch.full((len(chunk), len(inputs[0])), self.eot_token_id, dtype=torch.long)
            for row, tokens in enumerate(inputs):
                padded[row, :len(tokens)] = torch.tensor(tokens)
            logits = gather_from_region(self.model(padded.to(self.device)), -1)
            for row, index in enumerate(chunk):
                tokens, count = sequences[index]
                targets = torch.tensor(tokens[-count:], device=self.device)
                end = len(inputs[row])
                log_probs = F.log_softmax(logits[row, end - count:end].float(), dim=-1)
                scores[index] = (log_probs.gather(-1, targets[:, None]).sum().item(),
                                 bool((log_probs.argmax(-1) == targets).all()))
        return scores

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        results = self._score([(context + continuation, len(continuation)) for _, context, continuation in requests])
        for (pair, _, _), result in zip(requests, results):
            self.cache_hook.add_partial("loglikelihood", pair, result)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        totals = []
        for (text,) in (request.args for request in requests):
            windows = [make_disjoint_window(window) for window in get_rolling_token_windows(
                self.tok_encode(text), self.eot_token_id, self.max_length, context_len=1)]
            total = sum(score for score, _ in self._score([(ctx + cont, len(cont)) for ctx, cont in windows]))
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
            totals.append(total)
        return totals

    def _generation_options(self, arguments: dict) -> tuple[tuple[str, ...], int, SamplingParams]:
        unknown = sorted(set(arguments) - set(_GENERATION_ARGUMENTS))
        if unknown:
            raise ValueError(f"generation_kwargs {unknown} are not supported; use {list(_GENERATION_ARGUMENTS)}")
        until = arguments.get("until") or ()
        until = (until,) if isinstance(until, str) else tuple(until)
        sampling = SamplingParams()  # greedy
        if arguments.get("do_sample"):
            sampling = SamplingParams(float(arguments.get("temperature", 1.0)), int(arguments.get("top_k", 0)),
                                      float(arguments.get("top_p", 0.0)))
        return until, int(arguments.get("max_gen_toks", self.max_gen_toks)), sampling

    def _cut_at_stop(self, tokens: list[int], until: tuple[str, ...]) -> str:
        text = self.tok_decode(tokens)
        for stop in until:
            text = text.split(stop)[0]
        return text

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        groups: dict[tuple, list[tuple[int, list[int]]]] = defaultdict(list)
        for index, request in enumerate(requests):
            context, arguments = request.args
            until, max_tokens, sampling = self._generation_options(arguments)
            tokens = (self.tok_encode(context) or [self.eot_token_id])[-max(self.max_length - max_tokens, 1):]
            groups[(len(tokens), until, max_tokens, sampling)].append((index, tokens))
        texts = [""] * len(requests)
        for (_, until, max_tokens, sampling), members in groups.items():
            def reached_stop(tokens: list[int], until: tuple[str, ...] = until) -> bool:
                return any(stop in self.tok_decode(tokens) for stop in until)

            for chunk in _chunks(members, self.batch_size):
                prompts = torch.tensor([tokens for _, tokens in chunk], device=self.device)
                generations = generate(self.model, prompts, max_tokens, sampling, eod=self.eot_token_id,
                                       vocab_size=self.tokenizer.vocab_size, generator=self.generator,
                                       stop=reached_stop if until else None)
                for (index, _), generation in zip(chunk, generations):
                    texts[index] = self._cut_at_stop(generation.tokens, until)
                    self.cache_hook.add_partial("generate_until", requests[index].args, texts[index])
        return texts
