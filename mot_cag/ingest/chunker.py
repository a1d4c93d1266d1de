"""Cutting a document into chunks of at most N *source-model* tokens, at sentence or line boundaries.

A document arrives as a stream of text blocks; it is split into pieces that end at a sentence end
(``.``/``!``/``?`` followed by space) or a line break, and pieces are packed greedily into chunks of at
most ``max_tokens`` tokens. A piece longer than a whole chunk (a giant line) is cut at token boundaries.

Conventions a reader of the store relies on:

* ``text == document[char_start:char_end]`` exactly (offsets are in characters of the decoded file);
  whitespace around a chunk is left out of it.
* ``token_ids`` is ``tokenizer(text, add_special_tokens=False)``: **no BOS/EOS**, for every family. OPT's
  tokenizer would otherwise put ``</s>`` in front of every chunk, and a chunk is not a sequence start; the
  ask pipeline prepends BOS itself where the target expects one.
* Every chunk is prefilled on its own from position 0.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

from mot_cag.store.format import TextChunk

#: A piece ends after a sentence end followed by whitespace, or after a run of line breaks.
_BOUNDARY = re.compile(r"[.!?…][\"'”’)\]]*[ \t]+|\s*\n\s*")

#: A piece with no boundary for this many characters is force-cut (at whitespace when there is some).
_MAX_PIECE_CHARS = 1 << 15


def split_pieces(blocks: Iterable[str], max_piece_chars: int = _MAX_PIECE_CHARS) -> Iterator[tuple[int, str]]:
    """Split streamed text into ``(offset, piece)`` pieces that tile it exactly and end at boundaries."""
    pending = ""
    base = 0  # document offset of pending[0]
    for block in blocks:
        pending += block
        cut = 0
        for m in _BOUNDARY.finditer(pending):
            # A boundary match that touches the end of the buffer may continue in the next block.
            if m.end() == len(pending):
                break
            yield base + cut, pending[cut:m.end()]
            cut = m.end()
        while len(pending) - cut > max_piece_chars:
            # No boundary for a long stretch (minified text, one giant line): cut at the last space.
            window = pending[cut:cut + max_piece_chars]
            space = window.rfind(" ")
            end = cut + (space + 1 if space > 0 else max_piece_chars)
            yield base + cut, pending[cut:end]
            cut = end
        pending = pending[cut:]
        base += cut
    if pending:
        yield base, pending


class Chunker:
    """Packs pieces into chunks of at most ``max_tokens`` source tokens.

    Args:
        tokenizer: The source model's fast tokenizer.
        max_tokens: Chunk size limit in source tokens.
    """

    #: Pieces tokenized per batch call (the Rust tokenizer amortises its per-call cost over a batch).
    BATCH = 256

    def __init__(self, tokenizer, max_tokens: int = 256):
        if max_tokens < 8:
            raise ValueError(f"Chunks of {max_tokens} tokens are too small to be useful; use at least 8.")
        self.tokenizer = tokenizer
        self.max_tokens = max_tokens
        # The fast tokenizer's Rust core gives the same ids and offsets as ``tokenizer(...)`` without the
        # Python wrapper's per-call overhead, which dominated chunking time.
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None and (backend.truncation is not None or backend.padding is not None):
            backend = None  # configured to truncate or pad: its output would differ from the wrapper's
        self._backend = backend

    def _ids(self, text: str) -> list[int]:
        if self._backend is not None:
            return self._backend.encode(text, add_special_tokens=False).ids
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _counts(self, texts: list[str]) -> list[int]:
        if self._backend is not None:
            return [len(e.ids) for e in self._backend.encode_batch(texts, add_special_tokens=False)]
        return [len(ids) for ids in self.tokenizer(texts, add_special_tokens=False)["input_ids"]]

    def _ids_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        if self._backend is not None:
            enc = self._backend.encode(text, add_special_tokens=False)
            return enc.ids, enc.offsets
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return enc["input_ids"], enc["offset_mapping"]

    def chunks(self, blocks: Iterable[str]) -> Iterator[TextChunk]:
        """Chunks of a document given as a stream of text blocks, with ``last`` set on the final one."""
        prev: TextChunk | None = None
        index = 0
        for start, end, text, ids in self._spans(blocks):
            if prev is not None:
                yield prev
            prev = TextChunk(index, text, start, end, tuple(ids))
            index += 1
        if prev is not None:
            yield TextChunk(prev.index, prev.text, prev.char_start, prev.char_end, prev.token_ids, last=True)

    def _spans(self, blocks: Iterable[str]) -> Iterator[tuple[int, int, str, list[int]]]:
        group: list[tuple[int, str]] = []
        budget = 0
        for batch in _batched(split_pieces(blocks), self.BATCH):
            for (offset, piece), n in zip(batch, self._counts([p for _, p in batch]), strict=True):
                if group and budget + n > self.max_tokens:
                    yield from self._emit(group)
                    group, budget = [], 0
                group.append((offset, piece))
                budget += n
        if group:
            yield from self._emit(group)

    def _emit(self, group: list[tuple[int, str]]) -> Iterator[tuple[int, int, str, list[int]]]:
        """Turn a run of pieces into chunks, cutting at token boundaries where they exceed the limit."""
        offset = group[0][0]
        text = "".join(p for _, p in group)
        while text:
            stripped = text.lstrip()
            offset += len(text) - len(stripped)
            text = stripped.rstrip()
            if not text:
                return
            ids, offsets = self._ids_offsets(text)
            if len(ids) <= self.max_tokens:
                yield offset, offset + len(text), text, list(ids)
                return
            # Tokenizing the joined pieces can exceed the per-piece count (or one piece alone is too long):
            # cut at the end character of token max_tokens, then tokenize the head again so its ids are
            # exactly what its text encodes to.
            take = self.max_tokens
            while True:
                cut = max(1, offsets[take - 1][1])
                head = text[:cut].rstrip()
                head_ids = self._ids(head)
                if len(head_ids) <= self.max_tokens or take == 1:  # merges at the new end, rare
                    break
                take -= 1
            yield offset, offset + len(head), head, head_ids
            offset += cut
            text = text[cut:]


def _batched(items: Iterable[tuple[int, str]], n: int) -> Iterator[list[tuple[int, str]]]:
    batch: list[tuple[int, str]] = []
    for item in items:
        batch.append(item)
        if len(batch) == n:
            yield batch
            batch = []
    if batch:
        yield batch
