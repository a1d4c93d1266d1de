"""The demo question through each real model's own stored chunks, per recompute setting."""
import json
import sys

import torch

from mot_cag.ingest import ingest
from mot_cag.pipeline.ask import Asker
from mot_cag.pipeline.context import Recompute

torch.set_num_threads(1)
Q = "Where was Cet Sor born?"
settings = [(0.0, "end"), (0.15, "end"), (0.25, "end"), (0.35, "end")]
for m in sys.argv[1:]:
    store = f"runs/demoq/store-{m}"
    ingest(["examples/corpus"], store, m, chunk_tokens=256, embedder="all-MiniLM-L6-v2")
    for r, p in settings:
        a = Asker(store, m, mode="translated", recompute=Recompute(r, p))
        res = a.ask(Q, top_k=4)
        print(json.dumps({"model": m, "R": r, "policy": p, "answer": res.answer}), flush=True)
