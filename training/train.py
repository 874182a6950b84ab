"""Train the bundled qwen3_5 hybrid model on the synthetic world (CPU, resumable).

Model: ``Qwen3_5ForCausalLM`` with a text config, 8 layers in the Qwen3.5 3:1 pattern
(3 Gated DeltaNet linear layers, then 1 gated full-attention layer, twice), tied embeddings.

Objective: cross-entropy on the answer tokens (answer word + ``<|im_end|>``), plus
``--lm-weight`` times the ordinary next-token loss on the whole sequence, plus an optional
auxiliary *attention-supervision* loss: for examples whose kind is in ``--aux-kinds``, head
``AUX_HEAD`` of full-attention layer ``--aux-layer`` (-1: the last one) is taught to attend,
from the last prompt token (the position that predicts the answer), to the answer's source
token in the relevant document: ``-log(sum of that head's attention on the source positions)``.
It is used only up to ``--aux-until`` steps and must be reported beside accuracy numbers.

``--copy-init`` starts that head as a copy head (``copy_init``). Measured here (runs of
250-350 steps, 1 CPU thread): with attention supervision alone the head put >95% of its
attention on the source token, yet its direct contribution ranked the gold token ~135th of
1932 and single-hop EM stayed at 1-4%, with or without the LM loss, with a larger embedding
init, on the first or the last full-attention layer. With ``--copy-init`` single-hop EM at
k=1 reached ~30% within 100 steps.

``--memory-heads`` pins chosen Gated DeltaNet heads to a slow base decay (``memory_init``).
Measured here: without them every linear head forgot a whole document's state within the
document (spectral norm of its transition over ~23 tokens < 1e-7, step 2700), so lookups in long
prompts had to bind a value to its entity name through fast-forgetting heads, and nothing reached
the next document. With head 3 of layers 0-2 pinned from step 2700 on, validation single-hop EM
at k = 10 was 67% at step 3000, against 46% for the sibling run without them (same data and
schedule; 48 questions per cell), and those heads kept ~0.93-0.98 of their state across a
document.

``--bind-weight`` adds an entity-binding probe (``BindingProbe``, training only): a linear read
of the residual entering the first full-attention layer must name the entity whose document (or
question) each prompt token is in. Measured at step 5324 (``training.diagnose``): lookups among
ten documents failed by finding the asked attribute of the wrong entity, and a probe fitted on the
frozen model read the right entity among the prompt's ten at 19% of document tokens and 9% of
last prompt tokens (chance 10%): the lookup's query did not know whom the question was about.
With the probe loss on (run H, steps 5324-7400), validation single-hop EM at k = 10 went from
62.5% to 100% (48 questions), against 52.1% for the same run without it at step 6250; EM began to
rise only once the last prompt token was scored on its own (see ``BindingProbe.loss``).

Curriculum: the maximum number of documents per prompt starts at 1 and rises by one (up to
``--max-docs``) when single-hop answers in the last ``CURRICULUM_WINDOW`` training examples
reach ``--advance-at`` accuracy, or after ``--level-patience`` steps at one level.

State lives in ``--run-dir`` (default ``var/train``): ``last.pt`` (resumable: model,
optimizer, step, curriculum), ``best.pt`` (best validation single-hop EM), ``tokenizer/``,
``metrics.jsonl``. Re-running the same command resumes from ``last.pt``.

Usage: ``python -m training.train --max-minutes 120``
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import random
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import PreTrainedTokenizerFast, Qwen3_5ForCausalLM, Qwen3_5TextConfig

from training import world
from training.tokenizer import build_tokenizer

AUX_HEAD = 0
CURRICULUM_WINDOW = 20  # steps
KIND_WEIGHTS = {"single": 0.5, "two_hop": 0.2, "count": 0.15, "first_last": 0.15}


# ----------------------------------------------------------------------------- model

def model_config(tok: PreTrainedTokenizerFast, hidden: int = 192, layers: int = 8,
                 heads: int = 4) -> Qwen3_5TextConfig:
    """A small qwen3_5 text config: [linear x3, full] repeated, head_dim = hidden / heads."""
    head_dim = hidden // heads
    return Qwen3_5TextConfig(
        vocab_size=len(tok), hidden_size=hidden, intermediate_size=hidden * 8 // 3,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads // 2,
        head_dim=head_dim, linear_num_key_heads=heads, linear_num_value_heads=heads,
        linear_key_head_dim=head_dim, linear_value_head_dim=head_dim, linear_conv_kernel_dim=4,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * (layers // 4),
        max_position_embeddings=2048, tie_word_embeddings=True,
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None,
    )


def full_attention_layers(model: Qwen3_5ForCausalLM) -> list[int]:
    return [i for i, t in enumerate(model.config.layer_types) if t == "full_attention"]


def copy_init(model: Qwen3_5ForCausalLM, aux_layer: int) -> None:
    """Initialise head AUX_HEAD of the supervised layer as a copy head: W_O W_V = Q^T Q.

    Q is a random orthonormal (head_dim x hidden) matrix, so the head passes a projection of
    the attended token's (normalised) residual, and hence of its embedding, to the output.
    Only the starting point changes; every weight is trained as usual.
    """
    attn = model.model.layers[full_attention_layers(model)[aux_layer]].self_attn
    d = attn.head_dim
    kv = AUX_HEAD // (model.config.num_attention_heads // model.config.num_key_value_heads)
    q = torch.linalg.qr(torch.randn(model.config.hidden_size, d))[0].T  # [d, hidden], orthonormal rows
    with torch.no_grad():
        attn.v_proj.weight[kv * d:(kv + 1) * d] = q
        attn.o_proj.weight[:, AUX_HEAD * d:(AUX_HEAD + 1) * d] = q.T


def memory_init(model: Qwen3_5ForCausalLM, heads: list[tuple[int, int]], decay: float) -> None:
    """Pin Gated DeltaNet heads to a slow base decay, so they can hold state across documents.

    For each ``(layer, head)``: ``A_log = log(decay)`` and ``dt_bias = 0``, so the head's
    per-token log-decay is ``-decay * softplus(a_t)``: slow, unless its input asks it to forget
    (``a_t`` large). Training calls this after every optimizer step, which keeps the two values
    fixed. Measured on the step-2700 checkpoint: every head's transition over one ~23-token
    document had spectral norm < 1e-7, so nothing a document's linear state held reached the
    next document.
    """
    types = model.config.layer_types
    for layer, head in heads:
        if not (0 <= layer < len(types) and types[layer] == "linear_attention"
                and 0 <= head < model.config.linear_num_value_heads):
            raise SystemExit(f"--memory-heads: {layer}:{head} is not a head of a linear-attention layer "
                             f"(layer types: {', '.join(types)})")
    with torch.no_grad():
        for layer, head in heads:
            attn = model.model.layers[layer].linear_attn
            attn.A_log[head] = math.log(decay)
            attn.dt_bias[head] = 0.0


def parse_heads(text: str) -> list[tuple[int, int]]:
    """``"0:3,1:3"`` -> ``[(0, 3), (1, 3)]``."""
    return [tuple(int(x) for x in item.split(":")) for item in text.split(",") if item]


def build_model(config: Qwen3_5TextConfig, embed_std: float | None = None) -> Qwen3_5ForCausalLM:
    """Eager attention so the full-attention layers can return their weights (aux loss).

    ``embed_std`` re-initialises the (tied) embeddings with a larger spread than the default
    0.02, so that a name token stays a visible part of the residual stream at its position
    (measured: with 0.02, a name's embedding was ~2% of the residual norm at the last
    full-attention layer's input).
    """
    config._attn_implementation = "eager"
    model = Qwen3_5ForCausalLM(config)
    if embed_std is not None:
        torch.nn.init.normal_(model.model.embed_tokens.weight, std=embed_std)
    return model


# ----------------------------------------------------------------------------- data

@dataclass
class Encoded:
    ids: list[int]
    n_prompt: int            # answer tokens start here
    source_pos: list[int]    # positions of the answer's source token(s) in the prompt
    kind: str
    bind: list[tuple[int, int, int]] = field(default_factory=list)  # (start, end, name id) spans


def binding_spans(seg_ids: list[list[int]], starts: list[int], names: list[int]) -> list[tuple[int, int, int]]:
    """Prompt spans whose tokens belong to one named entity: ``(start, end, name token id)``.

    In each document segment, from the entity's name to the end of the document (tokens before
    the name, e.g. "Document: The", cannot know it); in the question segment, from the first
    name of a prompt document to the end of the prompt. ``names[i]`` is document i's name id.
    """
    spans = []
    for doc_index, name_id in enumerate(names):
        ids = seg_ids[doc_index + 1]
        if name_id in ids:
            spans.append((starts[doc_index + 1] + ids.index(name_id), starts[doc_index + 2], name_id))
    question = seg_ids[len(names) + 1]
    first = next((i for i, t in enumerate(question) if t in names), None)
    if first is not None:
        spans.append((starts[len(names) + 1] + first, starts[len(names) + 2], question[first]))
    return spans


def encode(tok: PreTrainedTokenizerFast, ex: world.Example) -> Encoded:
    """Token ids of prompt + answer + <|im_end|>, with the answer's source positions."""
    segments, answer = world.prompt_segments(ex)
    seg_ids = [tok(s, add_special_tokens=False)["input_ids"] for s in segments]
    starts = [0]
    for ids in seg_ids:
        starts.append(starts[-1] + len(ids))
    source_pos = []
    for doc_index, word in ex.sources:
        word_id = tok.convert_tokens_to_ids(word)
        seg = doc_index + 1
        source_pos += [starts[seg] + i for i, t in enumerate(seg_ids[seg]) if t == word_id]
    answer_ids = tok(answer, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    prompt = [t for ids in seg_ids for t in ids]
    names = [tok.convert_tokens_to_ids(d.title) for d in ex.docs]
    return Encoded(prompt + answer_ids, len(prompt), source_pos, ex.kind, binding_spans(seg_ids, starts, names))


@dataclass
class Batch:
    input_ids: torch.Tensor   # [B, T] right-padded
    labels: torch.Tensor      # [B, T], -100 outside the answer
    query_pos: torch.Tensor   # [B] last prompt position
    source_mask: torch.Tensor  # [B, T] bool
    kinds: list[str]
    bind_labels: torch.Tensor  # [B, T] the entity name id each prompt token belongs to, else -100


def collate(items: list[Encoded], pad_id: int) -> Batch:
    T = max(len(e.ids) for e in items)
    ids = torch.full((len(items), T), pad_id, dtype=torch.long)
    labels = torch.full((len(items), T), -100, dtype=torch.long)
    source = torch.zeros((len(items), T), dtype=torch.bool)
    bind = torch.full((len(items), T), -100, dtype=torch.long)
    for b, e in enumerate(items):
        ids[b, :len(e.ids)] = torch.tensor(e.ids)
        labels[b, e.n_prompt:len(e.ids)] = ids[b, e.n_prompt:len(e.ids)]
        source[b, e.source_pos] = True
        for start, end, name_id in e.bind:
            bind[b, start:end] = name_id
    query = torch.tensor([e.n_prompt - 1 for e in items])
    return Batch(ids, labels, query, source, [e.kind for e in items], bind)


def length_buckets(items: list[Encoded], batch_size: int, rng: random.Random) -> list[list[Encoded]]:
    """Split ``items`` into batches of similar length (less padding), in random order.

    A batch is right-padded to its longest sequence; with 1 to 10 documents per prompt, random
    batches are ~40% padding. Sorting a pool of several batches by length first removes most of it.
    """
    ordered = sorted(items, key=lambda e: len(e.ids))
    batches = [ordered[i:i + batch_size] for i in range(0, len(ordered), batch_size)]
    rng.shuffle(batches)
    return batches


def answer_scores(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean answer-token cross-entropy, per-example exact match under teacher forcing).

    All answer tokens (incl. <|im_end|>) being the argmax is exactly greedy-decoding EM.
    """
    pred, gold = logits[:, :-1], labels[:, 1:]
    loss = F.cross_entropy(pred.reshape(-1, pred.shape[-1]), gold.reshape(-1), ignore_index=-100)
    mask = gold != -100
    exact = ((pred.argmax(-1) == gold) | ~mask).all(-1)
    return loss, exact


def lm_loss(logits: torch.Tensor, input_ids: torch.Tensor, pad_id: int) -> torch.Tensor:
    """Next-token cross-entropy over every non-padding position."""
    gold = input_ids[:, 1:].masked_fill(input_ids[:, 1:] == pad_id, -100)
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), gold.reshape(-1), ignore_index=-100)


def aux_attention_loss(attn: torch.Tensor, batch: Batch, kinds: set[str]) -> torch.Tensor:
    """-log attention mass of head AUX_HEAD, at the query position, on the source tokens."""
    rows = attn[torch.arange(len(batch.kinds)), AUX_HEAD, batch.query_pos]  # [B, T]
    mass = (rows * batch.source_mask).sum(-1)
    use = torch.tensor([k in kinds for k in batch.kinds]) & batch.source_mask.any(-1)
    if not use.any():
        return rows.sum() * 0.0
    return -torch.log(mass[use] + 1e-6).mean()


class BindingProbe(torch.nn.Module):
    """Reads, from the residual stream entering the first full-attention layer, which entity
    each prompt token belongs to (``--bind-weight``; training only, not exported).

    Logits are ``(W h) . E`` over the (tied, detached) token embeddings ``E``, so the probe is
    satisfied when the residual holds a linear image of the entity name's embedding: what the
    lookup head's key at an attribute value needs to tell "Mutra's city" from another person's.
    Measured before it existed (step 5324, validation world, 128 single-hop questions with ten
    documents): in 62 of 128 the supervised head's strongest attention was on
    the same attribute of another entity, and person questions (about six other people among
    the distractors) were answered 4 times in 33.
    """

    def __init__(self, hidden: int):
        super().__init__()
        self.proj = torch.nn.Linear(hidden, hidden, bias=False)

    def loss(self, hidden: torch.Tensor, embed: torch.Tensor, labels: torch.Tensor,
             query_pos: torch.Tensor) -> torch.Tensor:
        """Cross-entropy over the entity names that occur in the batch (about 150 with ten
        documents per prompt), so the loss is about telling the prompt's entities apart: the
        mean over all labelled tokens plus the mean over the last prompt tokens alone.

        The second term is there because the last prompt token, where the lookup's query is
        formed, is ~1 token in 40 of the labelled ones: measured with the first term alone (run H,
        step 6100, ``training.diagnose binding``), the probe read the right entity at 99% of
        document tokens but at 23% of last prompt tokens (chance 10%).
        """
        mask = labels != -100
        if not mask.any():
            return hidden.sum() * 0.0
        names, target = torch.unique(labels[mask], return_inverse=True)
        logits = self.proj(hidden[mask]) @ embed.detach()[names].T
        at_query = torch.zeros_like(mask)
        at_query[torch.arange(len(query_pos)), query_pos] = True
        at_query = at_query[mask]
        loss = F.cross_entropy(logits, target)
        if at_query.any():
            loss = loss + F.cross_entropy(logits[at_query], target[at_query])
        return loss


@torch.no_grad()
def validate(model, tok, examples: list[world.Example], batch_size: int = 32) -> dict[str, float]:
    """Teacher-forced exact match (== greedy EM) per 'kind/k' on fixed examples."""
    model.eval()
    hits = collections.defaultdict(list)
    for i in range(0, len(examples), batch_size):
        chunk = examples[i:i + batch_size]
        batch = collate([encode(tok, e) for e in chunk], tok.pad_token_id)
        _, exact = answer_scores(model(input_ids=batch.input_ids).logits, batch.labels)
        for e, ok in zip(chunk, exact.tolist()):
            hits[f"{e.kind}/{len(e.docs)}"].append(ok)
            hits[e.kind].append(ok)
    model.train()
    return {key: sum(v) / len(v) for key, v in sorted(hits.items())}


# ----------------------------------------------------------------------------- loop

class Curriculum:
    """Max documents per prompt, raised when recent single-hop accuracy is high enough."""

    def __init__(self, top: int, advance_at: float, patience: int, state: dict | None = None):
        self.top, self.advance_at, self.patience = top, advance_at, patience
        self.max_docs = state["max_docs"] if state else 1
        self.steps_at_level = state["steps_at_level"] if state else 0
        self.recent = collections.deque(maxlen=CURRICULUM_WINDOW)

    def update(self, single_hits: list[bool]) -> None:
        self.recent.append(single_hits)
        self.steps_at_level += 1
        flat = [h for step in self.recent for h in step]
        ready = len(self.recent) == CURRICULUM_WINDOW and sum(flat) >= self.advance_at * len(flat)
        if self.max_docs < self.top and (ready or self.steps_at_level >= self.patience):
            self.max_docs += 1
            self.steps_at_level = 0
            self.recent.clear()

    def state(self) -> dict:
        return {"max_docs": self.max_docs, "steps_at_level": self.steps_at_level}


def learning_rate(args: argparse.Namespace, step: int) -> float:
    """Linear warm-up, then constant, then (with ``--decay-start``) a cosine decay to
    ``--min-lr-ratio`` of the peak over ``--decay-steps`` steps."""
    lr = args.lr * min(1.0, (step + 1) / args.warmup)
    if args.decay_start is not None and step >= args.decay_start:
        progress = min(1.0, (step - args.decay_start) / max(1, args.decay_steps))
        ratio = args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
        lr = args.lr * ratio
    return lr


def parse_kind_weights(text: str) -> dict[str, float]:
    """``"single=0.5,count=0.5"`` -> ``{"single": 0.5, "count": 0.5}`` (kinds checked)."""
    weights = {}
    for item in text.split(","):
        kind, _, value = item.partition("=")
        if kind not in world.KINDS:
            raise SystemExit(f"--kind-weights: unknown kind {kind!r} (known: {', '.join(world.KINDS)})")
        weights[kind] = float(value)
    return weights


def save(path: str, **payload) -> None:
    tmp = path + ".tmp"
    torch.save(payload, tmp)
    os.replace(tmp, path)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--run-dir", default="var/train")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hidden", type=int, default=192)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--buckets", type=int, default=8,
                   help="draw this many batches at once and group them by length (1: no grouping)")
    p.add_argument("--lr", type=float, default=1.5e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--decay-start", type=int, default=None,
                   help="cosine-decay the learning rate from this step (default: no decay)")
    p.add_argument("--decay-steps", type=int, default=1000, help="length of the cosine decay")
    p.add_argument("--min-lr-ratio", type=float, default=0.1, help="final lr / --lr after the decay")
    p.add_argument("--kind-weights", default=",".join(f"{k}={v}" for k, v in KIND_WEIGHTS.items()),
                   help="question mix, e.g. single=0.5,two_hop=0.2,count=0.15,first_last=0.15")
    p.add_argument("--max-docs", type=int, default=10)
    p.add_argument("--docs-dist", choices=world.DOCS_DISTS, default="uniform",
                   help="documents per prompt: uniform in [1, max_docs], or linear (weight k)")
    p.add_argument("--advance-at", type=float, default=0.9)
    p.add_argument("--level-patience", type=int, default=400)
    p.add_argument("--embed-std", type=float, default=0.1, help="embedding init std (fresh runs)")
    p.add_argument("--lm-weight", type=float, default=0.5)
    p.add_argument("--aux-weight", type=float, default=1.0)
    p.add_argument("--aux-kinds", default="single")
    p.add_argument("--aux-layer", type=int, default=-1, help="which full-attention layer (-1: last)")
    p.add_argument("--copy-init", action="store_true", help="start the supervised head as a copy head")
    p.add_argument("--memory-heads", default="",
                   help="LAYER:HEAD,... Gated DeltaNet heads given a slow fixed decay (memory_init)")
    p.add_argument("--memory-decay", type=float, default=1e-3, help="exp(A_log) of the memory heads")
    p.add_argument("--aux-until", type=int, default=10**9, help="no aux loss from this step on")
    p.add_argument("--bind-weight", type=float, default=0.0,
                   help="weight of the entity-binding probe loss (BindingProbe); 0: off")
    p.add_argument("--bind-lr", type=float, default=3e-3,
                   help="the probe's own (constant) learning rate, so it keeps up with the model")
    p.add_argument("--max-steps", type=int, default=10**9)
    p.add_argument("--max-minutes", type=float, default=60.0)
    p.add_argument("--eval-every", type=int, default=200)
    p.add_argument("--ckpt-every", type=int, default=50)
    p.add_argument("--threads", type=int, default=1)
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    os.makedirs(args.run_dir, exist_ok=True)
    tok_dir = os.path.join(args.run_dir, "tokenizer")
    if os.path.isdir(tok_dir):  # a resumed run keeps its token ids, whatever the templates say now
        tok = PreTrainedTokenizerFast.from_pretrained(tok_dir)
    else:
        tok = build_tokenizer()
        tok.save_pretrained(tok_dir)
    last_path, best_path = (os.path.join(args.run_dir, n) for n in ("last.pt", "best.pt"))
    resume = torch.load(last_path, weights_only=False) if os.path.exists(last_path) else None

    config = Qwen3_5TextConfig.from_dict(resume["config"]) if resume else model_config(tok, args.hidden, args.layers)
    model = build_model(config, None if resume else args.embed_std)
    if args.copy_init and not resume:
        copy_init(model, args.aux_layer)
    memory_heads = parse_heads(args.memory_heads)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.98))
    step, best = 0, -1.0
    if resume:
        model.load_state_dict(resume["model"])
        opt.load_state_dict(resume["optimizer"])
        step, best = resume["step"], resume["best"]
    memory_init(model, memory_heads, args.memory_decay)
    probe = BindingProbe(config.hidden_size)
    probe_opt = torch.optim.AdamW(probe.parameters(), lr=args.bind_lr, weight_decay=0.01, betas=(0.9, 0.98))
    if resume and "probe" in resume:
        probe.load_state_dict(resume["probe"])
        probe_opt.load_state_dict(resume["probe_optimizer"])
        for group in probe_opt.param_groups:
            group["lr"] = args.bind_lr
    bind_layer = full_attention_layers(model)[0]  # hidden_states[i] is the input of layer i
    curriculum = Curriculum(args.max_docs, args.advance_at, args.level_patience,
                            resume["curriculum"] if resume else None)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"params={n_params} vocab={len(tok)} resume_step={step} args={vars(args)}", flush=True)

    stream = world.train_stream(args.seed * 10_000 + step, lambda: curriculum.max_docs,
                                parse_kind_weights(args.kind_weights), args.docs_dist)
    valid = world.heldout_examples(16, k_values=(1, 5, 10), world_seed=world.VALID_SEED)
    aux_kinds = set(args.aux_kinds.split(",")) if args.aux_kinds else set()
    metrics = open(os.path.join(args.run_dir, "metrics.jsonl"), "a")
    t0, window = time.time(), collections.defaultdict(list)
    pending: list[list[Encoded]] = []
    model.train()

    def checkpoint(path):
        save(path, model=model.state_dict(), optimizer=opt.state_dict(), step=step, best=best,
             curriculum=curriculum.state(), config=config.to_dict(), args=vars(args),
             probe=probe.state_dict(), probe_optimizer=probe_opt.state_dict())

    while step < args.max_steps and time.time() - t0 < args.max_minutes * 60:
        lr = learning_rate(args, step)
        for group in opt.param_groups:
            group["lr"] = lr
        if not pending:
            pending = length_buckets([encode(tok, next(stream)) for _ in range(args.batch_size * args.buckets)],
                                     args.batch_size, random.Random(step))
        batch = collate(pending.pop(), tok.pad_token_id)
        use_aux = args.aux_weight > 0 and step < args.aux_until and bool(aux_kinds)
        use_bind = args.bind_weight > 0
        out = model(input_ids=batch.input_ids, output_attentions=use_aux, output_hidden_states=use_bind)
        loss, exact = answer_scores(out.logits, batch.labels)
        aux = aux_attention_loss(out.attentions[args.aux_layer], batch, aux_kinds) if use_aux else torch.zeros(())
        lm = lm_loss(out.logits, batch.input_ids, tok.pad_token_id) if args.lm_weight > 0 else torch.zeros(())
        bind = (probe.loss(out.hidden_states[bind_layer], model.model.embed_tokens.weight, batch.bind_labels,
                           batch.query_pos) if use_bind else torch.zeros(()))
        (loss + args.lm_weight * lm + args.aux_weight * aux * use_aux + args.bind_weight * bind).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        probe_opt.step()
        memory_init(model, memory_heads, args.memory_decay)
        opt.zero_grad(set_to_none=True)
        probe_opt.zero_grad(set_to_none=True)
        step += 1

        hits = exact.tolist()
        curriculum.update([h for h, k in zip(hits, batch.kinds) if k == "single"])
        window["loss"].append(loss.item())
        window["aux"].append(aux.item())
        window["lm"].append(lm.item())
        if use_bind:
            window["bind"].append(bind.item())
        for h, k in zip(hits, batch.kinds):
            window[k].append(h)
        if step % 10 == 0:
            stats = {k: round(sum(v) / len(v), 3) for k, v in window.items()}
            elapsed = time.time() - t0
            print(f"step {step} t={elapsed / 60:.1f}m lr={lr:.2e} max_docs={curriculum.max_docs} "
                  f"T={batch.input_ids.shape[1]} {json.dumps(stats)}", flush=True)
            metrics.write(json.dumps({"step": step, "time": elapsed, "max_docs": curriculum.max_docs, **stats}) + "\n")
            metrics.flush()
            window.clear()
        if step % args.eval_every == 0:
            scores = validate(model, tok, valid)
            print(f"VALID step {step} {json.dumps({k: round(v, 3) for k, v in scores.items()})}", flush=True)
            metrics.write(json.dumps({"step": step, "valid": scores}) + "\n")
            if scores["single"] > best:
                best = scores["single"]
                checkpoint(best_path)
        if step % args.ckpt_every == 0:
            checkpoint(last_path)
    checkpoint(last_path)
    print(f"stopped at step {step} after {(time.time() - t0) / 60:.1f} min", flush=True)


if __name__ == "__main__":
    main()
