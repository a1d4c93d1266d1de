"""Quick measurements of a zoo model on held-out synthetic data (for training logs and model cards).

Not the product's ``mot-cag eval`` (built separately); this is the recipe's own tape measure:

* extractive exact match with the cue prompt, computed teacher-forced: ``" {value}"`` is an exact greedy
  prediction iff every one of its tokens is the argmax and the next argmax ends the answer (``.``, ``.\n``
  or a newline), so one forward pass replaces generation;
* mean NLL per token of ``" {value}"`` with and without the document;
* closed-set accuracy by the likelihood of ``" {option}."`` after the cue;
* repeat-task teacher-forced top-1 token accuracy (first token excluded), with and without the document.
"""

from __future__ import annotations

from pathlib import Path

import torch

from mot_cag.data.synthetic import synth_dataset


def _prompt(ex: dict, with_context: bool) -> str:
    q = f"Question: {ex['question']}\nAnswer: {ex['cue']}"
    return f"{ex['context']}\n{q}" if with_context else q


@torch.no_grad()
def continuation_stats(model, tokenizer, prompt: str, continuation: str) -> tuple[float, int, bool, str]:
    """Score a continuation after a prompt (teacher-forced).

    Args:
        model: A causal LM (eval mode).
        tokenizer: Its tokenizer.
        prompt: Text before the continuation (special tokens such as OPT's BOS are added to it).
        continuation: Text to score (no special tokens).

    Returns:
        ``(sum_nll, n_tokens, all_argmax_correct, next_text)``: NLL summed over the continuation tokens,
        their count, whether each was the argmax, and the decoded argmax token that would follow them.
    """
    p = tokenizer(prompt)["input_ids"]
    c = tokenizer(continuation, add_special_tokens=False)["input_ids"]
    ids = torch.tensor([p + c], device=model.device)
    logits = model(input_ids=ids).logits[0, len(p) - 1 :].float()  # predictions for each continuation token + 1
    target = ids[0, len(p) :]
    logp = torch.log_softmax(logits[:-1], -1).gather(1, target[:, None])[:, 0]
    correct = logits[:-1].argmax(-1) == target
    next_text = tokenizer.decode([int(logits[-1].argmax())])
    return float(-logp.sum()), len(c), bool(correct.all()), next_text


def _ends_answer(next_text: str, eos: str | None) -> bool:
    # The spec's prediction ends at "." followed by a space or line end, or at a newline; tokenizers that
    # merge ".\n" (Qwen2-style) end the value with that single token.
    return next_text.startswith(("\n", ".")) or (eos is not None and next_text == eos)


def qa_metrics(model, tokenizer, examples: list[dict]) -> dict:
    """Exact match and answer NLL with and without the document (extractive examples with a cue).

    Exact match: every token of ``" {answer}"`` is the argmax and the argmax after it ends the answer
    (``.``, ``.\n`` or a newline), which is what greedy decoding with the spec's stop rule would return.
    NLL: mean per token of ``" {answer}"``.
    """
    out = {}
    for mode, with_ctx in (("direct", True), ("none", False)):
        em, nll, ntok = 0, 0.0, 0
        for ex in examples:
            s, k, ok, nxt = continuation_stats(model, tokenizer, _prompt(ex, with_ctx), f" {ex['answer']}")
            em += ok and _ends_answer(nxt, tokenizer.eos_token)
            nll += s
            ntok += k
        out[mode] = {"exact_match": em / len(examples), "nll": nll / max(ntok, 1)}
    return out


def closed_metrics(model, tokenizer, examples: list[dict]) -> dict:
    """Closed-set accuracy (most likely option after the cue) with and without the document."""
    out = {}
    for mode, with_ctx in (("direct", True), ("none", False)):
        right = 0
        for ex in examples:
            scores = [-continuation_stats(model, tokenizer, _prompt(ex, with_ctx), f" {o}.")[0] for o in ex["options"]]
            right += int(max(range(len(scores)), key=scores.__getitem__) == ex["answer_index"])
        out[mode] = {"accuracy": right / len(examples)}
    return out


def repeat_metrics(model, tokenizer, examples: list[dict]) -> dict:
    """Teacher-forced top-1 accuracy on the repeated document's tokens (first excluded)."""
    out = {}
    for mode, with_ctx in (("direct", True), ("none", False)):
        right, total = 0, 0
        for ex in examples:
            prompt = f"{ex['context']}\nRepeat:" if with_ctx else "Repeat:"
            p = tokenizer(prompt)["input_ids"]
            c = tokenizer(" " + ex["context"], add_special_tokens=False)["input_ids"]
            ids = torch.tensor([p + c], device=model.device)
            with torch.no_grad():
                pred = model(input_ids=ids).logits[0, len(p) - 1 : -1].argmax(-1)
            hits = (pred == ids[0, len(p) :])[1:]
            right += int(hits.sum())
            total += hits.numel()
        out[mode] = {"token_accuracy": right / max(total, 1)}
    return out


def quick_eval(
    model,
    tokenizer,
    n: int = 40,
    seed: int = 9001,
    n_entities: int = 3,
    facts_per_entity: int = 2,
    long_tokens: int | None = None,
    multikey: bool = False,
) -> dict:
    """Run the quick measurements on fresh held-out data (``split="eval"``: unseen names and values).

    Args:
        model: The model (any device; eval mode is set here and restored).
        tokenizer: Its tokenizer.
        n: Examples per task.
        seed: Data seed (keep it away from training seeds; eval strings are unseen either way).
        n_entities: Entities per QA document.
        facts_per_entity: Facts per entity.
        long_tokens: If set, also run the needle task at about this many tokens of context.
        multikey: With ``long_tokens``, also run the multi-key task.

    Returns:
        ``{"qa_forward": ..., "qa_inverted": ..., "closed": ..., "repeat": ..., ["needle": ...]}`` with
        ``direct``/``none`` sub-dicts.
    """
    was_training = model.training
    model.eval()
    kw = {"n_entities": n_entities, "facts_per_entity": facts_per_entity}
    res = {
        "qa_forward": qa_metrics(model, tokenizer, synth_dataset("qa", n, seed, template="forward", **kw)),
        "qa_inverted": qa_metrics(model, tokenizer, synth_dataset("qa", n, seed + 1, template="inverted", **kw)),
        "closed": closed_metrics(model, tokenizer, synth_dataset("closed", n, seed + 2, template="forward", **kw)),
        "repeat": repeat_metrics(model, tokenizer, synth_dataset("repeat", n, seed + 3, **kw)),
    }
    if long_tokens:
        for i, task in enumerate(("needle", "multikey")[: 2 if multikey else 1]):
            rows = synth_dataset(task, max(n // 2, 1), seed + 4 + i, context_tokens=long_tokens, tokenizer=tokenizer)
            res[task] = qa_metrics(model, tokenizer, rows)
    model.train(was_training)
    return res


def summary_line(res: dict) -> str:
    """One log line of the headline numbers."""
    parts = []
    for key in ("qa_forward", "qa_inverted", "needle", "multikey"):
        if key in res:
            r = res[key]
            parts.append(
                f"{key} EM {r['direct']['exact_match']:.2f}/{r['none']['exact_match']:.2f} "
                f"NLL {r['direct']['nll']:.2f}/{r['none']['nll']:.2f}"
            )
    if "closed" in res:
        parts.append(f"closed {res['closed']['direct']['accuracy']:.2f}/{res['closed']['none']['accuracy']:.2f}")
    if "repeat" in res:
        parts.append(
            f"repeat {res['repeat']['direct']['token_accuracy']:.2f}/{res['repeat']['none']['token_accuracy']:.2f}"
        )
    return " | ".join(parts) + "  (direct/none)"


def table(results: dict[str, dict]) -> str:
    """A markdown table of quick_eval results, one row per model (direct / none)."""
    head = (
        "| model | steps | repeat tok acc | QA fwd EM | QA fwd NLL | QA inv EM | closed acc | needle EM | "
        "multikey EM |\n|---|---|---|---|---|---|---|---|---|"
    )
    rows = [head]
    for name, r in results.items():

        def pair(task: str, key: str, r: dict = r) -> str:
            if task not in r:
                return "-"
            return f"{r[task]['direct'][key]:.2f} / {r[task]['none'][key]:.2f}"

        rows.append(
            f"| {name} | {r.get('steps', '-')} | {pair('repeat', 'token_accuracy')} | "
            f"{pair('qa_forward', 'exact_match')} | {pair('qa_forward', 'nll')} | "
            f"{pair('qa_inverted', 'exact_match')} | {pair('closed', 'accuracy')} | "
            f"{pair('needle', 'exact_match')} | {pair('multikey', 'exact_match')} |"
        )
    return "\n".join(rows)


def eval_folder(name_or_dir: str) -> Path:
    """The folder of a zoo model (by name: its shipped folder) or of an exported model.

    Raises:
        MotCagError: Neither a zoo name with shipped weights nor a folder holding a saved model.
    """
    from mot_cag.errors import MotCagError
    from mot_cag.zoo.models import ZOO, model_dir

    folder = model_dir(name_or_dir) if name_or_dir in ZOO else Path(name_or_dir)
    if not (folder / "config.json").is_file():
        what = f"Zoo model {name_or_dir} has no weights in {folder}" if name_or_dir in ZOO else (
            f"'{name_or_dir}' is neither a zoo model ({', '.join(ZOO)}) nor a folder holding a saved model")
        raise MotCagError(f"{what}; train or export it with `mot-cag zoo train NAME`.")
    return folder


def load_for_eval(name_or_dir: str, device: torch.device | str = "cpu") -> tuple[torch.nn.Module, object, int | None]:
    """Load a zoo model or an exported folder (see :func:`eval_folder`) for :func:`quick_eval`.

    Returns:
        ``(model, tokenizer, steps)``: the model in fp32 and eval mode on ``device``, its tokenizer, and the
        training steps from its ``card.json`` (``None`` without a card).

    Raises:
        MotCagError: Neither a zoo name with shipped weights nor a folder holding a saved model.
    """
    import json

    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = eval_folder(name_or_dir)
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).float().eval().to(device)
    card = folder / "card.json"
    steps = json.loads(card.read_text())["steps"] if card.exists() else None
    return model, tok, steps


def eval_models(
    names: list[str],
    n: int = 100,
    seed: int = 9001,
    long_tokens: int | None = 1000,
    device: torch.device | str = "cpu",
    on_result=None,
) -> dict[str, dict]:
    """:func:`quick_eval` (with needle and multi-key) of several models, each loaded by :func:`load_for_eval`.

    Args:
        names: Zoo names or model folders.
        n: Examples per task.
        seed: Data seed.
        long_tokens: Context length of the needle and multi-key tasks (``None`` or 0: skip them).
        device: Where the models run.
        on_result: Called as ``on_result(name, result)`` after each model (progress).

    Returns:
        ``{name: quick_eval result plus "steps"}`` in the order given; :func:`table` renders it.
    """
    results = {}
    for name in names:
        model, tok, steps = load_for_eval(name, device)
        res = quick_eval(model, tok, n=n, seed=seed, long_tokens=long_tokens, multikey=True)
        res["steps"] = steps
        results[name] = res
        if on_result is not None:
            on_result(name, res)
    return results


def main(argv: list[str] | None = None) -> None:
    """``python -m mot_cag.zoo.quick_eval [NAME_OR_DIR ...] [--n N] [--seed S] [--long-tokens T] [--json F]``."""
    import argparse
    import json

    from mot_cag.zoo.models import ZOO

    ap = argparse.ArgumentParser(description="Quick held-out evaluation of zoo models (direct / none).")
    ap.add_argument("models", nargs="*", default=list(ZOO))
    ap.add_argument("--n", type=int, default=100)
    ap.add_argument("--seed", type=int, default=9001)
    ap.add_argument("--long-tokens", type=int, default=1000)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    results = eval_models(a.models, n=a.n, seed=a.seed, long_tokens=a.long_tokens,
                          on_result=lambda name, res: print(name, summary_line(res), flush=True))
    print(table(results))
    if a.json:
        a.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()


__all__ = [
    "quick_eval",
    "eval_models",
    "load_for_eval",
    "eval_folder",
    "qa_metrics",
    "closed_metrics",
    "repeat_metrics",
    "continuation_stats",
    "summary_line",
    "table",
]
