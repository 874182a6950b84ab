"""Training of the bundled hybrid (qwen3_5) model on a synthetic encyclopedia.

Modules: ``world`` (seeded data generator and prompt layout), ``tokenizer`` (local byte-level
BPE with the world's names as single tokens), ``train`` (model construction and training
loop) and ``evaluate`` (exact match with plain transformers, full prefill, greedy).
"""
