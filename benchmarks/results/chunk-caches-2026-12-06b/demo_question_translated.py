"""The demo question, SmolLM2's store translated to the other two real targets: the default vs replay-joint."""
import json

import torch

from mot_cag.pipeline.ask import Asker

torch.set_num_threads(1)
Q = "Where was Cet Sor born?"
for t in ["qwen2.5-coder-0.5b", "gemma-3-270m"]:
    for inj in ["auto", "replay-joint"]:
        a = Asker("stores/demo-real", t, mode="translated", injection=inj)
        r = a.ask(Q, top_k=4)
        print(json.dumps({"target": t, "injection": inj, "builder": type(a.builder).__name__,
                          "recompute": a.builder.recompute.ratio, "answer": r.answer,
                          "ttft_s": round(r.timings.get("ttft_s", 0), 2)}), flush=True)
