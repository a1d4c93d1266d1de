"""Load test of `mot-cag serve` (issue [5]): N concurrent clients for a bounded time, on loopback only.

Starts the server as a subprocess on a free loopback port, answers every question once sequentially (the
reference), then lets ``--clients`` clients ask the same questions (streaming, round-robin over the targets)
for ``--duration`` seconds. Reports errors, answers that differ from the sequential ones, and p50/p95 of
latency (request to last event) and TTFT (request to first answer text, as a client sees it: queueing
included) next to the server's own TTFT (from its first token after the request was taken up).

    .venv/bin/python benchmarks/load_server.py --pipeline pipelines/real.toml --store stores/demo-real \
        --target smollm2-135m --target qwen2.5-coder-0.5b --target gemma-3-270m --clients 8 --duration 60

Exit status 1 when any request failed or any answer differed from the sequential one.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

HOST = "127.0.0.1"  # loopback only, by design
QUESTIONS = [
    "Where was Cet Sor born?",
    "What is the profession of Cet Sor?",
    "Which city does the corpus say Cet Sor lives in?",
    "What is cache-augmented generation?",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def post(port: int, body: dict, timeout: float = 300.0) -> tuple[dict, float | None, float, str]:
    """One streamed chat completion: (final mot_cag field, client TTFT, latency, streamed text)."""
    req = urllib.request.Request(f"http://{HOST}:{port}/v1/chat/completions", method="POST",
                                 data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"content-type": "application/json"})
    t0 = time.perf_counter()
    ttft = None
    text = ""
    final: dict | None = None
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if "error" in ev:
                raise RuntimeError(ev["error"]["message"])
            piece = ev["choices"][0]["delta"].get("content")
            if piece:
                if ttft is None:
                    ttft = time.perf_counter() - t0
                text += piece
            if "mot_cag" in ev:
                final = ev["mot_cag"]
    if final is None:
        raise RuntimeError("the stream ended without its final event")
    return final, ttft, time.perf_counter() - t0, text


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pipeline", default="pipelines/real.toml")
    ap.add_argument("--store", default=None)
    ap.add_argument("--target", action="append", default=None, help="repeatable; default: the pipeline's first")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of concurrent load (bounded)")
    ap.add_argument("--max-requests", type=int, default=2000, help="hard cap on requests (bounded)")
    ap.add_argument("--out", default=None, help="write the JSON summary here too")
    args = ap.parse_args()
    targets = args.target or [None]

    port = free_port()
    cmd = [sys.executable, "-m", "mot_cag", "serve", "--host", HOST, "--port", str(port), "--pipeline", args.pipeline,
           "--max-pending", str(max(32, 2 * args.clients))]
    if args.store:
        cmd += ["--store", args.store]
    for t in targets:
        if t:
            cmd += ["--target", t]
    log = open(Path(os.environ.get("TMPDIR", "/tmp")) / f"mot-cag-serve-{port}.log", "w")
    t_start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        while True:
            try:
                urllib.request.urlopen(f"http://{HOST}:{port}/health", timeout=2)
                break
            except OSError:
                if proc.poll() is not None or time.perf_counter() - t_start > 900:
                    print(f"server did not start; see {log.name}", file=sys.stderr)
                    return 1
                time.sleep(0.5)
        startup = time.perf_counter() - t_start
        jobs = [(t, q) for t in targets for q in QUESTIONS]

        def body(t, q):
            return {"messages": [{"role": "user", "content": q}], **({"model": t} if t else {})}

        ref: dict = {}
        seq_lat: list[float] = []
        for t, q in jobs:
            final, ttft, lat, text = post(port, body(t, q))
            ref[(t, q)] = (final["answer"], text)
            seq_lat.append(lat)
            print(f"sequential {t or 'default'}: {q!r} -> {final['answer']!r} ({lat:.2f}s)", flush=True)

        lock = threading.Lock()
        rows: list[dict] = []
        errors: list[str] = []
        stop_at = time.perf_counter() + args.duration
        counter = iter(range(args.max_requests))

        def client(n: int) -> None:
            i = n
            while time.perf_counter() < stop_at:
                with lock:
                    if next(counter, None) is None:
                        return
                t, q = jobs[i % len(jobs)]
                i += 1
                try:
                    final, ttft, lat, text = post(port, body(t, q))
                    same = (final["answer"], text) == ref[(t, q)]
                    with lock:
                        rows.append({"target": t, "latency_s": lat, "ttft_s": ttft,
                                     "server_ttft_s": final["timings"]["ttft_s"], "same": same})
                except (OSError, RuntimeError, urllib.error.HTTPError, ValueError) as e:
                    with lock:
                        errors.append(f"{type(e).__name__}: {e}")

        threads = [threading.Thread(target=client, args=(n,)) for n in range(args.clients)]
        t_load = time.perf_counter()
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        wall = time.perf_counter() - t_load
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()

    lat = [r["latency_s"] for r in rows]
    ttft = [r["ttft_s"] for r in rows if r["ttft_s"] is not None]
    sttft = [r["server_ttft_s"] for r in rows]
    summary = {
        "clients": args.clients, "duration_s": args.duration, "load_wall_s": round(wall, 1),
        "targets": [t or "default" for t in targets], "questions": len(QUESTIONS),
        "server_startup_s": round(startup, 1), "requests": len(rows), "errors": len(errors),
        "mismatches": sum(not r["same"] for r in rows),
        "throughput_rps": round(len(rows) / wall, 3) if wall else 0.0,
        "sequential_latency_p50_s": round(statistics.median(seq_lat), 3),
        "latency_p50_s": round(pct(lat, 0.5), 3), "latency_p95_s": round(pct(lat, 0.95), 3),
        "client_ttft_p50_s": round(pct(ttft, 0.5), 3), "client_ttft_p95_s": round(pct(ttft, 0.95), 3),
        "server_ttft_p50_s": round(pct(sttft, 0.5), 3), "server_ttft_p95_s": round(pct(sttft, 0.95), 3),
        "first_errors": errors[:5],
    }
    print(json.dumps(summary, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=1) + "\n")
    return 0 if not errors and summary["mismatches"] == 0 and rows else 1


if __name__ == "__main__":
    sys.exit(main())
