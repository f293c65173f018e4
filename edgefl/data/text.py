"""A tiny generated character corpus for next-character language modelling (``"text"``).

A seeded pseudo-language shared by all devices: ``vocab - 2`` letters spelled by a sparse
letter-bigram chain into a lexicon of words, and a sparse word-bigram chain that strings
words into sentences. Symbol 0 is a space and symbol 1 a full stop. Each device is an
"author" whose word transitions mix the shared chain with a personal topic preference and
who ends sentences at a personal rate, so devices are non-IID but speak the same language.

A device's text is ``chars_per_device`` symbols cut into non-overlapping windows of
``seq_len``: ``x = tokens[t : t + T]``, ``y = tokens[t + 1 : t + T + 1]`` (int64).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch.utils.data import TensorDataset

from edgefl.data._args import Args
from edgefl.data.base import DOMAIN_TEXT, DataInfo, FederatedDataset, stream_rng

ACCEPTED_ARGS = ["seq_len", "vocab", "chars_per_device", "test_sequences"]
SYMBOLS = " ." + "abcdefghijklmnopqrstuvwxyz" + "ABCDEFGHIJKLMNOPQRSTUVWXYZ" + "0123456789"
SPACE, STOP = 0, 1
NUM_WORDS = 150
_LANGUAGE, _AUTHOR, _TRAIN, _TEST = 1, 2, 3, 4


def decode(tokens: Any, vocab: int = 30) -> str:
    """Render token ids as text (space, full stop, then letters), for inspection."""
    table = SYMBOLS[:vocab]
    return "".join(table[int(t)] for t in np.asarray(tokens).reshape(-1))


class _Language:
    """The shared lexicon and word chain, a pure function of ``(seed, vocab)``."""

    def __init__(self, seed: int, vocab: int) -> None:
        rng = stream_rng(seed, DOMAIN_TEXT, _LANGUAGE)
        letters = vocab - 2
        # Letter chain: row ``letters`` is the word-start distribution.
        letter_next = rng.dirichlet(np.full(letters, 0.3), size=letters + 1)
        letter_cdf = np.cumsum(letter_next, axis=1)
        self.words: list[np.ndarray] = []
        for _ in range(NUM_WORDS):
            length = int(rng.integers(1, 8))
            prev = letters
            spelled = []
            for _ in range(length):
                prev = _draw(letter_cdf[prev], rng.random())
                spelled.append(prev + 2)
            self.words.append(np.array(spelled, dtype=np.int64))
        zipf = 1.0 / np.arange(1, NUM_WORDS + 1)
        self.start = rng.permutation(zipf / zipf.sum())
        self.word_next = rng.dirichlet(np.full(NUM_WORDS, 0.05), size=NUM_WORDS)


def _draw(cdf: np.ndarray, u: float) -> int:
    return min(int(np.searchsorted(cdf, u * cdf[-1], side="right")), len(cdf) - 1)


class TextFederated(FederatedDataset):
    """Generated pseudo-language text, one "author" per device (see the module docstring)."""

    def __init__(self, args: dict[str, Any] | None, num_devices: int, seed: int) -> None:
        a = Args("text", args, ACCEPTED_ARGS)
        self.seq_len = a.integer("seq_len", 20, lo=1)
        self.vocab = a.integer("vocab", 30, lo=4, hi=len(SYMBOLS))
        self.chars_per_device = a.integer("chars_per_device", 2000, lo=self.seq_len + 1)
        self.test_sequences = a.integer("test_sequences", 200, lo=1)
        info = DataInfo((self.seq_len,), self.vocab, "lm", "int64")
        super().__init__(info, num_devices)
        self.seed = seed
        self._language: _Language | None = None
        self._train: dict[int, TensorDataset] = {}
        self._test: TensorDataset | None = None

    @property
    def language(self) -> _Language:
        if self._language is None:
            self._language = _Language(self.seed, self.vocab)
        return self._language

    def _text(self, k: int, stream: int, length: int) -> np.ndarray:
        """``length`` symbols written by author ``k`` from random stream ``stream``."""
        lang = self.language
        style = stream_rng(self.seed, DOMAIN_TEXT, _AUTHOR, k)
        topic = style.dirichlet(np.full(NUM_WORDS, 0.5))
        next_cdf = np.cumsum(0.7 * lang.word_next + 0.3 * topic, axis=1)
        start_cdf = np.cumsum(0.5 * lang.start + 0.5 * topic)
        stop_rate = style.uniform(0.06, 0.15)

        rng = stream_rng(self.seed, DOMAIN_TEXT, stream, k)
        out: list[int] = []
        word = _draw(start_cdf, rng.random())
        while len(out) < length:
            out.extend(lang.words[word].tolist())
            if rng.random() < stop_rate:
                out.extend((STOP, SPACE))
                word = _draw(start_cdf, rng.random())
            else:
                out.append(SPACE)
                word = _draw(next_cdf[word], rng.random())
        return np.array(out[:length], dtype=np.int64)

    def _windows(self, tokens: np.ndarray, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        t = self.seq_len
        starts = np.arange(count) * t
        cols = np.arange(t)
        x = tokens[starts[:, None] + cols]
        y = tokens[starts[:, None] + cols + 1]
        return torch.from_numpy(x), torch.from_numpy(y)

    def num_samples(self, device: int) -> int:
        """Training sequences of ``device``: ``(chars_per_device - 1) // seq_len``."""
        self.check_device(device)
        return (self.chars_per_device - 1) // self.seq_len

    def train(self, device: int) -> TensorDataset:
        """Author ``device``'s sequences: x, y int64 ``(n, seq_len)``, y shifted by one."""
        k = self.check_device(device)
        if k not in self._train:
            tokens = self._text(k, _TRAIN, self.chars_per_device)
            self._train[k] = TensorDataset(*self._windows(tokens, self.num_samples(k)))
        return self._train[k]

    def forget(self, device: int) -> None:
        """Drop the cached training set of ``device`` (:meth:`train` builds it again)."""
        self._train.pop(self.check_device(device), None)

    def test(self) -> TensorDataset:
        """``test_sequences`` held-out sequences spread evenly over the authors."""
        if self._test is None:
            base, extra = divmod(self.test_sequences, self.num_devices)
            xs: list[torch.Tensor] = []
            ys: list[torch.Tensor] = []
            for k in range(self.num_devices):
                count = base + (1 if k < extra else 0)
                if count == 0:
                    continue
                tokens = self._text(k, _TEST, count * self.seq_len + 1)
                x, y = self._windows(tokens, count)
                xs.append(x)
                ys.append(y)
            self._test = TensorDataset(torch.cat(xs), torch.cat(ys))
        return self._test
