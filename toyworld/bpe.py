"""
toyworld/bpe.py -- learn a small byte-level BPE from the toy world's captions, and write it in
OpenAI's merges-file format so that `clip_model.SimpleTokenizer(path)` reads it unchanged.

    1. pre-tokenisation ... clip_model.SimpleTokenizer's own cleaning, regex and byte map
    2. training ........... the classic BPE loop (Sennrich et al., 2016): count adjacent symbol
                            pairs over the corpus's words, merge the most frequent, repeat
    3. the file ........... "#version: ..." then one "left right" merge per line, gzipped

Why learn one: CLIP's own 49k-merge file is not available offline, and 49,408 token embeddings
would be most of a 1M-parameter model. Ours has a few hundred merges, one token per corpus word.

Try it:  python -m toyworld.bpe /tmp/toy_bpe.txt.gz
"""

from __future__ import annotations

import gzip
import sys
from collections import Counter
from typing import Iterable

import regex as re

import clip_model

VERSION_LINE = "#version: toy world BPE (dear-from-scratch toyworld/bpe.py)"
_BYTE_ENCODER = clip_model.bytes_to_unicode()  # byte value -> printable character
MAX_MERGES = 2000  # train_bpe stops there (the toy corpus runs out of pairs long before)


# ---- 1. Pre-tokenisation: exactly what SimpleTokenizer.encode does before its merges -----
def words_of(text: str) -> list[str]:
    """Text -> the words SimpleTokenizer would apply merges to, each spelled in
    bytes_to_unicode characters ("a red circle." -> ["a", "red", "circle", "."])."""
    cleaned = clip_model.whitespace_clean(clip_model.basic_clean(text)).lower()
    return ["".join(_BYTE_ENCODER[b] for b in word.encode("utf-8"))
            for word in re.findall(clip_model.PRETOKENIZE, cleaned)]


# ---- 2. Training -------------------------------------------------------------------------
def train_bpe(texts: Iterable[str]) -> list[tuple[str, str]]:
    """Learn merges from `texts`, most useful first.

    Each distinct word starts as its characters, the last one marked as a word end
    ("red" -> r, e, d</w>), the form SimpleTokenizer.bpe starts from. Then, until no word has
    two symbols left (or MAX_MERGES are made): count every adjacent pair, weighted by how
    often its word occurs; merge the most frequent pair everywhere (by SimpleTokenizer's own
    rule, clip_model.merge_pair); record it. Ties go to the alphabetically smallest pair, so
    the same corpus always gives the same file.
    """
    word_counts = Counter(word for text in texts for word in words_of(text))
    spelled = {tuple(word[:-1]) + (word[-1] + "</w>",): count for word, count in word_counts.items()}
    merges: list[tuple[str, str]] = []
    while len(merges) < MAX_MERGES:
        pair_counts: Counter = Counter()
        for symbols, count in spelled.items():
            for pair in zip(symbols, symbols[1:]):
                pair_counts[pair] += count
        if not pair_counts:
            break  # every word is one symbol: nothing left to merge
        best = min(pair_counts, key=lambda pair: (-pair_counts[pair], pair))
        merges.append(best)
        spelled = {tuple(clip_model.merge_pair(symbols, best)): count for symbols, count in spelled.items()}
    return merges


# ---- 3. The merges file (OpenAI's bpe_simple_vocab_16e6.txt.gz format) -------------------
def write_bpe(texts: Iterable[str], path: str) -> int:
    """Learn merges from `texts` and write them to `path` (gzipped if it ends in .gz),
    atomically. Returns the vocabulary size SimpleTokenizer will have: 512 + merges + 2."""
    merges = train_bpe(texts)
    assert len(merges) <= clip_model._MAX_MERGES, "SimpleTokenizer would ignore merges past its limit"
    text = "\n".join([VERSION_LINE] + [f"{left} {right}" for left, right in merges]) + "\n"

    def write(temporary: str) -> None:
        with open(temporary, "wb") as f:
            if not path.endswith(".gz"):
                f.write(text.encode("utf-8"))
                return
            # No file name and no time in the gzip header: the same merges give the same bytes,
            # so the file's SHA-256 names it (the shipped model's BPE is checked so).
            with gzip.GzipFile(filename="", mode="wb", fileobj=f, mtime=0) as packed:
                packed.write(text.encode("utf-8"))

    clip_model.atomic_write(path, write)
    return 2 * 256 + len(merges) + 2


if __name__ == "__main__":
    from toyworld.world import corpus

    target = sys.argv[1] if len(sys.argv) > 1 else "toy_bpe.txt.gz"
    vocab_size = write_bpe(corpus(), target)
    tokenizer = clip_model.SimpleTokenizer(target)
    example = "a photo of a small red striped circle at the top left on a dark background."
    print(f"{target}: vocabulary {vocab_size} (tokenizer says {tokenizer.vocab_size})")
    print(f"{example!r} -> {tokenizer.encode(example)}")
