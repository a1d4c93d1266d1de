"""One writer at a time: the store's ``flock`` writer lock (released by the OS if the writer dies)."""

from __future__ import annotations

import errno
import fcntl
import os
import time
from collections.abc import Callable
from pathlib import Path

from mot_cag.errors import StoreError
from mot_cag.store.format import LOCK_FILE


class WriterLock:
    """Exclusive writer lock on a store (``flock``; released by the OS if the process dies).

    Args:
        root: Store folder.
        timeout: Seconds to wait for another writer; ``0`` fails at once, ``None`` waits forever.
        on_wait: Called once with a message when the lock is busy and we start waiting.
    """

    def __init__(self, root: Path, timeout: float | None = None, on_wait: Callable[[str], None] | None = None):
        self.root, self.timeout, self.on_wait = root, timeout, on_wait
        self.fd: int | None = None

    def __enter__(self) -> WriterLock:
        self.root.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(self.root / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        warned = False
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return self
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
            if deadline is not None and time.monotonic() >= deadline:
                os.close(self.fd)
                self.fd = None
                raise StoreError(
                    f"Another ingest is writing to store {self.root}; wait for it to finish (or stop it) and "
                    "run this ingest again."
                )
            if not warned and self.on_wait is not None:
                self.on_wait(f"another ingest is writing to {self.root}; waiting for it to finish")
                warned = True
            time.sleep(0.2)

    def __exit__(self, *exc) -> None:
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None
