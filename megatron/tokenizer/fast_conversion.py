"""A run's tokenizer as a `tokenizers.Tokenizer` (what a Hugging Face tokenizer.json holds), for exports.

HFTokenizer and GPT2BPETokenizer already are one. A SentencePiece model is rebuilt from its protobuf: the same
pieces and scores (unigram) or the merges its pieces imply (BPE), its normaliser's steps (the precompiled
character map, whitespace clean-up, the dummy prefix, whitespace escaped as ▁) and byte fallback. Pieces that
SentencePiece never matches in text (control, unknown, unused, byte pieces) get a score no path would choose.
SentencePiece has settings a tokenizer.json cannot express, so `verified` checks a conversion on a sample
text and says where it first differs; an export writes no tokenizer that fails it.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers

from megatron.cli import InputError
from megatron.tokenizer.abstract_tokenizer import AbstractTokenizer
from megatron.tokenizer.gpt2_bpe_tokenizer import GPT2BPETokenizer
from megatron.tokenizer.hf_tokenizer import HFTokenizer
from megatron.tokenizer.spm_tokenizer import SPMTokenizer

# sentencepiece_model.proto: ModelProto.SentencePiece.Type and TrainerSpec.ModelType
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
UNIGRAM, BPE = 1, 2
NEVER_MATCHED = -1e9  # the score of pieces SentencePiece never matches in text
SPACE = "▁"

# Text an exported tokenizer must encode as the run's does: whitespace runs and edges, newlines and tabs,
# digits, punctuation, accents, other scripts and emoji (byte fallback), code.
CHECK_TEXT = ("  Leading spaces,\ttabs and   runs of spaces;\nnew lines\n\n  and trailing ones.  \n"
              "Numbers 3.14159, 2026-11-25, 1,000,000 and $42.00! Punctuation: (a) [b] {c} <d> \"e\" 'f' — g… "
              "Accents: café, naïve, Ærøskøbing, ß∂ƒ. Other scripts: Ελληνικά, русский, 日本語, 한국어, العربية. "
              "Emoji: 🙂🚀. Code: def f(x):\n    return x ** 2  # squared\n")


def fast_tokenizer(tokenizer: AbstractTokenizer) -> Tokenizer:
    """The `tokenizers.Tokenizer` that encodes as `tokenizer` does; ValueError if the kind has none."""
    if isinstance(tokenizer, HFTokenizer | GPT2BPETokenizer):
        return tokenizer.backend
    if isinstance(tokenizer, SPMTokenizer):
        return from_sentencepiece(tokenizer.model_file)
    raise ValueError(f"{type(tokenizer).__name__} has no tokenizer.json form")


def verified(tokenizer: AbstractTokenizer, fast: Tokenizer) -> str | None:
    """None if `fast` encodes CHECK_TEXT (whole and line by line) to the ids `tokenizer` gives and decodes them
    back to its text; else where it first differs."""
    for text in (CHECK_TEXT, *CHECK_TEXT.splitlines(keepends=True)):
        expected, got = tokenizer.tokenize(text), fast.encode(text, add_special_tokens=False).ids
        if got != expected:
            at = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), min(len(got), len(expected)))
            return f"encoding {text[:40]!r} differs at token {at} ({got[at:at + 3]} instead of {expected[at:at + 3]})"
        decoded, wanted = fast.decode(expected, skip_special_tokens=False), tokenizer.detokenize(expected)
        if decoded != wanted:
            at = next((i for i, (a, b) in enumerate(zip(decoded, wanted)) if a != b), min(len(decoded), len(wanted)))
            return f"decoding {text[:40]!r} gives {decoded[at:at + 20]!r} instead of {wanted[at:at + 20]!r}"
    return None


def from_sentencepiece(model_file: str | Path) -> Tokenizer:
    """A SentencePiece .model (unigram or BPE) as a `tokenizers.Tokenizer`."""
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(Path(model_file).read_bytes())
    spec, normalizer = proto.trainer_spec, proto.normalizer_spec
    pieces = [(p.piece, p.score if p.type in (NORMAL, USER_DEFINED) else NEVER_MATCHED) for p in proto.pieces]
    if spec.model_type == UNIGRAM:
        model = models.Unigram(pieces, unk_id=spec.unk_id, byte_fallback=spec.byte_fallback)
    elif spec.model_type == BPE:
        mergeable = {p.piece for p in proto.pieces if p.type in (NORMAL, USER_DEFINED)}
        model = models.BPE({piece: i for i, (piece, _) in enumerate(pieces)}, _bpe_merges(pieces, mergeable),
                           unk_token=proto.pieces[spec.unk_id].piece, fuse_unk=True, byte_fallback=spec.byte_fallback)
    else:
        raise InputError(f"{model_file}: SentencePiece model type {spec.model_type} is neither unigram nor BPE")
    fast = Tokenizer(model)
    steps = [normalizers.Precompiled(normalizer.precompiled_charsmap)] if normalizer.precompiled_charsmap else []
    if normalizer.remove_extra_whitespaces:
        steps += [normalizers.Strip(), normalizers.Replace(Regex(" {2,}"), " ")]
    if normalizer.add_dummy_prefix:
        steps.append(normalizers.Prepend(SPACE))
    if normalizer.escape_whitespaces:
        steps.append(normalizers.Replace(" ", SPACE))
    if steps:
        fast.normalizer = normalizers.Sequence(steps)
    unknown = proto.pieces[spec.unk_id].piece
    decoding = [decoders.Replace(unknown, spec.unk_surface), decoders.Replace(SPACE, " "),
                *([decoders.ByteFallback()] if spec.byte_fallback else []),
                decoders.Fuse()]  # one string: the prefix is stripped from the text, not from every token
    if normalizer.add_dummy_prefix:
        decoding.append(decoders.Strip(content=" ", left=1, right=0))
    fast.decoder = decoders.Sequence(decoding)
    fast.add_tokens([AddedToken(p.piece, normalized=False, special=False) for p in proto.pieces
                     if p.type == USER_DEFINED])
    return fast


def _bpe_merges(pieces: list[tuple[str, float]], mergeable: set[str]) -> list[tuple[str, str]]:
    """SentencePiece BPE merges the pair whose result scores highest: every split of a piece into two pieces,
    ordered by the result's rank, then the parts'."""
    rank = {piece: i for i, (piece, _) in enumerate(pieces)}
    merges = [(rank[piece], rank[piece[:cut]], rank[piece[cut:]], piece[:cut], piece[cut:])
              for piece in mergeable for cut in range(1, len(piece))
              if piece[:cut] in mergeable and piece[cut:] in mergeable]
    return [(left, right) for *_, left, right in sorted(merges)]
