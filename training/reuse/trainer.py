"""Reuse-aware self-distillation: an adapter that keeps `full`'s answers when documents are reused.

Each step takes one RAG sample (training/reuse/data.py) and runs it twice through the student
(the served model with LoRA adapters, training/reuse/lora.py, or with every decoder-layer parameter
trained, training/reuse/full.py: `method`): in `full` mode and composed as the
engine serves `hypic` (training/reuse/modes.py, same seam, entry prefix and exact-prefix rule).
The loss on the reply span is

    KL(teacher full || student composed) + KL(teacher full || student full)
        + consistency * KL(student full, held fixed || student composed)
        + agreement * mean(max(0, margin - (composed's logit of full's greedy token
                                             - composed's best other logit)))

so reuse is trained towards full prefill's answer while full's own is kept (Block-Attention trains
both masks). The third term asks for what the gateway's faithfulness measure counts: composed
predicting what the student's own `full` predicts, whatever either's distance to the teacher (a
student that cannot match its teacher leaves two different residuals in the first two terms, and the
gap between them is what changes answers). The fourth term counts what the measure counts more
directly still: a whole answer is kept only if composed's greedy token is full's at every position,
and a small KL can still flip a near tie. The hinge asks composed to prefer full's greedy token by
`margin` logits at each position of the span, and is zero where it already does; it acts at the near
ties only, where a mean KL spends most of its gradient on positions that never flip. With
`reply="student"` the span is the student's own greedy `full` reply, the answer the gateway compares
with, instead of the sample's or the teacher's. The teacher is a given model (SmolLM2 for the
distilled hybrid) or the student's own base (adapters off) for a model tuned for itself. A sample
without a reply gets the teacher's greedy reply in full mode first (`reply_tokens` tokens at most).

`train` resumes from `<out>/checkpoint.pt` (adapter factors, optimiser, step, data cursor, time
spent), written atomically every `save_minutes`; progress goes to stderr and every step's numbers
(loss, both KLs, seconds) to `<out>/log.jsonl`. `export_adapter` writes the shippable adapter (bf16
factors in safetensors and a JSON card), which hypic_core/models/loader.py merges on load.
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Sequence

import torch

from hypic_core.adapters import adapter_for

from . import lora
from .full import FullTuning
from .data import Layout, Sample
from .links import LinkRows, Tunings
from .modes import Composer, full_logits

CHECKPOINT = "checkpoint.pt"
LOG = "log.jsonl"


@dataclass(frozen=True)
class TrainConfig:
    """One reuse-training run. `model` is what the gateway serves (a name or checkpoint path,
    recorded in the adapter); `teacher` None means the student's own base."""

    model: str
    out: str
    teacher: str | None = None
    rank: int = 16  # LoRA's; unused with method="full"
    method: str = "lora"  # or "full": every decoder-layer parameter trained (training/reuse/full.py)
    seam: int = 8
    entry_prefix: tuple[int, ...] = ()
    lr: float = 1e-4
    warmup: int = 10
    minutes: float = 10.0
    steps: int = 1_000_000
    save_minutes: float = 5.0
    reply_tokens: int = 32
    seed: int = 0
    precision: str = "fp32"  # or "bf16": forwards under CPU bf16 autocast (weights, optimiser, KL fp32)
    consistency: float = 0.0  # weight of KL(student full || student composed), the full side held fixed
    agreement: float = 0.0  # weight of the hinge on composed's margin for full's greedy token
    margin: float = 1.0  # logits by which composed should prefer full's greedy token (the hinge's margin)
    reply: str = "sample"  # the span: "sample" (its reply, else the teacher's greedy one) or "student" (its own greedy full reply)
    link: str = ""  # link tokens after every document (training/reuse/links.py): their embedding rows trained too
    sources: dict = field(default_factory=dict)  # what the data was (recorded only)

    def __post_init__(self) -> None:
        if self.method not in ("lora", "full"):
            raise ValueError(f"method must be lora or full, got {self.method!r}")
        if self.rank < 1:
            raise ValueError(f"rank must be >= 1, got {self.rank}")
        if self.seam < 0:
            raise ValueError(f"seam must be >= 0, got {self.seam}")
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if self.precision not in ("fp32", "bf16"):
            raise ValueError(f"precision must be fp32 or bf16, got {self.precision!r}")
        if self.consistency < 0:
            raise ValueError(f"consistency must be >= 0, got {self.consistency}")
        if self.agreement < 0:
            raise ValueError(f"agreement must be >= 0, got {self.agreement}")
        if self.margin < 0:
            raise ValueError(f"margin must be >= 0, got {self.margin}")
        if self.reply not in ("sample", "student"):
            raise ValueError(f"reply must be sample or student, got {self.reply!r}")
        if self.reply_tokens < 1:
            raise ValueError(f"reply_tokens must be >= 1, got {self.reply_tokens}")


@dataclass
class StepResult:
    step: int
    loss: float
    kl_full: float
    kl_composed: float
    gap: float  # KL(student full || student composed): what the consistency term lowers
    hinge: float  # mean hinge of composed's margin for full's greedy token (the agreement term, unweighted)
    agree: float  # share of the span's positions where composed's greedy token is full's
    tokens: int
    reply: int
    seconds: float
    phases: dict  # seconds by phase: reply (the teacher writing it, when needed), teacher, full, composed (with the update)


def kl(teacher: torch.Tensor, student: torch.Tensor) -> torch.Tensor:
    """Mean over positions of KL(teacher || student), both [positions, vocab] logits, in fp32."""
    t = torch.log_softmax(teacher.float(), -1)
    return (t.exp() * (t - torch.log_softmax(student.float(), -1))).sum(-1).mean()


def agreement_hinge(anchor: torch.Tensor, student: torch.Tensor, margin: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean hinge, share agreeing) of `student` logits against `anchor`'s greedy tokens, both
    [positions, vocab]: per position max(0, margin - (student[y] - max over v != y of student[v]))
    with y = anchor's argmax; the share counts positions where student's argmax is y."""
    student = student.float()
    y = anchor.argmax(-1, keepdim=True)
    chosen = student.gather(-1, y).squeeze(-1)
    best_other = student.scatter(-1, y, float("-inf")).max(-1).values
    hinge = torch.clamp(margin - (chosen - best_other), min=0.0).mean()
    return hinge, (chosen > best_other).float().mean()


def learning_rate(step: int, peak: float, warmup: int) -> float:
    """Linear warm-up over `warmup` steps, then `peak` (a function of the step: a resumed run continues it)."""
    return peak * min(1.0, (step + 1) / max(1, warmup))


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def atomic_save(obj, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    tmp.replace(path)


class Trainer:
    """Owns the student (with adapters), the teacher, the optimiser and the composer.

    `student` is mutated (adapters attached). `teacher` None: the student's base is the teacher.
    Both must share the tokenizer's vocabulary. `link`: the ids of `config.link` (the samples'
    layouts carry them after every document; the teacher reads each prompt without them)."""

    def __init__(self, config: TrainConfig, student, teacher=None, eos: Sequence[int] = (), link: Sequence[int] = ()) -> None:
        if bool(config.link) != bool(link):
            raise ValueError("a run with a link needs its token ids (links.link_ids), and ids need the link's text")
        self.config = config
        self.student = student
        self.link = tuple(int(i) for i in link)
        tuning = lora.LoRATuning(student, config.rank, config.seed) if config.method == "lora" else FullTuning(student)
        self.tuning = Tunings(tuning, LinkRows(student, self.link)) if self.link else tuning
        self.teacher = teacher
        if teacher is not None:
            tv, sv = teacher.get_output_embeddings().weight.shape[0], student.get_output_embeddings().weight.shape[0]
            if tv != sv:
                raise ValueError(f"teacher vocabulary {tv} != student vocabulary {sv}: a teacher must share the student's tokenizer")
            for p in teacher.parameters():
                p.requires_grad_(False)
            teacher.eval()
        self.params = self.tuning.parameters()
        self.opt = torch.optim.AdamW(self.params, lr=config.lr, weight_decay=0.0)
        self.composer = Composer(student, config.seam, config.entry_prefix)
        self.eos = set(int(e) for e in eos)
        self.step = 0
        self.cursor = 0
        self.elapsed = 0.0

    # --- the teacher -----------------------------------------------------------------------
    def teacher_layout(self, layout: Layout) -> Layout:
        """The prompt as the teacher reads it: without link segments (a model served without links)."""
        return layout.without(self.link)

    def _teacher_forward(self, ids: torch.Tensor, keep: int) -> torch.Tensor:
        with torch.no_grad(), self._autocast():
            if self.teacher is not None:
                return self.teacher(input_ids=ids, use_cache=False, logits_to_keep=keep).logits[0].float()
            with self.tuning.disabled():
                return self.student(input_ids=ids, use_cache=False, logits_to_keep=keep).logits[0].float()

    def reply_for(self, sample: Sample) -> tuple[int, ...]:
        """The span trained on (stops at EOS, kept): with `reply="student"` the student's own greedy
        reply in full mode (adapters on); else the sample's reply, or the teacher's greedy one."""
        own = self.config.reply == "student"
        if sample.reply is not None and not own:
            return tuple(sample.reply[: self.config.reply_tokens])
        model = self.student if own or self.teacher is None else self.teacher
        base = self.teacher is None and not own  # the student's base is the teacher
        layout = sample.layout if own else self.teacher_layout(sample.layout)
        ids = torch.tensor([layout.ids], dtype=torch.long, device=model.device)
        cache = adapter_for(model).new_cache()
        out: list[int] = []
        with torch.no_grad(), self._autocast(), (self.tuning.disabled() if base else _null()):
            logits = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1).logits
            for _ in range(self.config.reply_tokens):
                tok = int(logits[0, -1].argmax())
                out.append(tok)
                if tok in self.eos or len(out) == self.config.reply_tokens:
                    break
                pos = torch.tensor([[ids.shape[1] + len(out) - 1]], device=model.device)
                logits = model(input_ids=torch.tensor([[tok]], device=model.device), position_ids=pos,
                               cache=cache, use_cache=True, logits_to_keep=1).logits
        return tuple(out)

    # --- one step ---------------------------------------------------------------------------
    def _autocast(self):
        return torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.config.precision == "bf16")

    def train_step(self, sample: Sample) -> StepResult:
        t0 = time.time()
        phases: dict[str, float] = {}

        def lap(name: str, since: float) -> float:
            now = time.time()
            phases[name] = round(now - since, 3)
            return now

        self.student.eval()  # no dropout anywhere; eval only keeps the greedy reply deterministic
        reply = self.reply_for(sample)
        self.student.train()
        if len(reply) < 1:
            raise ValueError("a training sample needs a reply of at least one token")
        t = lap("reply", t0)
        ids = torch.tensor([self.teacher_layout(sample.layout).ids + list(reply)[:-1]], dtype=torch.long, device=self.student.device)
        target = self._teacher_forward(ids, len(reply))
        t = lap("teacher", t)
        self.opt.zero_grad(set_to_none=True)
        with self._autocast():
            s_full = full_logits(self.student, sample.layout, reply)
        kl_full = kl(target, s_full)
        kl_full.backward()  # the full graph is freed before the composed one is built (peak memory)
        anchor = s_full.detach()
        del s_full
        t = lap("full", t)
        with self._autocast():
            s_comp = self.composer.logits(sample.layout, reply)
        kl_comp = kl(target, s_comp)
        gap = kl(anchor, s_comp)
        hinge, agree = agreement_hinge(anchor, s_comp, self.config.margin)
        total = kl_comp
        if self.config.consistency:
            total = total + self.config.consistency * gap
        if self.config.agreement:
            total = total + self.config.agreement * hinge
        total.backward()
        del s_comp
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        for group in self.opt.param_groups:
            group["lr"] = learning_rate(self.step, self.config.lr, self.config.warmup)
        self.opt.step()
        lap("composed", t)
        self.step += 1
        loss = kl_full.item() + kl_comp.item() + self.config.consistency * gap.item() + self.config.agreement * hinge.item()
        return StepResult(self.step, loss, kl_full.item(), kl_comp.item(), gap.item(), hinge.item(), agree.item(),
                          len(sample.layout.ids) + len(reply), len(reply), time.time() - t0, phases)

    def evaluate(self, sample: Sample) -> tuple[float, float, float]:
        """(KL full, KL composed, gap) of one sample, no update; the gap is KL(student full || student composed)."""
        self.student.eval()
        reply = self.reply_for(sample)
        ids = torch.tensor([self.teacher_layout(sample.layout).ids + list(reply)[:-1]], dtype=torch.long, device=self.student.device)
        target = self._teacher_forward(ids, len(reply))
        with torch.no_grad(), self._autocast():
            full = full_logits(self.student, sample.layout, reply)
            comp = self.composer.logits(sample.layout, reply)
        full, comp = full.detach(), comp.detach()  # the composer keeps its graph (training builds on it)
        return float(kl(target, full)), float(kl(target, comp)), float(kl(full, comp))

    def measure(self, samples: Sequence[Sample]) -> dict:
        """Mean KL(teacher full || student full), KL(teacher full || student composed) and the gap
        KL(student full || student composed) on the reply spans of `samples`, with the adapters on
        (`tuned`) and off (`base`); no update."""
        res = {}
        for label in ("base", "tuned"):
            rows = []
            for sample in samples:
                if label == "base":
                    with self.tuning.disabled():
                        rows.append(self.evaluate(sample))
                else:
                    rows.append(self.evaluate(sample))
            res[label] = {key: sum(r[i] for r in rows) / len(rows) for i, key in enumerate(("kl_full", "kl_composed", "gap"))}
        res["samples"], res["step"] = len(samples), self.step
        return res

    # --- checkpoints ------------------------------------------------------------------------
    def state(self) -> dict:
        return {"factors": self.tuning.state(), "opt": self.opt.state_dict(), "step": self.step,
                "cursor": self.cursor, "elapsed": self.elapsed, "config": asdict(self.config),
                "rng": torch.get_rng_state()}

    def save(self, out: Path) -> None:
        atomic_save(self.state(), out / CHECKPOINT)

    def load(self, path: Path) -> None:
        """Resume from a checkpoint. Raises ValueError when it was written for another rank or model."""
        blob = torch.load(path, weights_only=False)
        was = blob["config"]
        for key in ("model", "rank", "teacher", "method", "link"):
            if was.get(key, {"method": "lora", "link": ""}.get(key)) != getattr(self.config, key):
                raise ValueError(f"{path}: written with {key}={was.get(key)!r}, this run has {getattr(self.config, key)!r}; "
                                 "use another --out or the same settings")
        self.tuning.load_state(blob["factors"])
        self.opt.load_state_dict(blob["opt"])
        self.step, self.cursor, self.elapsed = blob["step"], blob["cursor"], blob.get("elapsed", 0.0)
        torch.set_rng_state(blob["rng"])

    def warm_start(self, adapter_dir: Path) -> None:
        """Continue from an exported adapter (`export_adapter`: bf16 factors and adapter.json) where
        no checkpoint is at hand: its factors, step, training time and data cursor (the step when the
        card predates the cursor); the optimiser starts anew. Raises ValueError when it was trained
        for another base, teacher, rank or seam."""
        from safetensors.torch import load_file

        from hypic_core.models.loader import ADAPTER_FILE

        card = _adapter_card(adapter_dir)
        for key, field in (("base", "model"), ("teacher", "teacher"), ("rank", "rank"), ("seam", "seam"), ("method", "method")):
            if card.get(key, "lora" if key == "method" else None) != getattr(self.config, field):
                raise ValueError(f"{adapter_dir}: trained with {key}={card.get(key)!r}, this run has "
                                 f"{getattr(self.config, field)!r}")
        if card.get("link") and card["link"] != self.config.link:  # an adapter without a link may gain one (its rows start unchanged)
            raise ValueError(f"{adapter_dir}: trained with link={card['link']!r}, this run has {self.config.link!r}")
        self.tuning.load_state({k: v.float() if v.is_floating_point() else v
                                for k, v in load_file(str(adapter_dir / ADAPTER_FILE)).items()})
        self.step = int(card["step"])
        self.cursor = int(card.get("cursor", self.step))
        self.elapsed = float(card.get("train_seconds", 0.0))


def _adapter_card(path: Path) -> dict:
    from hypic_core.models.loader import ADAPTER_CARD

    return json.loads((path / ADAPTER_CARD).read_text())


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None


def run(trainer: Trainer, samples: Callable[[int], Iterator[tuple[int, Sample]]], out: Path,
        progress: Callable[[str], None] = say, on_save: Callable[[Trainer], None] | None = None,
        init: Path | None = None) -> Trainer:
    """Train until `minutes` or `steps` run out, resuming from `out`'s checkpoint when there is one,
    else from the exported adapter `init` when given (`Trainer.warm_start`: how a run continues on
    another machine from what was shipped). `samples(cursor)` yields (cursor, sample) from that
    cursor on; `on_save` runs after every checkpoint (the last one included). Returns the trainer."""
    cfg = trainer.config
    out.mkdir(parents=True, exist_ok=True)
    ckpt = out / CHECKPOINT
    if ckpt.is_file():
        trainer.load(ckpt)
        progress(f"resuming from {ckpt} at step {trainer.step} (data cursor {trainer.cursor})")
    elif init is not None:
        trainer.warm_start(Path(init))
        progress(f"continuing the exported adapter {init} at step {trainer.step} (data cursor {trainer.cursor}; "
                 "a new optimiser)")
    t_start = last_save = time.time()
    deadline = t_start + cfg.minutes * 60
    stream = samples(trainer.cursor)
    while trainer.step < cfg.steps and time.time() < deadline:
        cursor, sample = next(stream)
        res = trainer.train_step(sample)
        trainer.cursor = cursor + 1
        trainer.elapsed += res.seconds
        record = {"step": res.step, "loss": round(res.loss, 5), "kl_full": round(res.kl_full, 5),
                  "kl_composed": round(res.kl_composed, 5), "gap": round(res.gap, 5), "hinge": round(res.hinge, 5),
                  "agree": round(res.agree, 4), "tokens": res.tokens, "reply": res.reply,
                  "source": sample.source, "seconds": round(res.seconds, 2), "steps_per_s": round(1 / res.seconds, 4),
                  "lr": trainer.opt.param_groups[0]["lr"], "phases": res.phases, "elapsed": round(trainer.elapsed, 1),
                  "time": round(time.time(), 1)}
        with open(out / LOG, "a") as f:
            f.write(json.dumps(record) + "\n")
        progress(f"step {res.step} {sample.source:7s} {res.tokens:4d} tok KL full {res.kl_full:.4f} composed "
                 f"{res.kl_composed:.4f} gap {res.gap:.4f} agree {res.agree:.2f} ({res.seconds:.1f}s)")
        if time.time() - last_save > cfg.save_minutes * 60:
            trainer.save(out)
            if on_save is not None:
                on_save(trainer)
            last_save = time.time()
            progress(f"checkpoint at step {trainer.step}")
    trainer.save(out)
    if on_save is not None:
        on_save(trainer)
    progress(f"stopped at step {trainer.step}; checkpoint {ckpt}")
    return trainer


def export_adapter(trainer: Trainer, target: Path, card: dict | None = None) -> Path:
    """Write the adapter into `target` (atomically): `adapter.safetensors` (bf16 LoRA factors, scale
    folded in, or bf16 deltas for method "full") and `adapter.json` (base model, method, rank, step, seam, ...)."""
    import shutil

    from safetensors.torch import save_file

    from hypic_core.models.loader import ADAPTER_CARD, ADAPTER_FILE

    target = Path(target)
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    factors = trainer.tuning.exported()
    save_file(factors, str(tmp / ADAPTER_FILE), metadata={"format": "pt"})
    (tmp / ADAPTER_FILE).chmod(0o644)
    info = {"base": trainer.config.model, "teacher": trainer.config.teacher, "method": trainer.config.method, "rank": trainer.config.rank,
            "seam": trainer.config.seam, "step": trainer.step, "cursor": trainer.cursor, "train_seconds": round(trainer.elapsed, 1),
            "lr": trainer.config.lr, "precision": trainer.config.precision, "consistency": trainer.config.consistency,
            **({"agreement": trainer.config.agreement, "margin": trainer.config.margin} if trainer.config.agreement else {}),
            "reply": trainer.config.reply, **({"link": trainer.config.link} if trainer.config.link else {}), **(card or {})}
    (tmp / ADAPTER_CARD).write_text(json.dumps(info, indent=1) + "\n")
    keep = [p for p in target.iterdir() if p.name not in (ADAPTER_FILE, ADAPTER_CARD)] if target.is_dir() else []
    for p in keep:  # a model card or other files beside the adapter stay
        shutil.move(str(p), tmp / p.name)
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    return target
