"""Retrieval from a store: the FAISS index kept in line with the manifest, and hybrid dense + BM25 search."""

from __future__ import annotations

from dataclasses import dataclass

from mot_cag.store.format import INDEX_FILE
from mot_cag.store.index import IVF_THRESHOLD, VectorIndex


@dataclass(frozen=True)
class Hit:
    """One retrieved chunk.

    Attributes:
        key: Chunk key (pass to :meth:`Store.load`).
        doc: Path of the document it belongs to (the first, when the same chunk occurs in several).
        chunk_index: Its position in that document.
        score: Retrieval score (cosine similarity mixed with normalised BM25; higher is better).
        text: The chunk's text.
        path: The chunk file.
        char_start: Offset of the chunk in the document.
        char_end: End offset in the document.
        tokens: Source tokens in the chunk.
    """

    key: str
    doc: str
    chunk_index: int
    score: float
    text: str
    path: str
    char_start: int = 0
    char_end: int = 0
    tokens: int = 0



class Searching:
    """The retrieval half of :class:`~mot_cag.store.store.Store` (a mixin: it uses the store's ``root``,
    ``config``, ``manifest``, ``embedder``, ``_index``, ``_index_state`` and ``_index_lock``)."""

    @property
    def index(self) -> VectorIndex:
        """The vector index, loaded from disk and kept in line with the manifest (in memory).

        A long-lived reader sees chunks another process ingests after it opened the store: when the manifest's
        chunk count or newest id changes, the in-memory index is brought up to date first.
        """
        with self._index_lock:
            state = self.manifest.chunk_state()
            if self._index is None or state != self._index_state:
                self.sync_index(write=False)
                self._index_state = state
            assert self._index is not None
            return self._index

    def _load_index(self) -> VectorIndex:
        path = self.root / INDEX_FILE
        if path.is_file():
            try:
                return VectorIndex.load(path, self.config.embed_dim)
            except Exception:  # noqa: BLE001 - a damaged index is derived data: rebuild it below
                pass
        return VectorIndex(self.config.embed_dim)

    def sync_index(self, write: bool) -> tuple[int, int]:
        """Make the index hold exactly the manifest's chunks.

        Chunks without a stored embedding (an ingest killed between the file and its embedding) are
        embedded now; with ``write`` their embeddings are saved to the manifest too.

        Returns:
            ``(added, removed)`` vector counts.
        """
        with self._index_lock:
            return self._sync_index(write)

    def _sync_index(self, write: bool) -> tuple[int, int]:
        index = self._index if self._index is not None else self._load_index()
        self._index = index
        pending = self.manifest.missing_embeddings()
        pending_vecs = self.embedder.encode([t for _, t in pending]) if pending else None
        if pending and write:
            with self.manifest.transaction():
                self.manifest.set_embeddings([i for i, _ in pending], pending_vecs)
        have = set(index.ids().tolist())
        rows = self.manifest.chunk_ids()
        extra = sorted(have - rows)
        index.remove(extra)
        missing = sorted(rows - have)
        ids, vecs = self.manifest.embeddings(self.config.embed_dim, ids=missing)
        index.add(ids, vecs)
        added = len(ids)
        if pending and not write:
            # Read-only: embeddings computed for this process only, the manifest is left untouched.
            todo = [n for n, (i, _) in enumerate(pending) if i in set(missing) - set(ids.tolist())]
            index.add([pending[n][0] for n in todo], pending_vecs[todo])
            added += len(todo)
        return added, len(extra)

    def save_index(self) -> None:
        """Write the index atomically (call while holding the writer lock).

        An exact index that has grown past :data:`~mot_cag.store.index.IVF_THRESHOLD` vectors is rebuilt as IVF
        from the manifest's embeddings first.
        """
        index = self.index
        if index.is_flat and len(index) >= IVF_THRESHOLD:
            ids, vecs = self.manifest.embeddings(self.config.embed_dim)
            self._index = index = VectorIndex.build(self.config.embed_dim, ids, vecs)
        index.save(self.root / INDEX_FILE)

    def search(self, query: str, k: int = 4, lexical_weight: float = 0.3) -> list[Hit]:
        """The ``k`` chunks most relevant to ``query``.

        Dense cosine similarity over the FAISS index is mixed with BM25 (normalised by the best BM25 score of
        the query): ``score = (1 - w) * cosine + w * bm25 / max_bm25``. Candidates come from both signals.
        Only chunks of completely ingested documents are returned.

        Args:
            query: Question or search text.
            k: Number of chunks.
            lexical_weight: ``w`` above; 0 uses embeddings only.
        """
        if k <= 0 or not query.strip():
            return []
        pool = max(4 * k, 32)
        qvec = self.embedder.encode([query])[0]
        with self._index_lock:  # another thread may be bringing the index up to date
            dense = dict(self.index.search(qvec, pool))
        lexical: dict[int, float] = {}
        if lexical_weight > 0:
            top = sorted(self.manifest.lexical_scores(query, pool).items(), key=lambda kv: -kv[1])
            best = top[0][1] if top else 0.0
            lexical = {i: s / best for i, s in top} if best > 0 else {}
        cand = set(dense) | set(lexical)
        missing = [i for i in cand if i not in dense]
        if missing:
            ids, vecs = self.manifest.embeddings(self.config.embed_dim, ids=missing)
            dense.update({int(i): float(v @ qvec) for i, v in zip(ids, vecs, strict=True)})
        scored = sorted(((1 - lexical_weight) * dense.get(i, 0.0) + lexical_weight * lexical.get(i, 0.0), i)
                        for i in cand)
        rows = self.manifest.chunks_by_id(cand)
        hits: list[Hit] = []
        for score, cid in reversed(scored):
            row = rows.get(cid)
            places = self.manifest.places(row.key) if row is not None else []
            if not places:
                continue  # chunk of a document whose ingest has not completed
            doc, place = places[0]
            hits.append(Hit(row.key, doc, place.index, float(score), row.text, str(self.root / row.file),
                            place.char_start, place.char_end, row.tokens))
            if len(hits) == k:
                break
        return hits
