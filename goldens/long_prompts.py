"""Long golden prompts, generated: the same text on any machine, from a seed and a length.

A long case (cases.yaml: `generate: {seed, words}`) needs thousands of tokens of text that the
repository can reproduce without a download. This module writes English-like prose from a
fixed word list with its own 64-bit linear congruential generator (no dependence on Python's
`random`, whose algorithms may change), so a prompt is a pure function of its parameters.

The second half of the text repeats paragraphs of the first half in a shuffled order: a
trained model can only predict those tokens well by attending a thousand or more positions
back, so attention that forgets old keys moves its log-probabilities (random tiny models are
moved by any position bug anyway).

The text has no digits: tokenizers that split digits off first (SmolLM2's, in llama.cpp and
in its own tokenizer.json) and transformers' GGUF conversion of them, which does not, encode
"\n\n2" differently (1116 34 vs 198 198 34), and the torch reference must see the engine's
input ids.
"""

from __future__ import annotations

import functools

WORDS = (
    "the",
    "a",
    "of",
    "and",
    "to",
    "in",
    "is",
    "was",
    "for",
    "on",
    "with",
    "as",
    "by",
    "at",
    "from",
    "that",
    "this",
    "it",
    "he",
    "she",
    "they",
    "we",
    "you",
    "river",
    "mountain",
    "city",
    "village",
    "garden",
    "window",
    "kitchen",
    "market",
    "harbor",
    "station",
    "library",
    "forest",
    "bridge",
    "valley",
    "island",
    "castle",
    "meadow",
    "field",
    "road",
    "street",
    "tower",
    "school",
    "house",
    "farm",
    "ship",
    "train",
    "morning",
    "evening",
    "winter",
    "summer",
    "autumn",
    "spring",
    "night",
    "day",
    "week",
    "year",
    "moment",
    "hour",
    "season",
    "old",
    "young",
    "small",
    "large",
    "quiet",
    "bright",
    "dark",
    "warm",
    "cold",
    "green",
    "blue",
    "red",
    "golden",
    "silver",
    "gentle",
    "heavy",
    "light",
    "early",
    "late",
    "long",
    "short",
    "narrow",
    "wide",
    "deep",
    "distant",
    "ancient",
    "modern",
    "simple",
    "careful",
    "walked",
    "carried",
    "opened",
    "closed",
    "found",
    "watched",
    "remembered",
    "wrote",
    "read",
    "built",
    "painted",
    "followed",
    "crossed",
    "gathered",
    "planted",
    "counted",
    "measured",
    "answered",
    "asked",
    "listened",
    "waited",
    "returned",
    "teacher",
    "farmer",
    "sailor",
    "doctor",
    "painter",
    "baker",
    "writer",
    "child",
    "traveler",
    "neighbor",
    "merchant",
    "captain",
    "student",
    "musician",
    "gardener",
    "miller",
    "weaver",
    "keeper",
    "stranger",
    "friend",
    "brother",
    "sister",
    "letter",
    "book",
    "map",
    "lamp",
    "door",
    "table",
    "chair",
    "basket",
    "rope",
    "stone",
    "wheel",
    "clock",
    "candle",
    "bell",
    "coat",
    "bread",
    "apple",
    "water",
    "salt",
    "wood",
    "paper",
    "ink",
    "thread",
    "glass",
    "iron",
    "copper",
    "wool",
    "honey",
    "tea",
    "milk",
    "slowly",
    "quickly",
    "softly",
    "often",
    "always",
    "never",
    "again",
    "together",
    "alone",
    "almost",
    "nearly",
    "finally",
    "because",
    "while",
    "after",
    "before",
    "until",
    "when",
    "where",
    "although",
    "since",
    "during",
    "under",
    "over",
    "between",
    "behind",
    "beside",
    "across",
    "through",
    "around",
    "along",
    "near",
    "inside",
    "outside",
    "above",
    "below",
    "toward",
)

_MULTIPLIER = 6364136223846793005
_INCREMENT = 1442695040888963407
_MASK = (1 << 64) - 1


class _Generator:
    """Knuth's MMIX linear congruential generator; draws from the high bits."""

    def __init__(self, seed: int) -> None:
        self.state = (seed * 0x9E3779B97F4A7C15 + 1) & _MASK

    def below(self, n: int) -> int:
        self.state = (self.state * _MULTIPLIER + _INCREMENT) & _MASK
        return (self.state >> 33) % n


def _sentence(rng: _Generator) -> str:
    words = [WORDS[rng.below(len(WORDS))] for _ in range(6 + rng.below(9))]
    words[0] = words[0].capitalize()
    return " ".join(words) + "."


def _paragraph(rng: _Generator) -> list[str]:
    return " ".join(_sentence(rng) for _ in range(3 + rng.below(4))).split(" ")


@functools.lru_cache(maxsize=64)
def prompt(seed: int, words: int) -> str:
    """About `words` words of prose (never fewer): paragraphs, the second half
    repeating the first half's paragraphs in a seed-shuffled order. Kept once made (the case
    specs ask for each long prompt again and again: 2.2M draws in one serving shard)."""
    if words < 2:
        raise ValueError(f"words={words}: a long prompt needs at least 2 words")
    rng = _Generator(seed)
    first: list[list[str]] = []
    while sum(len(p) for p in first) < words // 2:
        first.append(_paragraph(rng))
    order = list(range(len(first)))
    for i in range(len(order) - 1, 0, -1):  # Fisher-Yates with the same generator
        j = rng.below(i + 1)
        order[i], order[j] = order[j], order[i]
    paragraphs = first + [first[i] for i in order]
    total = 0
    kept = []
    for paragraph in paragraphs:
        kept.append(paragraph)
        total += len(paragraph)
        if total >= words:
            break
    return "\n\n".join(" ".join(p) for p in kept)
