"""A held-out document corpus for long-context CAG: many short fact documents plus questions about them.

``mot-cag data corpus DIR`` writes ``DIR/docs/doc-XXX.txt`` (one synthetic-QA document per file, spec
format: a title line, then fact sentences about several entities) and ``DIR/questions.jsonl`` (one row per
question in the eval dataset format of docs/cli.md, ``context`` empty, ``doc`` naming the file that
holds the answer). Ingest ``DIR/docs`` into a store and evaluate with ``--store``: retrieval must find the
one document that answers each question.

Guarantees:

* held out: every invented string comes from the ``eval`` split of :mod:`mot_cag.data.names`, so nothing
  in the corpus occurs in training text;
* one answer per question: person names (entities and sibling values) are unique across the whole corpus
  (and none is a prefix of another), each entity lives in one document with at most one fact per relation;
* every template of the spec is used somewhere in the corpus (both templates of every relation);
* deterministic: the same :class:`CorpusConfig` always gives byte-identical files.
"""

from __future__ import annotations

import json
import random
import shutil
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from mot_cag.data.jsonl import write_jsonl
from mot_cag.data.synthetic import RELATIONS, Fact, WorldBuilder, render_document
from mot_cag.errors import MotCagError

DOCS_DIR = "docs"
QUESTIONS_FILE = "questions.jsonl"
CONFIG_FILE = "corpus.json"
TEMPLATES = ("forward", "inverted")


@dataclass(frozen=True)
class CorpusConfig:
    """Settings of a generated corpus (written next to it as ``corpus.json``).

    Attributes:
        docs: Number of documents.
        questions: Number of questions (spread over the documents round-robin, in a seeded order).
        seed: Random seed.
        facts_min: Fewest fact sentences in a document.
        facts_max: Most fact sentences in a document (10-14: about 130-260, mean 200, qwen2-mini tokens, so a
            document fits one 256-token chunk and four retrieved documents make about 800 tokens).
        max_facts_per_entity: Most facts about one entity (the zoo trains on 1-3).
        inverted_prob: Share of facts written with the inverted template.
    """

    docs: int = 40
    questions: int = 60
    seed: int = 7311
    facts_min: int = 10
    facts_max: int = 14
    max_facts_per_entity: int = 3
    inverted_prob: float = 0.5

    def __post_init__(self) -> None:
        if self.docs < 1 or self.questions < 1:
            raise MotCagError(f"A corpus needs at least one document and one question, got --docs {self.docs} "
                              f"and --questions {self.questions}.")
        if not 1 <= self.facts_min <= self.facts_max:
            raise MotCagError(f"Facts per document must be a range MIN-MAX with 1 <= MIN <= MAX, got "
                              f"{self.facts_min}-{self.facts_max}.")
        if not 1 <= self.max_facts_per_entity <= len(RELATIONS):
            raise MotCagError(f"max_facts_per_entity must be between 1 and {len(RELATIONS)}, got "
                              f"{self.max_facts_per_entity}.")
        if not 0.0 <= self.inverted_prob <= 1.0:
            raise MotCagError(f"inverted_prob must be between 0 and 1, got {self.inverted_prob}.")
        if self.questions > self.docs * self.facts_min:
            raise MotCagError(f"{self.questions} questions may not fit in {self.docs} documents of at least "
                              f"{self.facts_min} facts; ask fewer questions or generate more documents.")


def parse_facts_range(text: str) -> tuple[int, int]:
    """Parse ``--facts-per-doc``: ``"8-14"`` (a range) or ``"10"`` (exactly that many).

    Raises:
        MotCagError: The text is neither form.
    """
    lo, _, hi = text.partition("-")
    try:
        return int(lo), int(hi or lo)
    except ValueError:
        raise MotCagError(f"--facts-per-doc takes MIN-MAX (e.g. 8-14) or one number, not '{text}'.") from None


@dataclass
class CorpusDoc:
    """One document: its file name, its text and the facts it states."""

    name: str
    text: str
    facts: list[Fact]


@dataclass
class Corpus:
    """A generated corpus (not yet written): documents and question rows."""

    config: CorpusConfig
    docs: list[CorpusDoc]
    questions: list[dict]


@dataclass
class CorpusSummary:
    """What :func:`write_corpus` wrote; :meth:`to_json` is the ``mot-cag data corpus --json`` record.

    Attributes:
        dir: The corpus folder.
        docs: Documents written.
        questions: Questions written.
        seed: Random seed.
        chars: Characters over all documents.
        tokens: Tokens over all documents (``tokenizer``'s, no special tokens), or ``None`` unmeasured.
        doc_tokens: ``{"min", "mean", "max"}`` tokens per document, or ``None`` unmeasured.
        tokenizer: Name of the measuring tokenizer's model, or ``None``.
    """

    dir: str
    docs: int
    questions: int
    seed: int
    chars: int
    tokens: int | None = None
    doc_tokens: dict[str, float] | None = None
    tokenizer: str | None = None
    templates: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict:
        """JSON-serialisable form."""
        return asdict(self)


class _CorpusNames:
    """Person names unique across the corpus (neither equal to nor a prefix of another)."""

    def __init__(self) -> None:
        self.taken: set[str] = set()

    def fresh(self, draw: Callable[[], str]) -> str:
        for _ in range(200):
            name = draw()
            if all(not (name.startswith(t) or t.startswith(name)) for t in self.taken):
                self.taken.add(name)
                return name
        raise MotCagError("The held-out name space is exhausted; generate fewer documents.")  # practically never


def _document_facts(rng: random.Random, wb: WorldBuilder, people: _CorpusNames, cfg: CorpusConfig) -> list[Fact]:
    """Facts of one document: ``facts_min``..``facts_max`` sentences about several fresh entities."""
    n_facts = rng.randint(cfg.facts_min, cfg.facts_max)
    facts: list[Fact] = []
    while len(facts) < n_facts:
        k = min(rng.randint(min(2, cfg.max_facts_per_entity), cfg.max_facts_per_entity), n_facts - len(facts))
        ent = people.fresh(wb.entity)
        for rel in rng.sample(list(RELATIONS), k):
            # Person values get corpus-unique names too, so a name in a question points at one document.
            value = people.fresh(lambda rel=rel: wb.value(rel)) if RELATIONS[rel].kind == "person" else wb.value(rel)
            facts.append(Fact(ent, rel, value, wb.template()))
    rng.shuffle(facts)
    return facts


def _cover_templates(docs: list[list[Fact]]) -> None:
    """Flip templates where needed so both templates of every relation occur (relations stated twice or more)."""
    for rel in RELATIONS:
        where = [(d, i) for d, facts in enumerate(docs) for i, f in enumerate(facts) if f.relation == rel]
        for tpl in TEMPLATES:
            if len(where) < 2 or any(docs[d][i].template == tpl for d, i in where):
                continue
            d, i = where[-1]
            f = docs[d][i]
            docs[d][i] = Fact(f.entity, f.relation, f.value, tpl)


def _question_row(idx: str, doc: CorpusDoc, fact: Fact) -> dict:
    return {
        "id": idx,
        "context": "",
        "question": fact.question(),
        "answer": fact.value,
        "cue": fact.cue(),
        "doc": doc.name,
        "template": fact.template,
        "relation": fact.relation,
    }


def _questions(rng: random.Random, docs: list[CorpusDoc], cfg: CorpusConfig) -> list[dict]:
    """Questions round-robin over the documents (a fresh seeded order each round), alternating templates."""
    asked: list[set[int]] = [set() for _ in docs]
    rows: list[dict] = []
    order: list[int] = []
    while len(rows) < cfg.questions:
        if not order:
            order = list(range(len(docs)))
            rng.shuffle(order)
        d = order.pop(0)
        left = [i for i in range(len(docs[d].facts)) if i not in asked[d]]
        if not left:
            continue
        want = TEMPLATES[len(rows) % 2]
        pick = [i for i in left if docs[d].facts[i].template == want] or left
        i = rng.choice(pick)
        asked[d].add(i)
        rows.append(_question_row(f"corpus-{cfg.seed}-{len(rows)}", docs[d], docs[d].facts[i]))
    return rows


def make_corpus(cfg: CorpusConfig | None = None) -> Corpus:
    """Generate a held-out corpus in memory (see the module docstring for its guarantees).

    Args:
        cfg: Corpus settings (default :class:`CorpusConfig`).

    Returns:
        The documents (file names ``doc-000.txt``...) and the question rows.
    """
    cfg = cfg or CorpusConfig()
    rng = random.Random(f"corpus:{cfg.seed}")
    wb = WorldBuilder(rng, "eval", cfg.inverted_prob)
    people = _CorpusNames()
    all_facts = []
    for _ in range(cfg.docs):
        wb.reset()  # invented values need only be unique within their document
        all_facts.append(_document_facts(rng, wb, people, cfg))
    _cover_templates(all_facts)
    width = max(3, len(str(cfg.docs - 1)))
    docs = [
        CorpusDoc(f"doc-{n:0{width}d}.txt", render_document(facts, rng, title=True, sep=rng.choice([" ", "\n"])),
                  facts)
        for n, facts in enumerate(all_facts)
    ]
    return Corpus(cfg, docs, _questions(rng, docs, cfg))


def write_corpus(corpus: Corpus, folder: str | Path, force: bool = False, tokenizer=None,
                 tokenizer_name: str | None = None) -> CorpusSummary:
    """Write a corpus: ``folder/docs/doc-XXX.txt``, ``folder/questions.jsonl`` and ``folder/corpus.json``.

    Args:
        corpus: From :func:`make_corpus`.
        folder: The corpus folder (created when absent).
        force: Replace an existing non-empty ``folder/docs`` (its contents are deleted first, so no stale
            document from an earlier corpus stays behind).
        tokenizer: Optional Hugging Face tokenizer to measure the documents' lengths in tokens.
        tokenizer_name: Name recorded for ``tokenizer`` in the summary.

    Returns:
        A summary of what was written.

    Raises:
        MotCagError: ``folder/docs`` exists, is not empty, and ``force`` is off.
    """
    root = Path(folder)
    docs_dir = root / DOCS_DIR
    if docs_dir.exists() and any(docs_dir.iterdir()):
        if not force:
            raise MotCagError(f"{docs_dir} is not empty; pass --force to replace it, or choose another folder.")
        shutil.rmtree(docs_dir)
    docs_dir.mkdir(parents=True, exist_ok=True)
    for doc in corpus.docs:
        (docs_dir / doc.name).write_text(doc.text + "\n", encoding="utf-8")
    write_jsonl(corpus.questions, root / QUESTIONS_FILE)
    meta = {"generator": "mot_cag.data.corpus", "split": "eval", **asdict(corpus.config)}
    (root / CONFIG_FILE).write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")
    templates = {t: sum(q["template"] == t for q in corpus.questions) for t in TEMPLATES}
    summary = CorpusSummary(str(root), len(corpus.docs), len(corpus.questions), corpus.config.seed,
                            sum(len(d.text) for d in corpus.docs), templates=templates)
    if tokenizer is not None:
        lengths = doc_token_lengths(corpus, tokenizer)
        summary.tokens = sum(lengths)
        summary.doc_tokens = {"min": min(lengths), "mean": round(statistics.fmean(lengths), 1), "max": max(lengths)}
        summary.tokenizer = tokenizer_name
    return summary


def doc_token_lengths(corpus: Corpus, tokenizer) -> list[int]:
    """Tokens per document (no special tokens, as the store's chunker counts them)."""
    return [len(tokenizer(d.text, add_special_tokens=False)["input_ids"]) for d in corpus.docs]
