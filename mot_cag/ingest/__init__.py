"""Documents into a store: find and read files (:mod:`.documents`), cut them by source tokens (:mod:`.chunker`),
prefill each chunk with the source model and write it (:mod:`.run`, the ``mot-cag ingest`` command as a call)."""

from mot_cag.ingest.run import IngestProgress, IngestResult, chunk_prefix_for, ingest

__all__ = ["IngestProgress", "IngestResult", "chunk_prefix_for", "ingest"]
