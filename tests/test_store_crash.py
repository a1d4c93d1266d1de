"""Real processes: ``kill -9`` an ingest at several points and resume; two ingests at once on one store.

The child runs the real CLI; its ``os.replace`` is slowed down so that kills land inside the windows that
matter (a chunk's temporary file written but not renamed, files renamed but not yet synced or committed, a
document committed but the index not saved). These tests start several Python processes: marked slow.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mot_cag.ingest import ingest
from mot_cag.store.store import Store
from mot_cag.store.verify import verify_store

sys.path.insert(0, str(Path(__file__).parent))
from test_ingest import keyset, write_corpus  # noqa: E402

pytestmark = pytest.mark.slow

CHILD = r"""
import os, sys, time
delay = float(os.environ.get("MOT_CAG_TEST_WRITE_DELAY", "0"))
if delay:
    # Every atomic write (chunk files, document records, index, store config) pauses between writing its
    # temporary file and renaming it: kills land in that window, and the whole run slows down enough for
    # the other kill points to be reached.
    real_replace = os.replace
    def slow_replace(src, dst, *a, **k):
        time.sleep(delay)
        return real_replace(src, dst, *a, **k)
    os.replace = slow_replace
from mot_cag.cli import main
sys.argv = ["mot-cag", *sys.argv[1:]]
main()
"""


def start_ingest(corpus: Path, store: Path, source: str, delay: float = 0.03, *extra: str) -> subprocess.Popen:
    env = dict(os.environ, MOT_CAG_TEST_WRITE_DELAY=str(delay), HF_HUB_OFFLINE="1")
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, "ingest", str(corpus), "--store", str(store), "--source", source,
         "--embedder", "hash", "--chunk-tokens", "32", "--device", "cpu", "--json", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def wait_until(proc: subprocess.Popen, cond, timeout: float = 120.0) -> bool:
    """Poll ``cond()`` every few ms while ``proc`` runs; True when it held before the process ended."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.003)
    raise AssertionError("timed out waiting for the ingest to reach the kill point")


@pytest.fixture(scope="module")
def corpus_and_clean(tmp_path_factory, tiny_dir):
    root = tmp_path_factory.mktemp("crash")
    corpus = write_corpus(root / "docs")
    # A longer document, so kills land in the middle of one.
    (corpus / "long.txt").write_text(" ".join(f"Person {i} Quill lives in town {i}." for i in range(60)) + "\n")
    ingest([corpus], root / "clean", str(tiny_dir / "tiny-qwen2"), chunk_tokens=32, embedder="hash")
    return corpus, root / "clean"


def test_kill_9_at_several_points_then_resume_equals_clean_ingest(corpus_and_clean, tiny_dir, tmp_path):
    corpus, clean = corpus_and_clean
    store = tmp_path / "store"
    source = str(tiny_dir / "tiny-qwen2")
    total = len(keyset(clean))
    chunks_dir = store / "chunks"
    points = {
        "first chunk file renamed": lambda: len(keyset(store)) >= 1,
        "temporary chunk file written, not renamed": lambda: any(chunks_dir.glob("*/.*.tmp")),
        "a document committed": lambda: any((store / "documents").glob("*.json")),
        "half of the chunks written": lambda: len(keyset(store)) >= total // 2,
        "inside a manifest row commit": lambda: (store / "manifest.sqlite-wal").exists()
        and len(keyset(store)) >= 3 * total // 4,
    }
    killed = []
    for name, cond in points.items():
        proc = start_ingest(corpus, store, source)
        reached = wait_until(proc, cond)
        if reached:
            os.kill(proc.pid, signal.SIGKILL)
            killed.append(name)
        proc.wait(timeout=60)
        # Every intermediate state opens and verifies: nothing committed is damaged.
        report = verify_store(store)
        assert report.ok, (name, report.to_dict())
        with Store.open(store) as st:
            st.search("Where was Ana Brell born?", k=2)  # readable, index reconciled in memory
    print("killed at:", killed)
    assert len(killed) >= 3, f"the ingests finished before most kill points (killed at {killed}); slow them further"
    proc = start_ingest(corpus, store, source, 0.0)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    res = json.loads(out)
    assert res["documents"] == 6
    assert keyset(store) == keyset(clean)
    report = verify_store(store)
    assert report.ok and not report.notes, report.to_dict()
    with Store.open(store) as a, Store.open(clean) as b:
        assert {k: v for k, v in a.info().items() if k != "store"} == \
            {k: v for k, v in b.info().items() if k != "store"}
        assert [h.key for h in a.search("access code of Mira Hollen", k=3)] == \
            [h.key for h in b.search("access code of Mira Hollen", k=3)]


def test_two_concurrent_ingests_leave_a_valid_store(corpus_and_clean, tiny_dir, tmp_path):
    corpus, clean = corpus_and_clean
    other = tmp_path / "other"
    shutil.copytree(corpus, other)
    (other / "extra.txt").write_text("Pell Anwick was born in Sorrow Ford. Pell Anwick is a smith.\n")
    store = tmp_path / "store"
    source = str(tiny_dir / "tiny-qwen2")
    first = start_ingest(corpus, store, source, 0.1)  # slow enough to still be writing when the second starts
    assert wait_until(first, lambda: len(keyset(store)) >= 1)
    procs = [first, start_ingest(other, store, source, 0.0)]
    outs = [p.communicate(timeout=180) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err
    results = [json.loads(out) for out, _ in outs]
    assert any("waiting" in err for _, err in outs)  # one writer at a time: the other waited
    assert sum(r["chunks_added"] for r in results) == len(keyset(store))
    assert keyset(clean) < keyset(store)
    report = verify_store(store)
    assert report.ok and not report.notes, report.to_dict()
    with Store.open(store) as st:
        assert st.info()["documents"] == 13
