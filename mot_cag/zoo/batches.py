"""Training batches for the zoo recipe: spec-format text plus per-token loss weights.

Each training sequence is either a QA text (``{document}\\nQuestion: ...\\nAnswer: {cue} {value}.`` lines)
or a repeat text (``{document}\\nRepeat: {document}``). Character spans mark the answer values and the
repeated document so the loss can weight them and the log can report copy and answer accuracy.
The data of step ``s`` depends only on ``(seed, s)``, so a resumed run sees exactly the same data.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from mot_cag.data.synthetic import WorldBuilder, render_document

# Token roles in a batch (for weights and metrics).
ROLE_OTHER, ROLE_ANSWER, ROLE_COPY = 0, 1, 2


@dataclass(frozen=True)
class Curriculum:
    """How documents grow with training steps (short documents with many questions first)."""

    repeat_share: float = 0.4
    entities_start: int = 2
    entities_max: int = 8
    grow_every: int = 400  # one more entity per this many steps
    max_facts_per_entity: int = 3
    answer_weight: float = 3.0
    copy_weight: float = 1.0
    row_lens: tuple[tuple[int, int], ...] = ((0, 256), (1500, 512), (3000, 1024))  # (from step, tokens)
    # Every long_every-th step (from long_from) is a long step: 1024-token rows of long documents, so
    # lookups keep working across ~1000-token contexts (needle, multi-key) and absolute positions train.
    long_every: int = 4
    long_from: int = 300
    long_entities: tuple[int, int] = (10, 30)

    def is_long(self, step: int) -> bool:
        """Whether this step trains on long documents."""
        return step >= self.long_from and step % self.long_every == self.long_every - 1

    def row_len(self, step: int) -> int:
        """Packed row length at this step (longer rows once documents are longer)."""
        if self.is_long(step):
            return 1024
        return [n for s, n in self.row_lens if step >= s][-1]

    def n_entities(self, step: int, rng: random.Random) -> int:
        """Entities in a document at this step (uniform up to the current cap)."""
        if self.is_long(step):
            return rng.randint(*self.long_entities)
        cap = min(self.entities_max, self.entities_start + step // self.grow_every)
        return rng.randint(self.entities_start, cap)


def qa_sample(
    rng: random.Random, n_entities: int, facts_per_entity: int, n_questions: int
) -> tuple[str, list[tuple[int, int]]]:
    """A QA training text and the character spans of its answer values (leading space included)."""
    wb = WorldBuilder(rng, "train")
    facts = wb.facts(n_entities, facts_per_entity)
    text = render_document(facts, rng, title=rng.random() < 0.2, sep=rng.choice([" ", " ", "\n"]))
    spans = []
    for f in rng.sample(facts, min(n_questions, len(facts))):
        text += f"\nQuestion: {f.question()}\nAnswer: {f.cue()}"
        spans.append((len(text), len(text) + 1 + len(f.value)))
        text += f" {f.value}."
    return text, spans


def repeat_sample(rng: random.Random, n_entities: int, facts_per_entity: int) -> tuple[str, list[tuple[int, int]]]:
    """A repeat training text and the span of the repeated document (leading space included)."""
    wb = WorldBuilder(rng, "train")
    doc = render_document(wb.facts(n_entities, facts_per_entity), rng, sep=rng.choice([" ", "\n"]))
    text = f"{doc}\nRepeat:"
    return text + f" {doc}", [(len(text), len(text) + 1 + len(doc))]


def _sample(rng: random.Random, step: int, cur: Curriculum) -> tuple[str, list[tuple[int, int]], int]:
    n_ent = cur.n_entities(step, rng)
    fpe = rng.randint(1, cur.max_facts_per_entity)
    long = cur.is_long(step)
    if rng.random() < (cur.repeat_share / 2 if long else cur.repeat_share):
        # Long repeat documents are halved so that document + copy fit one 1024-token row.
        return (*repeat_sample(rng, n_ent // 2 if long else n_ent, min(fpe, 2)), ROLE_COPY)
    n_q = rng.randint(6, 12) if long else rng.randint(3, 6)
    return (*qa_sample(rng, n_ent, fpe, n_q), ROLE_ANSWER)


def _encode(tokenizer, text: str, spans: list[tuple[int, int]], role: int) -> tuple[list[int], list[int]]:
    enc = tokenizer(text, return_offsets_mapping=True)
    roles = [role if b > a and any(s <= a < e for s, e in spans) else ROLE_OTHER for (a, b) in enc["offset_mapping"]]
    ids = enc["input_ids"]
    if tokenizer.bos_token_id is None or ids[0] != tokenizer.bos_token_id:
        # Separate packed samples with EOS (OPT's tokenizer already starts each text with </s>).
        ids, roles = [tokenizer.eos_token_id] + ids, [ROLE_OTHER] + roles
    return ids, roles


def make_batch(tokenizer, step: int, seed: int, tokens_per_step: int, cur: Curriculum) -> dict[str, torch.Tensor]:
    """Build the batch of a training step: samples packed into rows of ``cur.row_len(step)`` tokens.

    Packing (rather than padding) keeps every token useful; samples are separated by EOS (OPT: its BOS
    ``</s>``) and a sample cut at the row end still trains on its first part.

    Returns:
        ``input_ids`` (B, T), ``attention_mask`` (B, T), ``weights`` (B, T) loss weights of each token as
        a label, and ``roles`` (B, T) with ``ROLE_*`` codes.
    """
    rng = random.Random(f"{seed}:{step}")
    t = cur.row_len(step)
    b = max(1, tokens_per_step // t)
    ids = torch.empty((b, t), dtype=torch.long)
    roles = torch.empty((b, t), dtype=torch.long)
    for i in range(b):
        row_ids: list[int] = []
        row_roles: list[int] = []
        while len(row_ids) < t:
            x, r = _encode(tokenizer, *_sample(rng, step, cur))
            row_ids += x
            row_roles += r
        ids[i] = torch.tensor(row_ids[:t])
        roles[i] = torch.tensor(row_roles[:t])
    weights = torch.where(
        roles == ROLE_ANSWER, cur.answer_weight, torch.where(roles == ROLE_COPY, cur.copy_weight, 1.0)
    )
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "weights": weights.float(), "roles": roles}
