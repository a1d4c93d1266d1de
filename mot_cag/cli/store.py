"""`mot-cag ingest` and `mot-cag store info | verify | ls | rm | gc`."""

from __future__ import annotations

from typing import Annotated

import typer

from mot_cag.cli import (
    JsonOpt,
    StoreOpt,
    _choices,
    _pipeline_default,
    _print_json,
    _store_path,
    _table,
    app,
    err,
    out,
)
from mot_cag.names import CHUNK_PREFIXES


@app.command("ingest")
def ingest_cmd(
    paths: Annotated[list[str], typer.Argument(
        help="Files or folders of UTF-8 text (any name: .txt, .md, .rst, LICENSE...; folders are read "
             "recursively).")],
    store: Annotated[str | None, typer.Option("--store", help="Store folder (default from the pipeline).")] = None,
    source: Annotated[str | None, typer.Option(
        help="Source model (default: the store's, else the pipeline's).")] = None,
    chunk_tokens: Annotated[int | None, typer.Option(
        help="Chunk size in source tokens (default: the store's, else the pipeline's).")] = None,
    dtype: Annotated[str | None, typer.Option(
        metavar=_choices(("float16", "bfloat16", "float32")),
        help="KV dtype of a new store (" + _pipeline_default("kv_dtype") + ").")] = None,
    embedder: Annotated[str | None, typer.Option(
        help="Embedder of a new store: all-MiniLM-L6-v2, hash, or a sentence-transformers folder (default from the "
             "pipeline).")] = None,
    chunk_prefix: Annotated[str | None, typer.Option(
        metavar=_choices(CHUNK_PREFIXES),
        help="What a new store's chunks are prefilled after: prompt (the source's prompt head, so chunks look as "
             "they are read), none (each alone), auto (prompt for real RoPE models, none for the zoo); default "
             "from the pipeline.")] = None,
    device: Annotated[str | None, typer.Option(help="cpu, cuda, or auto (default from the pipeline).")] = None,
    wait: Annotated[float | None, typer.Option(
        help="Seconds to wait for another ingest writing the store (default: as long as it takes).")] = None,
    pipeline: Annotated[str | None, typer.Option(
        "--pipeline", help="Pipeline TOML (default pipelines/default.toml): store; a new store's settings.")] = None,
    sync: Annotated[bool, typer.Option(
        "--sync/--no-sync", help="Remove the store's documents under each given folder that are no longer there "
                                 "(deleted or moved away), with the chunks only they used.")] = True,
    as_json: JsonOpt = False,
) -> None:
    """Prefill documents once with the source model and keep their KV caches, embedded and indexed.
    Idempotent and resumable: unchanged files add nothing; an interrupted run continues where it stopped;
    re-ingesting a folder forgets files deleted from it (--no-sync keeps them).
    A new store takes its source, chunking, dtype and embedder from the options, else the pipeline; an existing
    store keeps its own."""
    from mot_cag.config import PipelineConfig
    from mot_cag.device import pick_device
    from mot_cag.ingest import ingest
    from mot_cag.ingest.progress import RichIngestProgress

    cfg = PipelineConfig.from_file(pipeline)
    with RichIngestProgress(err) as bar:
        res = ingest(paths, store or cfg.store, source, chunk_tokens=chunk_tokens, dtype=dtype, embedder=embedder,
                     device=pick_device(device or cfg.device), lock_timeout=wait, progress=bar, pipeline=cfg,
                     chunk_prefix=chunk_prefix, sync=sync)
    if as_json:
        _print_json(res.to_json())
        return
    out.print(f"{res.documents} documents in {res.store} ({res.documents_unchanged} unchanged): "
              f"{res.chunks_added} chunks added, {res.chunks_skipped} already stored, {res.chunks_removed} removed; "
              + (f"{res.documents_removed} documents no longer there removed; " if res.documents_removed else "")
              + f"{res.tokens:,} tokens in {res.seconds:.1f} s; source {res.source}.", highlight=False)


store_app = typer.Typer(help="Inspect, check and manage a KV store.", no_args_is_help=True)
app.add_typer(store_app, name="store")


@store_app.command("info")
def store_info(store: StoreOpt = None, as_json: JsonOpt = False) -> None:
    """Documents, chunks, tokens, bytes and source model of a store."""
    from mot_cag.store.store import Store

    with Store.open(_store_path(store)) as st:
        info = st.info()
    if as_json:
        _print_json(info)
        return
    for k in ("store", "source", "fingerprint", "documents", "chunks", "tokens", "bytes", "bytes_per_token",
              "dtype", "embedder"):
        out.print(f"{k:>16}: {info[k]}", highlight=False)


@store_app.command("verify")
def store_verify(
    store: StoreOpt = None,
    repair: Annotated[bool, typer.Option(
        "--repair", help="Drop damaged chunks (re-ingest recreates them), rebuild the manifest from chunk files "
        "when it is damaged, adopt orphan files, rebuild the index.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Check every chunk file against its checksums and the index against the manifest; exit 1 naming each
    damaged chunk."""
    from mot_cag.store.verify import verify_store

    report = verify_store(_store_path(store), repair=repair)
    if as_json:
        _print_json(report.to_dict())
    else:
        for n in report.notes:
            out.print(f"note: {n.kind} {n.subject}: {n.detail}" + (" (fixed)" if n.fixed else ""), highlight=False)
        for p in report.problems:
            what = f"{p.kind} chunk" if p.kind in ("damaged", "missing") else p.kind
            (out if p.fixed else err).print(f"{what} {p.subject}: {p.detail}", highlight=False, soft_wrap=True)
        out.print(f"{report.chunks_checked} chunks checked in {report.store}: "
                  + ("OK" if report.ok else f"{sum(not p.fixed for p in report.problems)} problems"), highlight=False)
    if not report.ok:
        raise typer.Exit(1)


@store_app.command("ls")
def store_ls(store: StoreOpt = None, as_json: JsonOpt = False) -> None:
    """The store's documents: path, chunks, tokens and size; then the totals and the source model."""
    from mot_cag.store.manage import documents
    from mot_cag.store.store import Store

    path = _store_path(store)
    docs = documents(path)
    with Store.open(path) as st:
        info = st.info()
    if as_json:
        _print_json({"store": path, "source": info["source"], "documents": docs})
        return
    table = _table("document", "chunks", "tokens", "bytes")
    for d in docs:
        table.add_row(d["path"], str(d["chunks"]), f"{d['tokens']:,}", f"{d['size']:,}")
    out.print(table)
    out.print(f"{info['documents']} documents, {info['chunks']} chunks, {info['tokens']:,} tokens stored "
              f"({info['bytes']:,} bytes of KV); source {info['source']}.", highlight=False)


def _removed_line(r, what: str) -> str:
    return (f"{what}: {len(r.documents)} documents, {r.chunks} chunks ({r.chunk_files} chunk files, "
            f"{r.bytes_freed:,} bytes), {r.records} document records, {r.temp_files} temporary files removed.")


@store_app.command("rm")
def store_rm(
    paths: Annotated[list[str], typer.Argument(help="Documents to remove: files, or folders (every document "
                                                    "under them), as they were ingested.")],
    store: StoreOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Remove documents from the store, with the chunks no other document uses. Crash-safe: a store
    interrupted mid-removal still verifies; `store gc` finishes the cleanup."""
    from mot_cag.store.manage import remove_documents

    r = remove_documents(_store_path(store), paths)
    if as_json:
        _print_json(r.to_json())
        return
    for d in r.documents:
        out.print(f"removed {d}", highlight=False)
    out.print(_removed_line(r, "rm"), highlight=False)


@store_app.command("gc")
def store_gc(store: StoreOpt = None, as_json: JsonOpt = False) -> None:
    """Delete what no document uses: chunks without a document, chunk files without a manifest row (an
    interrupted ingest or removal), stale document records and temporary files; save the index."""
    from mot_cag.store.manage import gc

    r = gc(_store_path(store))
    if as_json:
        _print_json(r.to_json())
        return
    out.print(_removed_line(r, "gc"), highlight=False)
