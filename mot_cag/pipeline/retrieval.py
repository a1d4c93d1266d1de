"""Retrieved store chunks as context pieces (ask and ``eval --store``)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from mot_cag.errors import MotCagError, StoreError
from mot_cag.pipeline.context import Piece


def open_store(path: str):
    """Open an existing, non-empty store for reading, or raise a one-sentence error."""
    from mot_cag.store.store import Store

    if not Store.exists(path):
        raise StoreError(f"No store at {path}; create one with `mot-cag ingest DOCS --store {path}`.")
    store = Store.open(path)
    if store.info()["chunks"] == 0:
        raise StoreError(f"Store {path} holds no chunks; ingest documents with `mot-cag ingest DOCS --store {path}`.")
    return store


def context_order(hits) -> list:
    """Hits in the order the target reads them: documents from least to most relevant (the best one next to
    the question), the chunks of one document in reading order."""
    best: dict[str, float] = {}
    for h in hits:
        best[h.doc] = max(best.get(h.doc, float("-inf")), h.score)
    return sorted(hits, key=lambda h: (best[h.doc], h.doc, h.chunk_index))


def hits_to_pieces(store, hits, device: torch.device | str = "cpu", verify: bool = True) -> list[Piece]:
    """Pieces in :func:`context_order`, each loading its source KV on demand."""
    ordered = context_order(hits)
    return [Piece(h.text, key=h.key, source_kv=lambda h=h: store.load(h.key, device=device, dtype=torch.float32,
                                                                       verify=verify), doc=h.doc)
            for h in ordered]


def recall_hit(hits, doc: str | None) -> float | None:
    """1.0 when some retrieved chunk's document path ends with ``doc`` (None when the example names none)."""
    if not doc:
        return None
    doc = doc.replace("\\", "/")
    return float(any(h.doc.replace("\\", "/").endswith(doc) for h in hits))


def store_pieces_for(path: str, top_k: int, source=None, device: torch.device | str = "cpu"
                     ) -> Callable[[dict], tuple[list[Piece], float | None]]:
    """Example -> (retrieved pieces, retrieval hit) over the store at ``path``.

    Raises:
        StoreError: Missing or empty store, or a store made by another source model than ``source``.
    """
    store = open_store(path)
    if source is not None and store.source.fingerprint != source.fingerprint:
        raise StoreError(f"Store {path} was made with source model '{store.source.name}', not '{source.name}'; "
                         f"pass --source {store.source.name} or ingest into another store.")
    if top_k <= 0:
        raise MotCagError(f"--top-k must be at least 1, got {top_k}.")

    def pieces_for(ex: dict) -> tuple[list[Piece], float | None]:
        hits = store.search(ex["question"], k=top_k)
        return hits_to_pieces(store, hits, device), recall_hit(hits, ex.get("doc"))

    return pieces_for
