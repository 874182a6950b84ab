"""Save a random-init qwen3_5 hybrid as a local Hugging Face model directory the gateway can serve.

The model is `bench_model()` of bench/ttft.py (Gated DeltaNet + gated attention, 3:1, width 512,
slow-decaying linear heads via `hypic_core.testing.slow_decay`) with the bundled model's
tokenizer (models/hypic-tiny: tokenizer.json, tokenizer_config.json, chat_template.jinja) and
`vocab_size = len(tokenizer)`, so every token id the gateway produces fits.

Two changes make it a predictable load-test model: the output-embedding rows of the special
tokens (EOS among them) and of every token whose text alone is empty or half a character are
zeroed. Their logits are then exactly 0 while the maximum over ~1900 random logits is positive,
so greedy decoding never stops early (outputs run to `max_tokens` even on a server without
`ignore_eos`) and every generated token streams as its own non-empty text chunk (inter-token
latencies are per token).

Run:  .venv/bin/python bench/make_bench_model.py /tmp/bench-model
      .venv/bin/python bench/make_bench_model.py /tmp/bench-model-small --layers 4 --hidden 256
Then: HYPIC_MODEL=/tmp/bench-model .venv/bin/hypic serve    (or bench/serve.py --model /tmp/bench-model)
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hypic_core.testing import slow_decay  # noqa: E402

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def layer_types(layers: int, ratio: int) -> list[str]:
    """`ratio` Gated DeltaNet layers then one gated-attention layer, repeated (3:1 like Qwen3.5)."""
    return ["full_attention" if (i + 1) % (ratio + 1) == 0 else "linear_attention" for i in range(layers)]


def silent_token_ids(tokenizer) -> list[int]:
    """Ids that stream no text on their own: special tokens and tokens decoding to '' or a partial character."""
    silent = set(tokenizer.all_special_ids)
    for i in range(len(tokenizer)):
        text = tokenizer.decode([i], skip_special_tokens=True)
        if not text or "\ufffd" in text:
            silent.add(i)
    return sorted(silent)


def build(args: argparse.Namespace, tokenizer) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, Qwen3_5TextConfig

    cfg = Qwen3_5TextConfig(
        vocab_size=len(tokenizer), hidden_size=args.hidden, intermediate_size=args.intermediate or 3 * args.hidden,
        num_hidden_layers=args.layers, layer_types=layer_types(args.layers, args.linear_per_attention),
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
        linear_key_head_dim=args.linear_head_dim, linear_value_head_dim=args.linear_head_dim,
        linear_num_key_heads=args.linear_heads, linear_num_value_heads=args.linear_heads, linear_conv_kernel_dim=4,
        max_position_embeddings=args.max_positions, tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
    )
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    slow_decay(model, args.seed)
    with torch.no_grad():
        model.get_output_embeddings().weight[silent_token_ids(tokenizer)] = 0.0
    return model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("outdir", type=Path)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--linear-per-attention", type=int, default=3, help="Gated DeltaNet layers per attention layer")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--intermediate", type=int, default=None, help="MLP width (default 3 x hidden)")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--linear-heads", type=int, default=4)
    ap.add_argument("--linear-head-dim", type=int, default=128)
    ap.add_argument("--max-positions", type=int, default=32768)
    ap.add_argument("--tokenizer", type=Path, default=ROOT / "models" / "hypic-tiny",
                    help="directory with the tokenizer files")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer, local_files_only=True)
    model = build(args, tokenizer)
    args.outdir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.outdir)
    for name in TOKENIZER_FILES:
        if (args.tokenizer / name).is_file():
            shutil.copy2(args.tokenizer / name, args.outdir / name)

    from hypic_core.engine.engine import Engine

    engine = Engine.from_pretrained(args.outdir)  # what the gateway does: fails here if the directory is unusable
    params = sum(p.numel() for p in engine.model.parameters())
    types = engine.model.config.layer_types
    print(f"{args.outdir}: qwen3_5, {params / 1e6:.1f}M parameters, {len(types)} layers "
          f"({types.count('linear_attention')} Gated DeltaNet, {types.count('full_attention')} gated attention), "
          f"vocab {engine.vocab_size}, EOS {sorted(engine.eos_ids)}")


if __name__ == "__main__":
    main()
