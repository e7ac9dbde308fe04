"""A word-level tokenizer with exactly a preset's vocabulary size, written offline (the GPU host has no
downloads): token i is the word `w<i>`, so random token ids decode to text that encodes back to the same
ids one for one. Lets `kiln serve` on a dummy-weight preset take text, stream text, and be timed by
`kiln bench serve` with exact prompt lengths, through the same tokenize/detokenize path as a real model.
"""

from __future__ import annotations

from pathlib import Path


def write_synthetic_tokenizer(path: str | Path, vocab_size: int, bos_token_id: int | None = None,
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
