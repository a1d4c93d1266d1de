"""Synthetic fact QA following docs/synthetic-qa.md (the format is fixed; do not drift from it).

A *world* is a set of entities (invented person names) with facts; a *document* renders some facts as
sentences, each with the relation's forward or inverted template. From documents we build:

* dataset examples (the JSONL rows of docs/cli.md) for the tasks ``qa`` (extractive), ``closed``
  (four options), ``repeat`` (copy fidelity), ``needle`` and ``multikey`` (long context) and
  ``multihop`` (optional in the spec);
* training text: ``{document}\\nQuestion: {question}\\nAnswer: {cue} {value}.`` with several Q/A lines per
  document, and ``{document}\\nRepeat: {document}``.

Values are open-vocabulary: invented strings are drawn from the ``train`` or ``eval`` split of
:mod:`mot_cag.data.names`, so evaluation data (``split="eval"``, the default of :func:`synth_dataset`)
never shares an invented name, place, company or digit string with training text.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from mot_cag.data import names
from mot_cag.data.names import Split

TASKS = ("qa", "closed", "repeat", "needle", "multikey", "multihop")


@dataclass(frozen=True)
class Relation:
    """One relation of the spec: its value kind, its two templates and its question."""

    name: str
    kind: str
    forward: str
    inverted: str
    question: str

    @property
    def cue_template(self) -> str:
        """The forward template up to ``{v}`` (the answer prefix), e.g. ``"{e} was born in"``."""
        return self.forward.split("{v}")[0].rstrip()


RELATIONS: dict[str, Relation] = {
    r.name: r
    for r in [
        Relation("born_in", "place", "{e} was born in {v}.", "{v} is the birthplace of {e}.", "Where was {e} born?"),
        Relation("lives_in", "place", "{e} lives in {v}.", "The home of {e} is in {v}.", "Where does {e} live?"),
        Relation(
            "profession",
            "profession",
            "{e} works as a {v}.",
            "By trade, {e} is a {v}.",
            "What is the profession of {e}?",
        ),
        Relation("employer", "company", "{e} is employed by {v}.", "{v} employs {e}.", "Who employs {e}?"),
        Relation(
            "color",
            "color",
            "The favorite color of {e} is {v}.",
            "{e} likes the color {v} best.",
            "What is the favorite color of {e}?",
        ),
        Relation("pet", "pet", "{e} owns a pet {v}.", "The pet of {e} is a {v}.", "What pet does {e} own?"),
        Relation(
            "instrument",
            "instrument",
            "{e} plays the {v}.",
            "The instrument of {e} is the {v}.",
            "Which instrument does {e} play?",
        ),
        Relation(
            "sibling",
            "person",
            "{e} is the sibling of {v}.",
            "The sibling of {e} is {v}.",
            "Who is the sibling of {e}?",
        ),
        Relation(
            "year",
            "year",
            "{e} arrived in the city in {v}.",
            "In {v}, {e} arrived in the city.",
            "In which year did {e} arrive in the city?",
        ),
        Relation(
            "code",
            "code",
            "The access code of {e} is {v}.",
            "{e} uses the access code {v}.",
            "What is the access code of {e}?",
        ),
    ]
}

# Ordinary words; "a {v}" templates get consonant-initial words so the English stays grammatical.
WORDS: dict[str, list[str]] = {
    "profession": [
        "baker",
        "teacher",
        "pilot",
        "nurse",
        "farmer",
        "lawyer",
        "painter",
        "chemist",
        "plumber",
        "dentist",
        "carpenter",
        "librarian",
        "tailor",
        "butcher",
        "sailor",
        "writer",
        "banker",
        "doctor",
        "gardener",
        "potter",
        "singer",
        "dancer",
        "jeweler",
        "mechanic",
        "surgeon",
        "brewer",
        "fisher",
        "miner",
        "judge",
        "clerk",
    ],
    "color": [
        "red",
        "blue",
        "green",
        "yellow",
        "purple",
        "orange",
        "pink",
        "brown",
        "black",
        "white",
        "gray",
        "teal",
        "violet",
        "indigo",
        "maroon",
        "beige",
        "crimson",
        "silver",
        "gold",
        "navy",
        "olive",
        "amber",
        "coral",
        "lilac",
    ],
    "pet": [
        "cat",
        "dog",
        "parrot",
        "rabbit",
        "hamster",
        "turtle",
        "goldfish",
        "ferret",
        "lizard",
        "snake",
        "canary",
        "pony",
        "gecko",
        "mouse",
        "tortoise",
        "pigeon",
        "frog",
        "spider",
        "chinchilla",
        "duck",
    ],
    "instrument": [
        "piano",
        "violin",
        "guitar",
        "flute",
        "cello",
        "drums",
        "trumpet",
        "harp",
        "clarinet",
        "oboe",
        "banjo",
        "saxophone",
        "trombone",
        "ukulele",
        "viola",
        "tuba",
        "accordion",
        "harmonica",
        "bassoon",
        "mandolin",
    ],
}

_TITLES = ["Records", "Notes on residents", "Town register", "Census extract", "Personnel file", "Profiles"]


@dataclass(frozen=True)
class Fact:
    """A (entity, relation, value) triple and the template it is rendered with."""

    entity: str
    relation: str
    value: str
    template: str = "forward"  # "forward" | "inverted"

    def sentence(self) -> str:
        """Render the fact as one sentence with its template."""
        rel = RELATIONS[self.relation]
        tpl = rel.forward if self.template == "forward" else rel.inverted
        text = tpl.format(e=self.entity, v=self.value)
        return text[0].upper() + text[1:]

    def question(self) -> str:
        """The spec's question for this fact."""
        return RELATIONS[self.relation].question.format(e=self.entity)

    def cue(self) -> str:
        """The answer prefix: the forward template up to the value, entity filled in."""
        return RELATIONS[self.relation].cue_template.format(e=self.entity)


def draw_value(rng: random.Random, kind: str, split: Split) -> str:
    """Draw one value of a kind (``place``, ``company``, ``person``, ``year``, ``code`` or a word kind)."""
    if kind == "place":
        return names.place_name(rng, split)
    if kind == "company":
        return names.company_name(rng, split)
    if kind == "person":
        return names.person_name(rng, split)
    if kind == "year":
        return names.year_string(rng, split)
    if kind == "code":
        return names.digit_string(rng, 4, 8, split)
    return rng.choice(WORDS[kind])


class WorldBuilder:
    """Draws entities and facts, keeping names unique within one document.

    Args:
        rng: The random source (seeded by the caller).
        split: Which split of invented strings to draw from (``"train"`` or ``"eval"``).
        inverted_prob: Probability that a fact is rendered with its inverted template.
    """

    def __init__(self, rng: random.Random, split: Split = "eval", inverted_prob: float = 0.5) -> None:
        self.rng = rng
        self.split = split
        self.inverted_prob = inverted_prob
        self._used: set[str] = set()

    def reset(self) -> None:
        """Forget the names used so far (call once per document)."""
        self._used = set()

    def _unique(self, make: Callable[[], str]) -> str:
        for _ in range(200):
            text = make()
            # Unique and not a prefix of another: "Ana Bel" vs "Ana Belmor" would make lookup ambiguous.
            if all(not (text.startswith(u) or u.startswith(text)) for u in self._used):
                self._used.add(text)
                return text
        raise RuntimeError("name space exhausted; use fewer entities per document")

    def entity(self) -> str:
        """Draw a fresh entity name."""
        return self._unique(lambda: names.person_name(self.rng, self.split))

    def value(self, relation: str) -> str:
        """Draw a value for a relation (invented values are unique within the document)."""
        kind = RELATIONS[relation].kind
        if kind in WORDS:
            return draw_value(self.rng, kind, self.split)
        return self._unique(lambda: draw_value(self.rng, kind, self.split))

    def template(self, template: str | None = None) -> str:
        """Pick a template: the given one, or inverted with probability ``inverted_prob``."""
        if template is not None:
            return template
        return "inverted" if self.rng.random() < self.inverted_prob else "forward"

    def facts(
        self,
        n_entities: int,
        facts_per_entity: int,
        relations: Iterable[str] | None = None,
        template: str | None = None,
    ) -> list[Fact]:
        """Draw ``n_entities`` entities with ``facts_per_entity`` distinct relations each, shuffled."""
        pool = list(relations or RELATIONS)
        out: list[Fact] = []
        for _ in range(n_entities):
            ent = self.entity()
            for rel in self.rng.sample(pool, min(facts_per_entity, len(pool))):
                out.append(Fact(ent, rel, self.value(rel), self.template(template)))
        self.rng.shuffle(out)
        return out


def render_document(
    facts: Iterable[Fact], rng: random.Random | None = None, title: bool = False, sep: str = " "
) -> str:
    """Render facts as a document: one sentence per fact, optionally under a title line."""
    body = sep.join(f.sentence() for f in facts)
    if title and rng is not None:
        return f"{rng.choice(_TITLES)}.\n{body}"
    return body


def qa_line(fact: Fact) -> str:
    """One training Q/A block: ``Question: {question}\\nAnswer: {cue} {value}.``"""
    return f"Question: {fact.question()}\nAnswer: {fact.cue()} {fact.value}."


def qa_training_text(
    rng: random.Random,
    n_entities: int = 3,
    facts_per_entity: int = 2,
    n_questions: int = 3,
    split: Split = "train",
    inverted_prob: float = 0.5,
) -> str:
    """One training sequence: a document followed by several question/answer lines (spec format).

    Args:
        rng: Random source.
        n_entities: Entities in the document.
        facts_per_entity: Facts per entity.
        n_questions: Q/A lines after the document (capped by the number of facts).
        split: Split of invented strings; training uses ``"train"`` so eval strings stay unseen.
        inverted_prob: Share of facts written with the inverted template.

    Returns:
        ``{document}\\nQuestion: ...\\nAnswer: {cue} {value}.`` repeated ``n_questions`` times.
    """
    wb = WorldBuilder(rng, split, inverted_prob)
    facts = wb.facts(n_entities, facts_per_entity)
    doc = render_document(facts, rng, title=rng.random() < 0.2, sep=rng.choice([" ", " ", "\n"]))
    asked = rng.sample(facts, min(n_questions, len(facts)))
    return doc + "\n" + "\n".join(qa_line(f) for f in asked)


def repeat_training_text(
    rng: random.Random, n_entities: int = 3, facts_per_entity: int = 2, split: Split = "train"
) -> str:
    """One copy-task training sequence: ``{document}\\nRepeat: {document}``."""
    wb = WorldBuilder(rng, split)
    doc = render_document(wb.facts(n_entities, facts_per_entity), rng, sep=rng.choice([" ", "\n"]))
    return f"{doc}\nRepeat: {doc}"


# ---------------------------------------------------------------------------------------------------
# Dataset examples (cli.md JSONL rows)


def _qa_example(idx: str, doc: str, fact: Fact) -> dict:
    return {
        "id": idx,
        "context": doc,
        "question": fact.question(),
        "answer": fact.value,
        "cue": fact.cue(),
        "relation": fact.relation,
        "template": fact.template,
    }


def _options(rng: random.Random, wb: WorldBuilder, fact: Fact, facts: list[Fact]) -> list[str]:
    """Four options: the answer, same-relation values from the document first, then fresh ones."""
    opts = [fact.value]
    same = [f.value for f in facts if f.relation == fact.relation and f.value not in opts]
    rng.shuffle(same)
    for v in same:
        if len(opts) < 4 and v not in opts:
            opts.append(v)
    kind = RELATIONS[fact.relation].kind
    while len(opts) < 4:
        v = draw_value(rng, kind, wb.split)
        if v not in opts:
            opts.append(v)
    rng.shuffle(opts)
    return opts


def _fill_to_length(
    wb: WorldBuilder, facts: list[Fact], target_chars: int, relations: list[str], measure: Callable[[str], int]
) -> list[Fact]:
    """Add distractor facts about fresh entities until the rendered document reaches ``target_chars``."""
    while measure(render_document(facts)) < target_chars:
        ent = wb.entity()
        for rel in wb.rng.sample(relations, 2):
            facts.append(Fact(ent, rel, wb.value(rel), wb.template()))
    return facts


def _length_measure(context_tokens: int | None, context_chars: int | None, tokenizer) -> tuple[int, Callable]:
    """Return (target, measure) where measure(text) is in the same unit as target."""
    if context_tokens is not None:
        if tokenizer is not None:
            return context_tokens, lambda t: len(tokenizer(t, add_special_tokens=False)["input_ids"])
        # Without a tokenizer assume ~4 characters per token (an English-BPE rule of thumb).
        return context_tokens * 4, len
    return (context_chars or 4000), len


def synth_dataset(
    task: str,
    n: int,
    seed: int,
    *,
    split: Split = "eval",
    n_entities: int = 4,
    facts_per_entity: int = 3,
    template: str | None = None,
    inverted_prob: float = 0.5,
    context_tokens: int | None = None,
    context_chars: int | None = None,
    n_keys: int = 4,
    tokenizer=None,
) -> list[dict]:
    """Generate a synthetic dataset (rows of the cli.md JSONL format).

    Args:
        task: One of ``qa`` (extractive, with ``cue``), ``closed`` (``options``/``answer_index``),
            ``repeat`` (``task="repeat"``, answer = context), ``needle`` (one ``code`` fact among unrelated
            facts), ``multikey`` (several ``code`` facts, one asked) or ``multihop`` (sibling -> lives_in).
        n: Number of examples.
        seed: Random seed; the same arguments always give the same rows.
        split: Split of invented strings; ``"eval"`` (default) guarantees strings never seen in training.
        n_entities: Entities per document (qa, closed, repeat).
        facts_per_entity: Facts per entity (qa, closed, repeat).
        template: Force ``"forward"`` or ``"inverted"`` templates; ``None`` mixes them (``inverted_prob``).
        inverted_prob: Share of inverted-template facts when ``template`` is ``None``.
        context_tokens: Target context length in tokens for needle/multikey/multihop (measured with
            ``tokenizer`` if given, else estimated as 4 characters per token).
        context_chars: Target context length in characters (used when ``context_tokens`` is None;
            default 4000).
        n_keys: Number of ``code`` facts in multikey.
        tokenizer: Optional Hugging Face tokenizer used to measure ``context_tokens``.

    Returns:
        A list of dicts with ``id``, ``context``, ``question``, ``answer``, ``cue`` and task-specific fields
        (``options``/``answer_index``, ``task``, ``template``, ``relation``).

    Raises:
        ValueError: For an unknown task or a non-positive ``n``.
    """
    if task not in TASKS:
        raise ValueError(f"Unknown synthetic task '{task}'; choose one of {', '.join(TASKS)}.")
    if n <= 0:
        raise ValueError(f"n must be positive, got {n}.")
    rng = random.Random(f"{task}:{seed}")
    wb = WorldBuilder(rng, split, inverted_prob)
    target, measure = _length_measure(context_tokens, context_chars, tokenizer)
    rows: list[dict] = []
    for i in range(n):
        wb.reset()
        idx = f"{task}-{seed}-{i}"
        if task in ("qa", "closed", "repeat"):
            facts = wb.facts(n_entities, facts_per_entity, template=template)
            doc = render_document(facts)
            if task == "repeat":
                rows.append(
                    {"id": idx, "context": doc, "question": "Repeat:", "answer": doc, "cue": "", "task": "repeat"}
                )
                continue
            fact = rng.choice(facts)
            row = _qa_example(idx, doc, fact)
            if task == "closed":
                row["options"] = _options(rng, wb, fact, facts)
                row["answer_index"] = row["options"].index(fact.value)
            rows.append(row)
        elif task in ("needle", "multikey"):
            others = [r for r in RELATIONS if r != "code"]
            k = 1 if task == "needle" else n_keys
            keys = [Fact(wb.entity(), "code", wb.value("code"), wb.template(template)) for _ in range(k)]
            facts = _fill_to_length(wb, [], target - sum(measure(f.sentence()) + 1 for f in keys), others, measure)
            for key in keys:  # Uniform depth: each key goes to a random sentence boundary.
                facts.insert(rng.randint(0, len(facts)), key)
            asked = rng.choice(keys)
            rows.append({**_qa_example(idx, render_document(facts), asked), "task": task})
        else:  # multihop
            a, b = wb.entity(), wb.entity()
            hop = [Fact(a, "sibling", b, "forward"), Fact(b, "lives_in", wb.value("lives_in"), "forward")]
            facts = _fill_to_length(wb, [], target, [r for r in RELATIONS if r != "sibling"], measure)
            for f in hop:
                facts.insert(rng.randint(0, len(facts)), f)
            rows.append(
                {
                    "id": idx,
                    "context": render_document(facts),
                    "question": f"Where does the sibling of {a} live?",
                    "answer": hop[1].value,
                    "cue": f"The sibling of {a} lives in",
                    "task": "multihop",
                    "relation": "lives_in",
                    "template": "forward",
                }
            )
    return rows
