"""A word-level tokenizer for the demo's random models: one made-up word per token id, built locally.

Nothing can be downloaded here, yet vLLM's OpenAI-compatible server should take text as it does for any model.
A word-level vocabulary makes every prompt's token count exact (one word = one token, no special tokens added),
so tests can say exactly how many tokens LMCache must hit. Ids below ``FIRST_WORD_ID`` are Gemma's special
tokens (pad 0, eos 1, bos 2, unk 3) and reserved ones.
"""

from __future__ import annotations

import itertools
from pathlib import Path

WORD_TOKENIZER = "words-v1"
FIRST_WORD_ID = 16
SPECIAL_TOKENS = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3}
_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"


def word(token_id: int) -> str:
    """The word of a (non-special) token id: syllables spelling the id, so every id has its own word."""
    if token_id < FIRST_WORD_ID:
        raise ValueError(f"token ids below {FIRST_WORD_ID} are special or reserved, got {token_id}")
    syllables = [c + v for c, v in itertools.product(_CONSONANTS, _VOWELS)]
    n, parts = token_id, []
    while True:
        n, digit = divmod(n, len(syllables))
        parts.append(syllables[digit])
        if n == 0:
            return "".join(reversed(parts))
        n -= 1  # bijective numbering: no two ids share a spelling, whatever their length


def text_of(token_ids: list[int]) -> str:
    """The text whose tokenization is exactly ``token_ids``."""
    return " ".join(word(t) for t in token_ids)


def save_word_tokenizer(folder: Path, vocab_size: int) -> None:
    """Write ``tokenizer.json`` and its Hugging Face config into ``folder`` (ids 0..vocab_size-1)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {name: index for name, index in SPECIAL_TOKENS.items()}
    vocab.update({f"<reserved{i}>": i for i in range(len(SPECIAL_TOKENS), FIRST_WORD_ID)})
    vocab.update({word(i): i for i in range(FIRST_WORD_ID, vocab_size)})
    if len(vocab) != vocab_size:
        raise AssertionError(f"word spelling collided: {vocab_size - len(vocab)} ids share a word")
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>",
                                        bos_token="<bos>", unk_token="<unk>", clean_up_tokenization_spaces=False)
    tokenizer.save_pretrained(folder)
