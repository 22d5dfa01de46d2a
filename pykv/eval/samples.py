"""The samples of an evaluation: token ids fixed once, saved beside the results.

A needle sample is a haystack cut from the shipped text at a seeded position, with the
sentence "The secret passkey is NNNNN." hidden at a depth (a fraction of the document), and
the question after it, all through the model's chat template. Its context (everything before
the question) and its question are kept as token ids, so that a resumed run, or another
runtime (bench/kvpress_needle.py), evaluates exactly the same tokens.

A text sample (kl, ppl) is a passage of the text at a seeded position.
"""
from __future__ import annotations

import gzip
import json
import random
import re
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Dict, List, Optional, Sequence

QUESTION = "\n\nWhat is the secret passkey mentioned in the text above? Answer with the number only."
NEEDLE = " The secret passkey is {passkey}. Remember it. "
SAMPLES_VERSION = 1


@lru_cache(maxsize=1)
def haystack_text() -> str:
    """The shipped public-domain text (pykv/eval/data/README.md)."""
    with gzip.open(Path(__file__).with_name("data") / "alice.txt.gz", "rt", encoding="utf-8") as f:
        return f.read().lstrip("\ufeff")


def _rng(seed: int, *parts) -> random.Random:
    """A generator for one sample, the same on every machine and Python version."""
    return random.Random("-".join(str(p) for p in (seed,) + parts))


def _words_from(text: str, rng: random.Random) -> List[str]:
    """The text's words (with their trailing spaces), starting at a random paragraph and
    going round to the beginning once, so every start has the whole text after it."""
    paragraphs = [m.start() for m in re.finditer(r"\n\n(?=\S)", text)] or [0]
    start = rng.choice(paragraphs) + 2 if paragraphs != [0] else 0
    return re.findall(r"\S+\s*", text[start:] + "\n\n" + text[:start])


@dataclass
class NeedleSample:
    length: int                 # the prompt's target length in tokens (context + question)
    index: int                  # the sample's number at this length
    seed: int
    depth: float                # where the needle sits, as a fraction of the document
    passkey: str
    context: List[int] = field(repr=False)    # the chat template's text up to the question
    question: List[int] = field(repr=False)   # the question and the assistant's turn opening

    @property
    def n_prompt(self) -> int:
        return len(self.context) + len(self.question)

    def hit(self, answer: str) -> bool:
        """The passkey's digits in the answer (other digits around them are allowed)."""
        return self.passkey in re.sub(r"\D", "", answer)


def _chat_parts(llm, document: str) -> tuple:
    """Context and question token ids of the user message document + QUESTION."""
    from ..chat import render
    text = render(llm.chat_template, [{"role": "user", "content": document + QUESTION}],
                  bos_token=llm._special_text(llm.token_bos()), eos_token=llm._special_text(llm.token_eos()))
    cut = text.index(QUESTION)
    context = llm.tokenize(text[:cut], add_bos=True, special=True)
    if len(context) > 1 and context[0] == context[1] == llm.token_bos():
        context = context[1:]   # the template wrote BOS itself
    return context, llm.tokenize(text[cut:], add_bos=False, special=True)


def make_needle_sample(llm, length: int, index: int, depth: float, seed: int = 0) -> NeedleSample:
    """The needle sample (length, index) of this seed: the longest haystack whose prompt fits
    in length tokens. llm only tokenizes (vocab_only=True is enough)."""
    rng = _rng(seed, "needle", length, index)
    passkey = str(rng.randrange(10000, 100000))
    words = _words_from(haystack_text(), rng)
    needle = NEEDLE.format(passkey=passkey)

    def parts(n_words):
        cut = int(n_words * depth)
        return _chat_parts(llm, "".join(words[:cut]) + needle + "".join(words[cut:n_words]))

    lo, hi = 1, len(words)
    while lo < hi:   # the most words whose prompt fits
        mid = (lo + hi + 1) // 2
        context, question = parts(mid)
        if len(context) + len(question) <= length:
            lo = mid
        else:
            hi = mid - 1
    context, question = parts(lo)
    if len(context) + len(question) > length:
        raise ValueError(f"a needle prompt does not fit in {length} tokens (it takes {len(context) + len(question)})")
    return NeedleSample(length, index, seed, depth, passkey, context, question)


@dataclass
class TextSample:
    length: int          # tokens in the passage
    index: int
    seed: int
    tokens: List[int] = field(repr=False)


def make_text_sample(llm, text: str, length: int, index: int, seed: int = 0) -> TextSample:
    """length tokens of text from a seeded paragraph on, BOS first when the model adds one."""
    rng = _rng(seed, "text", length, index)
    words = _words_from(text, rng)
    tokens: List[int] = []
    n = 4 * length   # words are at least a token each: enough to fill the passage, grown if not
    while len(tokens) < length:
        tokens = llm.tokenize("".join(words[:n]), add_bos=True)
        if n >= len(words) and len(tokens) < length:
            words = words + words   # a short text repeats
        n *= 2
    return TextSample(length, index, seed, tokens[:length])


class SampleSet:
    """Samples by (kind, length, index), kept in DIR/samples.json: made once, read back on a
    resumed run (so a run never mixes two tokenizations), extended when more are asked for."""

    def __init__(self, path: Optional[Path], model: str):
        self.path, self.model = path, model
        self.needle: Dict[tuple, NeedleSample] = {}
        self.text: Dict[tuple, TextSample] = {}
        if path is not None and path.exists():
            self._read(path)

    def _read(self, path: Path) -> None:
        try:
            data = json.loads(path.read_text())
            if data.get("version") != SAMPLES_VERSION:
                raise ValueError(f"version {data.get('version')!r}, expected {SAMPLES_VERSION}")
            if data.get("model") != self.model:
                raise ValueError(f"its samples are for the model {data.get('model')!r}, not {self.model!r}")
            for d in data.get("needle", []):
                s = NeedleSample(**d)
                self.needle[(s.length, s.index, s.seed, s.depth)] = s
            for d in data.get("text", []):
                s = TextSample(**d)
                self.text[(s.length, s.index, s.seed)] = s
        except (OSError, ValueError, TypeError, KeyError) as exc:
            raise ValueError(f"{path} cannot be used: {exc} (give another --out, or delete it)") from exc

    def needle_sample(self, llm, length: int, index: int, depth: float, seed: int) -> NeedleSample:
        key = (length, index, seed, depth)
        if key not in self.needle:
            self.needle[key] = make_needle_sample(llm, length, index, depth, seed)
        return self.needle[key]

    def text_sample(self, llm, text: str, length: int, index: int, seed: int) -> TextSample:
        key = (length, index, seed)
        if key not in self.text:
            self.text[key] = make_text_sample(llm, text, length, index, seed)
        return self.text[key]

    def save(self) -> None:
        if self.path is None:
            return
        data = {"version": SAMPLES_VERSION, "model": self.model,
                "needle": [asdict(s) for s in self.needle.values()],
                "text": [asdict(s) for s in self.text.values()]}
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(data))
        tmp.replace(self.path)


def depth_of(index: int, depths: Sequence[float]) -> float:
    """Sample index's needle depth: the depths in turn, so every depth gets samples/len(depths)."""
    return depths[index % len(depths)]
