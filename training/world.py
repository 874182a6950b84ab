"""Seeded synthetic encyclopedia: entities, documents, questions and the prompt layout.

A *world* (``World(seed)``) holds people, cities, companies and rivers whose attributes refer
to each other (a person's employer is a company of the same world, a city's mayor is a person
of the same world, ...). Each entity is written as one short document from one of several
templates. Questions come in five kinds, reported separately:

- ``single``: the answer is an attribute stated in one document;
- ``two_hop``: the answer needs two documents ("the mayor of the city where X was born");
- ``count``: how many of the shown records share a property (information carried across
  all documents);
- ``first_last``: which shown record has the earliest / latest year;
- ``follows``: which record comes right after the record about X in the prompt. The answer is
  the next document's name; to read it, that name's representation must know the document
  before it, which (with attention only inside each cached document) travels through the
  linear layers' state or a seam recomputed in context.

Every name and attribute value is one word drawn from fixed vocabularies (``vocabulary()``),
so the tokenizer can make each of them a single token. Names are shared across worlds, but
their bindings to attributes are redrawn per world: nothing can be memorised, only read.
Training streams examples from worlds with seeds ``>= TRAIN_SEED_BASE``; the held-out split is
the world ``HELDOUT_SEED`` (and ``VALID_SEED`` is used for validation during training). Training
worlds redraw any entity record (name + attributes) that occurs in those two worlds, so the
held-out entities are never seen in training.

Prompt layout (ChatML, see ``prompt_segments``)::

    <|im_start|>system\\n{SYSTEM}<|im_end|>\\n<|im_start|>user\\n      segment 0 (system)
    Document: {text}\\n                                            one segment per document
    Question: {question}<|im_end|>\\n<|im_start|>assistant\\n        last segment (question)

and the model answers ``{answer}<|im_end|>``.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass, field

SYSTEM = "Answer the question using only the documents. Reply with one word or number."
TRAIN_SEED_BASE = 1_000_000
HELDOUT_SEED = 7
VALID_SEED = 8
DEMO_SEED = 2026
DEMO_SIZES = {"person": 240, "city": 48, "company": 72, "river": 24, "country": 18, "sea": 12}
KINDS = ("single", "two_hop", "count", "first_last", "follows")
YEARS = tuple(str(y) for y in range(1700, 2000))

PROFESSIONS = (
    "baker", "pilot", "doctor", "farmer", "painter", "teacher", "lawyer", "sailor", "miner",
    "weaver", "potter", "singer", "writer", "chemist", "mason", "banker", "carpenter",
    "dancer", "glazier", "fisher", "gardener", "judge", "nurse", "poet", "tailor", "surgeon",
    "smith", "brewer", "butcher", "clerk",
)
INDUSTRIES = (
    "shipping", "mining", "banking", "textiles", "software", "brewing", "steel", "timber",
    "paper", "printing", "glass", "rail", "tobacco", "salt", "silk",
)
POOL_SIZES = {"person": 400, "city": 120, "company": 120, "river": 40, "country": 24, "sea": 12}
WORLD_SIZES = {"person": 80, "city": 16, "company": 24, "river": 8, "country": 6, "sea": 4}

_ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr",
           "gr", "kr", "tr", "st", "sh", "th", "ch", "h", "j", "w")
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ei", "ou", "ya")
_CODAS = ("", "n", "r", "l", "s", "th", "m", "x", "nd", "rk")


# ----------------------------------------------------------------------------- vocabularies

def _invent_names(rng: random.Random, count: int, taken: set[str]) -> tuple[str, ...]:
    """``count`` new capitalised two-syllable words, none in ``taken`` (which is updated)."""
    names = []
    while len(names) < count:
        word = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) for _ in range(2))
        word = (word + rng.choice(_CODAS)).capitalize()
        if 4 <= len(word) <= 9 and word not in taken:
            taken.add(word)
            names.append(word)
    return tuple(names)


def _build_pools() -> dict[str, tuple[str, ...]]:
    rng = random.Random(20260101)
    taken = {"The", "Document", "Question", "Answer", "Who", "Which", "Where", "When", "How",
             "What", "In", "Into", "Its", "It", "Of", "Born", "Founded", "Reply", "Sea"}
    return {kind: _invent_names(rng, size, taken) for kind, size in POOL_SIZES.items()}


NAME_POOLS = _build_pools()


def vocabulary() -> list[str]:
    """Every word the tokenizer must keep as one token: names, professions, industries, years."""
    words = [w for pool in NAME_POOLS.values() for w in pool]
    return words + list(PROFESSIONS) + list(INDUSTRIES) + list(YEARS)


# ----------------------------------------------------------------------------- entities

@dataclass(frozen=True)
class Entity:
    """One record: ``kind`` (person/city/company/river), ``name`` and its attributes."""

    kind: str
    name: str
    attrs: tuple[tuple[str, str], ...]

    def get(self, key: str) -> str:
        return dict(self.attrs)[key]


@dataclass(frozen=True)
class Doc:
    id: str
    title: str
    text: str


@dataclass
class Example:
    """One question over ``docs`` (already in prompt order).

    ``sources`` lists ``(doc_index, word)`` pairs: the word in that document that the answer
    is read from (single / two-hop: the answer itself in the last hop's document; empty for
    aggregates, whose answer is not copied from one place). ``needed`` lists the ids of the
    documents the answer depends on (all of them for aggregates).
    """

    kind: str
    relation: str
    question: str
    answer: str
    docs: list[Doc]
    sources: list[tuple[int, str]] = field(default_factory=list)
    needed: list[str] = field(default_factory=list)


_DOC_TEMPLATES = {
    "person": (
        "{name} is a {profession} born in {city} in {year}. {name} works for {employer}.",
        "{name} was born in {city} in {year} and works as a {profession} at {employer}.",
        "{name} was born in {year} in {city} and is a {profession} at {employer}.",
    ),
    "city": (
        "{name} is a city in {country} on the {river} river. Its mayor is {mayor}. It was founded in {year}.",
        "The city of {name} lies in {country} on the {river}. Founded in {year}, it has {mayor} as mayor.",
        "{name}, founded in {year}, is a city of {country} on the {river} river, with mayor {mayor}.",
    ),
    "company": (
        "{name} is a {industry} company founded in {year} by {founder} and based in {city}.",
        "{name} was founded by {founder} in {year} and is a {industry} firm based in {city}.",
        "{name}, a {industry} company based in {city}, was founded in {year} by {founder}.",
    ),
    "river": (
        "The {name} is a river in {country} that flows into the {sea} Sea.",
        "The {name} river runs through {country} and ends in the {sea} Sea.",
    ),
}

# relation -> (entity kind, attribute, question templates)
_SINGLE = {
    "born_in": ("person", "city", ("Where was {name} born?", "In which city was {name} born?")),
    "birth_year": ("person", "year", ("In which year was {name} born?",)),
    "profession": ("person", "profession", ("What is the profession of {name}?", "What does {name} do for a living?")),
    "employer": ("person", "employer", ("Which company does {name} work for?",)),
    "city_country": ("city", "country", ("In which country is the city of {name}?",)),
    "mayor": ("city", "mayor", ("Who is the mayor of {name}?",)),
    "city_river": ("city", "river", ("Which river flows through {name}?",)),
    "city_founded": ("city", "year", ("In which year was the city of {name} founded?",)),
    "company_city": ("company", "city", ("Where is {name} based?", "In which city is {name} based?")),
    "company_founded": ("company", "year", ("In which year was {name} founded?",)),
    "industry": ("company", "industry", ("What industry is {name} in?",)),
    "founder": ("company", "founder", ("Who founded {name}?",)),
    "river_country": ("river", "country", ("In which country is the {name} river?",)),
    "sea": ("river", "sea", ("Into which sea does the {name} flow?",)),
}

# relation -> (first kind, first attribute, second kind, second attribute, question)
_TWO_HOP = {
    "mayor_of_birthplace": ("person", "city", "city", "mayor", "Who is the mayor of the city where {name} was born?"),
    "birth_country": ("person", "city", "city", "country", "In which country is the city where {name} was born?"),
    "employer_founder": ("person", "employer", "company", "founder", "Who founded the company that {name} works for?"),
    "employer_city": ("person", "employer", "company", "city", "In which city is the company that {name} works for based?"),
    "founder_birthplace": ("company", "founder", "person", "city", "Where was the founder of {name} born?"),
    "hq_river": ("company", "city", "city", "river", "Which river flows through the city where {name} is based?"),
}

_COUNT = {
    "count_born_in": ("person", "city", "How many of the people in the documents were born in {value}?"),
    "count_profession": ("person", "profession", "How many of the people in the documents work as a {value}?"),
    "count_industry": ("company", "industry", "How many of the companies in the documents are in {value}?"),
}

_FIRST_LAST = {
    "born_first": ("person", min, "Of the people in the documents, who was born first?"),
    "born_last": ("person", max, "Of the people in the documents, who was born last?"),
    "company_oldest": ("company", min, "Of the companies in the documents, which was founded first?"),
    "company_newest": ("company", max, "Of the companies in the documents, which was founded last?"),
    "city_oldest": ("city", min, "Of the cities in the documents, which was founded first?"),
}

FOLLOWS_QUESTION = "Which record comes right after the record about {name}?"


class World:
    """A consistent set of entities and their documents, fully determined by ``seed``.

    ``sizes`` (entities per kind, default ``WORLD_SIZES``) must not exceed ``POOL_SIZES``.
    """

    def __init__(self, seed: int, sizes: dict[str, int] | None = None):
        self.seed = seed
        rng = random.Random(seed)
        names = {k: rng.sample(NAME_POOLS[k], n) for k, n in (sizes or WORLD_SIZES).items()}
        reserved = _reserved_entities() if seed >= TRAIN_SEED_BASE else frozenset()
        makers = {"person": self._person, "city": self._city, "company": self._company, "river": self._river}
        self.entities: dict[str, list[Entity]] = {
            kind: [_draw(lambda: make(rng, n, names), reserved) for n in names[kind]]
            for kind, make in makers.items()
        }
        self.by_name = {e.name: e for ents in self.entities.values() for e in ents}
        self.docs = {e.name: _write_doc(rng, e) for e in self.by_name.values()}

    @staticmethod
    def _person(rng, name, names) -> Entity:
        return Entity("person", name, (("city", rng.choice(names["city"])), ("year", rng.choice(YEARS[150:])),
                                       ("profession", rng.choice(PROFESSIONS)),
                                       ("employer", rng.choice(names["company"]))))

    @staticmethod
    def _city(rng, name, names) -> Entity:
        return Entity("city", name, (("country", rng.choice(names["country"])), ("river", rng.choice(names["river"])),
                                     ("mayor", rng.choice(names["person"])), ("year", rng.choice(YEARS[:200]))))

    @staticmethod
    def _company(rng, name, names) -> Entity:
        return Entity("company", name, (("industry", rng.choice(INDUSTRIES)), ("year", rng.choice(YEARS[100:])),
                                        ("founder", rng.choice(names["person"])), ("city", rng.choice(names["city"]))))

    @staticmethod
    def _river(rng, name, names) -> Entity:
        return Entity("river", name, (("country", rng.choice(names["country"])), ("sea", rng.choice(names["sea"]))))

    def all_docs(self) -> list[Doc]:
        return list(self.docs.values())

    # ------------------------------------------------------------------ examples

    def example(self, rng: random.Random, kind: str, k: int) -> Example:
        """One question of ``kind`` over ``k`` documents (``k >= 2`` except for ``single``)."""
        make = {"single": self._single, "two_hop": self._two_hop, "count": self._count,
                "first_last": self._first_last, "follows": self._follows}[kind]
        return make(rng, k)

    def _distractors(self, rng, exclude: set[str], n: int) -> list[str]:
        pool = [name for name in self.docs if name not in exclude]
        return rng.sample(pool, n)

    def _assemble(self, rng, kind, relation, question, answer, names, source_names, n_needed) -> Example:
        """Shuffle ``names`` (the first ``n_needed`` are the documents the answer needs)."""
        needed = [self.docs[n].id for n in names[:n_needed]]
        rng.shuffle(names)
        docs = [self.docs[n] for n in names]
        sources = [(names.index(n), answer) for n in source_names]
        return Example(kind, relation, question, answer, docs, sources, needed)

    def _single(self, rng, k) -> Example:
        relation = rng.choice(sorted(_SINGLE))
        ent_kind, attr, templates = _SINGLE[relation]
        ent = rng.choice(self.entities[ent_kind])
        names = [ent.name] + self._distractors(rng, {ent.name}, k - 1)
        question = rng.choice(templates).format(name=ent.name)
        return self._assemble(rng, "single", relation, question, ent.get(attr), names, [ent.name], 1)

    def _two_hop(self, rng, k) -> Example:
        relation = rng.choice(sorted(_TWO_HOP))
        kind1, attr1, _, attr2, template = _TWO_HOP[relation]
        first = rng.choice(self.entities[kind1])
        second = self.by_name[first.get(attr1)]
        names = [first.name, second.name] + self._distractors(rng, {first.name, second.name}, k - 2)
        return self._assemble(rng, "two_hop", relation, template.format(name=first.name),
                              second.get(attr2), names, [second.name], 2)

    def _count(self, rng, k) -> Example:
        relation = rng.choice(sorted(_COUNT))
        ent_kind, attr, template = _COUNT[relation]
        ents = self.entities[ent_kind]
        value = rng.choice(ents).get(attr)
        match = [e.name for e in ents if e.get(attr) == value]
        other = [e.name for e in ents if e.get(attr) != value]
        n_match = rng.randint(0, min(k, len(match)))
        names = rng.sample(match, n_match) + rng.sample(other, k - n_match)
        return self._assemble(rng, "count", relation, template.format(value=value), str(n_match), names, [], k)

    def _first_last(self, rng, k) -> Example:
        relation = rng.choice(sorted(_FIRST_LAST))
        ent_kind, pick, question = _FIRST_LAST[relation]
        while True:
            chosen = rng.sample(self.entities[ent_kind], k)
            years = [int(e.get("year")) for e in chosen]
            if years.count(pick(years)) == 1:
                break
        answer = chosen[years.index(pick(years))].name
        return self._assemble(rng, "first_last", relation, question, answer,
                              [e.name for e in chosen], [answer], k)

    def _follows(self, rng, k) -> Example:
        names = rng.sample(sorted(self.docs), k)
        i = rng.randrange(k - 1)
        docs = [self.docs[n] for n in names]
        return Example("follows", "follows", FOLLOWS_QUESTION.format(name=names[i]), names[i + 1], docs,
                       [(i + 1, names[i + 1])], [docs[i].id, docs[i + 1].id])


def _draw(make, reserved: frozenset) -> Entity:
    """``make()`` until its record is not one of ``reserved``."""
    while (ent := make()) in reserved:
        pass
    return ent


@functools.cache
def _reserved_entities() -> frozenset:
    """Entity records of the held-out and validation worlds: training worlds never draw them."""
    return frozenset(e for seed in (HELDOUT_SEED, VALID_SEED)
                     for ents in World(seed).entities.values() for e in ents)


def _write_doc(rng: random.Random, ent: Entity) -> Doc:
    text = rng.choice(_DOC_TEMPLATES[ent.kind]).format(name=ent.name, **dict(ent.attrs))
    return Doc(id=f"{ent.kind}-{ent.name.lower()}", title=ent.name, text=text)


# ----------------------------------------------------------------------------- splits

def heldout_examples(n: int, k_values=(1, 2, 5, 10), kinds=KINDS, seed: int = 0,
                     world_seed: int = HELDOUT_SEED) -> list[Example]:
    """A fixed evaluation set: ``n`` examples per (kind, k) from the held-out world.

    ``world_seed=VALID_SEED`` gives the validation world used during training instead.
    """
    world = World(world_seed)
    out = []
    for kind in kinds:
        for k in k_values:
            if k < min_docs(kind):
                continue
            rng = random.Random(f"eval/{world_seed}/{seed}/{kind}/{k}")
            out.extend(world.example(rng, kind, k) for _ in range(n))
    return out


def min_docs(kind: str) -> int:
    return 1 if kind in ("single", "count") else 2


DOCS_DISTS = ("uniform", "linear")  # how train_stream draws the number of documents


def train_stream(seed: int, max_docs, kind_weights: dict[str, float], docs_dist: str = "uniform"):
    """Endless training examples: a fresh world every 64 examples.

    ``max_docs()`` is read before each example (the curriculum may raise it while streaming);
    k is drawn from [min_docs(kind), max(max_docs(), min_docs(kind))]: uniformly, or with
    ``docs_dist="linear"`` with weight proportional to k (more of the long prompts, where lookup
    fails; the mean k at max_docs 10 goes from 5.5 to 7).
    """
    if docs_dist not in DOCS_DISTS:
        raise ValueError(f"docs_dist must be one of {DOCS_DISTS}, got {docs_dist!r}")
    rng = random.Random(f"train/{seed}")
    kinds, weights = zip(*kind_weights.items())
    world_index = 0
    while True:
        world = World(TRAIN_SEED_BASE + seed * 100_000 + world_index)
        world_index += 1
        for _ in range(64):
            kind = rng.choices(kinds, weights)[0]
            ks = range(min_docs(kind), max(max_docs(), min_docs(kind)) + 1)
            k = rng.choice(ks) if docs_dist == "uniform" else rng.choices(ks, weights=ks)[0]
            yield world.example(rng, kind, k)


# ----------------------------------------------------------------------------- prompt layout

def system_segment() -> str:
    return f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n"


def document_segment(doc: Doc) -> str:
    return f"Document: {doc.text}\n"


def question_segment(question: str) -> str:
    return f"Question: {question}<|im_end|>\n<|im_start|>assistant\n"


def prompt_segments(example: Example) -> tuple[list[str], str]:
    """(segment texts, gold answer) for one example: [system, doc_1..doc_k, question].

    ``"".join(segments)`` equals the tokenizer's chat template applied to ``chat_messages``
    with ``add_generation_prompt=True``; segments split at newlines, so tokenising each one
    alone and concatenating the ids gives the same ids as tokenising the whole prompt.
    """
    segments = [system_segment()] + [document_segment(d) for d in example.docs]
    segments.append(question_segment(example.question))
    return segments, example.answer


def chat_messages(example: Example) -> list[dict[str, str]]:
    """The same prompt as chat messages (system + one user turn)."""
    user = "".join(document_segment(d) for d in example.docs) + f"Question: {example.question}"
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]
