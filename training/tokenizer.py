"""Byte-level BPE tokenizer trained locally on the synthetic world, saved for transformers.

Every word of ``world.vocabulary()`` (names, professions, industries, years) is an added
token matched as a whole word, so it is always exactly one token. The space before such a
word stays a separate byte-level token, so a name is the same token at the start of a line
(the answer) and inside a sentence (a document). Special tokens: ``<|im_start|>``,
``<|im_end|>`` (eos) and ``<|endoftext|>`` (pad). The chat template is ChatML.

Usage: ``python -m training.tokenizer OUT_DIR``.
"""

from __future__ import annotations

import random
import sys

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from training import world

BPE_VOCAB_SIZE = 1024
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _corpus(n_worlds: int = 8, per_world: int = 200):
    """Prompts and answers from a few training worlds (the BPE learns the template words)."""
    rng = random.Random(0)
    for seed in range(n_worlds):
        w = world.World(world.TRAIN_SEED_BASE - 1 - seed)
        for _ in range(per_world):
            kind = rng.choice(world.KINDS)
            ex = w.example(rng, kind, rng.randint(2, 4))
            segments, answer = world.prompt_segments(ex)
            yield "".join(segments) + answer + "<|im_end|>\n"


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Train the BPE, add the world's words as single tokens, wrap it for transformers."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(w, single_word=True, normalized=False) for w in world.vocabulary()])
    trainer = trainers.BpeTrainer(vocab_size=BPE_VOCAB_SIZE, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=None, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", unk_token=None)
    fast.chat_template = CHAT_TEMPLATE
    return fast


if __name__ == "__main__":
    out = sys.argv[1] if len(sys.argv) > 1 else "var/train/tokenizer"
    t = build_tokenizer()
    t.save_pretrained(out)
    print(f"saved tokenizer with {len(t)} tokens to {out}")
