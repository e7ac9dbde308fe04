"""Made-up tokenizers of a real model's vocabulary size, for checkpoints of random weights (nothing is
downloaded on the GPU host).

- `write_bpe_tokenizer`: a byte-level BPE of Llama-3's size (128,000 BPE tokens from 127,744 merges, plus
  256 special tokens). Start-up benchmarks load a tokenizer because a user's start does, and parsing and
  building this one costs about what the real one does. The merges are arbitrary (seeded).
- `write_word_tokenizer`: token i is the word `w<i>`, so random token ids decode to text that encodes back
  to the same ids one for one. Lets `kiln serve` on a dummy-weight preset take text, stream text, and be
  timed by `kiln bench serve` with exact prompt lengths, through the real tokenize/detokenize path.
"""

from __future__ import annotations

import random
from pathlib import Path


def write_bpe_tokenizer(directory: str | Path, vocab_size: int, num_special: int = 256,
                              bos_token_id: int | None = None, eos_token_id: int | None = None,
                              seed: int = 0) -> None:
    """Write tokenizer.json + tokenizer_config.json: BPE tokens, then up to num_special special tokens (fewer
    when the vocabulary has no room beyond the 256 byte tokens, as in the tiny test presets)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    if vocab_size < len(alphabet):
        raise ValueError(f"vocab_size {vocab_size} is below the {len(alphabet)} byte tokens")
    num_special = min(num_special, vocab_size - len(alphabet))
    bpe_size = vocab_size - num_special
    vocab = {token: i for i, token in enumerate(alphabet)}
    growable = list(alphabet)  # tokens short enough to be merged further
    merges: list[tuple[str, str]] = []
    rng = random.Random(seed)
    while len(vocab) < bpe_size:
        # real merges mostly extend a piece by a byte or a short piece; tokens stop growing at 8 bytes
        left = growable[rng.randrange(len(growable))]
        right = alphabet[rng.randrange(len(alphabet))] if rng.random() < 0.7 else growable[rng.randrange(len(growable))]
        merged = left + right
        if merged in vocab or len(merged) > 8:
            continue
        vocab[merged] = len(vocab)
        merges.append((left, right))
        if len(merged) < 8:
            growable.append(merged)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = [f"<|reserved_special_token_{i}|>" for i in range(num_special)]
    tok.add_special_tokens(specials)
    by_id = list(vocab) + specials  # vocab's insertion order is its ids
    names = {}
    if bos_token_id is not None:
        names["bos_token"] = by_id[bos_token_id]
    if eos_token_id is not None:
        names["eos_token"] = by_id[eos_token_id]
    PreTrainedTokenizerFast(tokenizer_object=tok, **names).save_pretrained(str(directory))


def write_word_tokenizer(path: str | Path, vocab_size: int, bos_token_id: int | None = None,
                              eos_token_id: int | None = None) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    path = Path(path)
    # special tokens get names that cannot occur inside a word: HF matches added tokens anywhere in the text,
    # so an eos named "w2" would split "w251" into "w2" + "51"
    names = {0: "<unk>"}
    if bos_token_id is not None:
        names[bos_token_id] = "<bos>"
    if eos_token_id is not None:
        names[eos_token_id] = "<eos>"
    vocab = {names.get(i, f"w{i}"): i for i in range(vocab_size)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=names[0]))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with single spaces
    special = {"unk_token": names[0]}
    if bos_token_id is not None:
        special["bos_token"] = names[bos_token_id]
    if eos_token_id is not None:
        special["eos_token"] = names[eos_token_id]
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, **special)
    tokenizer.save_pretrained(str(path))
    return path
