"""Terminal progress for ingest and verify (rich), shown only when the output is a terminal."""

from __future__ import annotations

import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


class RichIngestProgress:
    """An :class:`~mot_cag.ingest.IngestProgress` drawing documents, chunks and tokens/s on ``console``.

    Use as a context manager; outside a terminal it only prints notes.
    """

    def __init__(self, console: Console, enabled: bool = True):
        self.console = console
        self.enabled = enabled and console.is_terminal
        self.prog: Progress | None = None
        self.task = None
        self.first: tuple[float, int] | None = None

    def __enter__(self) -> RichIngestProgress:
        if self.enabled:
            self.prog = Progress(TextColumn("documents"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.fields[chunks]} chunks, {task.fields[rate]} tokens/s"),
                                 TimeElapsedColumn(), console=self.console, transient=True)
            self.prog.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.prog is not None:
            self.prog.__exit__(*exc)

    def begin(self, files: int) -> None:
        """See :class:`~mot_cag.ingest.IngestProgress`."""
        if self.prog is not None:
            self.task = self.prog.add_task("ingest", total=files, chunks=0, rate="-")

    def update(self, files_done: int, chunks: int, tokens: int) -> None:
        """See :class:`~mot_cag.ingest.IngestProgress` (``files_done`` -1 leaves the file count alone)."""
        if self.prog is None or self.task is None:
            return
        now = time.perf_counter()
        if self.first is None:
            # Rate from the first update on (ingest sends one right after loading the model): loading the
            # model and embedder is not throughput.
            self.first = (now, tokens)
        t_first, tok_first = self.first
        rate = f"{(tokens - tok_first) / (now - t_first):,.0f}" if now > t_first and tokens > tok_first else "-"
        fields = {"chunks": chunks, "rate": rate}
        if files_done >= 0:
            fields["completed"] = files_done
        self.prog.update(self.task, **fields)

    def note(self, message: str) -> None:
        """Print a note above the bar (or plainly, off a terminal)."""
        self.console.print(f"note: {message}", highlight=False, soft_wrap=True)
