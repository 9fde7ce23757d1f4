"""Character-level language-modelling data, with a corpus generated on the spot.

No download: `default_corpus()` writes a few thousand sentences about a
made-up cluster of workers from a fixed seed, so every machine sees the same
text. `CharDataset` turns any text (or a user's own file) into (input, target)
windows of `block_size` characters, target = input shifted by one. It is a
plain map-style dataset, so `DistributedSampler` shards it across ranks.
"""
from __future__ import annotations

import functools
import random
import string
from pathlib import Path

import torch
from torch.utils.data import Dataset

# 65 symbols: newline, space, punctuation, digits 3, A-Z, a-z (the size of the classic tiny corpus)
ALPHABET = "\n !$&',-.3:;?" + string.ascii_uppercase + string.ascii_lowercase

_SUBJECTS = ["the first worker", "rank three", "the ring", "every replica", "the last stage", "a tired GPU",
             "the optimizer", "our scheduler", "the master weights", "each shard", "the pipeline", "a bucket"]
_VERBS = ["sends", "gathers", "reduces", "waits for", "scatters", "keeps", "frees", "copies", "scales",
          "averages", "splits", "receives"]
_OBJECTS = ["its gradients", "the activations", "one chunk", "the loss", "a micro-batch", "the parameters",
            "half the heads", "the optimizer state", "three buckets", "the next layer", "a message", "the bubble"]
_ENDINGS = [".", ".", ".", "!", "?", "; then it rests.", ", and nobody waits.", ", as the lecture said."]


@functools.lru_cache(maxsize=1)
def corpus_length() -> int:
    """Characters in `default_corpus()`: the longest window a model trained on it can see, less one."""
    return len(default_corpus())


def default_corpus(n_sentences: int = 3000, seed: int = 1234) -> str:
    """A deterministic, learnable text drawn from a small grammar (every character is in ALPHABET)."""
    rng = random.Random(seed)
    lines = []
    for i in range(n_sentences):
        s = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}{rng.choice(_ENDINGS)}"
        lines.append(s[0].upper() + s[1:])
        if i % 7 == 6:
            lines.append("\n")
    return " ".join(lines).replace(" \n ", "\n")


class CharDataset(Dataset):
    """Windows of `block_size` characters: item i is (text[i:i+T], text[i+1:i+T+1]) as token ids."""

    def __init__(self, text: str | None = None, block_size: int = 32, path: str | Path | None = None,
                 vocab: str | None = None):
        where = f"{path}: " if path is not None else ""
        if path is not None:
            try:
                text = Path(path).read_text(encoding="utf-8")
            except UnicodeDecodeError:
                raise ValueError(f"{where}not UTF-8 text: give a text file") from None
        if text is None:
            text, vocab = default_corpus(), vocab or ALPHABET
        self.vocab = vocab or "".join(sorted(set(text)))
        unknown = set(text) - set(self.vocab)
        if unknown:
            raise ValueError(f"{where}characters not in the vocabulary: {''.join(sorted(unknown))!r}")
        if len(text) <= block_size:
            raise ValueError(f"{where}text of {len(text)} characters is too short for block_size {block_size}: give "
                             f"a longer text or a smaller block_size")
        self.stoi = {c: i for i, c in enumerate(self.vocab)}
        self.block_size = block_size
        self.ids = torch.tensor([self.stoi[c] for c in text], dtype=torch.long)

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def __len__(self) -> int:
        return len(self.ids) - self.block_size

    def __getitem__(self, i):
        chunk = self.ids[i: i + self.block_size + 1]
        return chunk[:-1], chunk[1:]

    def decode(self, ids) -> str:
        return "".join(self.vocab[int(i)] for i in ids)


def global_batches(dataset: Dataset, batch_size: int, steps: int, seed: int = 0):
    """The batches a single process would train on: `steps` batches of `batch_size` from one shuffled order.

    Rank r of N with `DistributedSampler(shuffle=True, seed=seed, drop_last=True)` and per-rank batch
    `batch_size // N` sees exactly the rows r, r+N, r+2N, ... of the global batch built here, which is
    why data-parallel training can be compared with this single-process reference.
    """
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(dataset), generator=g).tolist()
    for s in range(steps):
        idx = order[s * batch_size:(s + 1) * batch_size]
        xs, ys = zip(*(dataset[i] for i in idx))
        yield torch.stack(xs), torch.stack(ys)
