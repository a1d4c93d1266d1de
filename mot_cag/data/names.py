"""Open-vocabulary invented strings: person names, places, companies and digit strings.

Every invented string is assigned to a *split* by a stable hash (not by the RNG seed), so that strings
drawn for evaluation (``split="eval"``) are guaranteed never to occur in training text
(``split="train"``), whatever seeds either side uses.
"""

from __future__ import annotations

import hashlib
import random
from typing import Literal

Split = Literal["train", "eval", "any"]

# One string in EVAL_MODULUS is reserved for evaluation; 1/5 keeps enough variety on both sides.
EVAL_MODULUS = 5

_ONSETS = [
    "b",
    "br",
    "c",
    "d",
    "dr",
    "f",
    "g",
    "gr",
    "h",
    "j",
    "k",
    "kr",
    "l",
    "m",
    "n",
    "p",
    "pr",
    "r",
    "s",
    "st",
    "t",
    "tr",
    "v",
    "w",
    "z",
    "sh",
    "ch",
    "th",
]
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ea", "io", "y"]
_CODAS = ["", "", "", "n", "l", "r", "s", "m", "th", "x", "nd", "rk", "ll", "sk", "t"]
_COMPANY_SUFFIXES = ["Labs", "Works", "Group", "Systems", "Foods", "Motors", "Media", "Partners"]
_PLACE_ENDINGS = ["", "", "ton", "ville", "burg", "mar", "field", "port", "dale", "holm"]


def split_of(text: str) -> Split:
    """Return the split an invented string belongs to.

    Args:
        text: The invented string (name, place, company or digit string).

    Returns:
        ``"eval"`` for the reserved fifth of all strings, else ``"train"``.
    """
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest()
    return "eval" if int.from_bytes(digest, "little") % EVAL_MODULUS == 0 else "train"


def _in_split(text: str, split: Split) -> bool:
    return split == "any" or split_of(text) == split


def _syllable(rng: random.Random) -> str:
    return rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS)


def _word(rng: random.Random, n_min: int = 1, n_max: int = 2) -> str:
    return "".join(_syllable(rng) for _ in range(rng.randint(n_min, n_max))).capitalize()


def _draw(rng: random.Random, make, split: Split) -> str:
    # Rejection sampling: about 1 in EVAL_MODULUS draws is kept for "eval", 4 in 5 for "train".
    for _ in range(1000):
        text = make(rng)
        if _in_split(text, split):
            return text
    raise RuntimeError("could not draw a string in the requested split")  # practically unreachable


def person_name(rng: random.Random, split: Split = "any") -> str:
    """Draw an invented person name: a given name and a family name, e.g. ``"Brai Kolvar"``."""
    return _draw(rng, lambda r: f"{_word(r, 1, 2)} {_word(r, 1, 2)}", split)


def place_name(rng: random.Random, split: Split = "any") -> str:
    """Draw an invented place name, e.g. ``"Drenholm"``."""
    return _draw(rng, lambda r: _word(r, 1, 2) + r.choice(_PLACE_ENDINGS), split)


def company_name(rng: random.Random, split: Split = "any") -> str:
    """Draw an invented company name, e.g. ``"Zorvik Labs"``."""
    return _draw(rng, lambda r: f"{_word(r, 1, 2)} {r.choice(_COMPANY_SUFFIXES)}", split)


def digit_string(rng: random.Random, n_min: int, n_max: int, split: Split = "any") -> str:
    """Draw a random digit string of ``n_min``..``n_max`` digits (no leading zero)."""

    def make(r: random.Random) -> str:
        n = r.randint(n_min, n_max)
        return str(r.randint(1, 9)) + "".join(str(r.randint(0, 9)) for _ in range(n - 1))

    return _draw(rng, make, split)


def year_string(rng: random.Random, split: Split = "any") -> str:
    """Draw a four-digit year between 1800 and 2029."""
    return _draw(rng, lambda r: str(r.randint(1800, 2029)), split)
