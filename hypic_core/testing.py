"""Tiny random models for tests and benchmarks, with slow-decaying linear heads.

Random init makes most linear heads forget within a few tokens, so a test of state carried
across segments would test nothing; `slow_decay` fixes that after construction (post_init
re-initialises the decay parameters, so it must run afterwards).
"""

from __future__ import annotations

import torch

SMALL = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, max_position_embeddings=2048, tie_word_embeddings=False)
LINEAR = dict(linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
              linear_conv_kernel_dim=4)

MAMBA2 = dict(mamba_n_heads=4, mamba_d_head=32, mamba_d_state=16, mamba_n_groups=1, mamba_d_conv=4, mamba_expand=2,
              mamba_chunk_size=16)
# Mamba2 mixers pass through a gated norm: at the default init scale (0.02) the carried state barely moves the
# logits, so a test that stitching changes anything would have nothing to see.
WIDE_INIT = dict(initializer_range=0.1)

FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_next", "olmo_hybrid", "olmo_hybrid_nope", "qwen3", "llama",
            "bamba", "granitemoehybrid", "nemotron_h", "zamba2", "falcon_h1", "kimi_linear", "minimax")


def tiny_config(family: str, **overrides):
    import transformers as tf

    layers4 = ["linear_attention", "linear_attention", "full_attention", "linear_attention"]
    if family == "qwen3_5":
        cfg = tf.Qwen3_5TextConfig(**{**SMALL, **LINEAR, "num_hidden_layers": 4, "layer_types": layers4, **overrides})
    elif family == "qwen3_5_moe":
        cfg = tf.Qwen3_5MoeTextConfig(**{**SMALL, **LINEAR, "num_hidden_layers": 4, "layer_types": layers4,
                                         "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                         "shared_expert_intermediate_size": 32, **overrides})
    elif family == "qwen3_next":
        cfg = tf.Qwen3NextConfig(**{**SMALL, **LINEAR, "num_hidden_layers": 4, "layer_types": layers4,
                                    "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                    "shared_expert_intermediate_size": 32, **overrides})
    elif family in ("olmo_hybrid", "olmo_hybrid_nope"):
        cfg = tf.OlmoHybridConfig(**{**SMALL, **LINEAR, "num_hidden_layers": 4, "layer_types": layers4,
                                     "pad_token_id": 0, "eos_token_id": 1, **overrides})
        if family.endswith("nope"):
            cfg.rope_parameters = None  # released OLMo-hybrid checkpoints use no positions
    elif family == "bamba":
        cfg = tf.BambaConfig(**{**SMALL, **MAMBA2, **WIDE_INIT, "num_hidden_layers": 4, "attn_layer_indices": [2],
                                **overrides})
    elif family == "granitemoehybrid":  # Granite 4.0-H: NoPE attention, MoE
        cfg = tf.GraniteMoeHybridConfig(**{**SMALL, **MAMBA2, **WIDE_INIT, "num_hidden_layers": 4,
                                           "layer_types": ["mamba", "mamba", "attention", "mamba"],
                                           "num_local_experts": 4, "num_experts_per_tok": 2,
                                           "shared_intermediate_size": 64, **overrides})
    elif family == "nemotron_h":  # NoPE attention; "-" is an MLP-only layer
        cfg = tf.NemotronHConfig(**{**SMALL, **WIDE_INIT, "num_hidden_layers": 4, "hybrid_override_pattern": "M-*M",
                                    "mamba_num_heads": 4, "mamba_head_dim": 32, "ssm_state_size": 16, "n_groups": 1,
                                    "chunk_size": 16, **overrides})
    elif family == "zamba2":  # shared attention block inside "hybrid" layers; RoPE on; head_dim = 2 * hidden / heads
        small = {k: v for k, v in SMALL.items() if k != "head_dim"}
        cfg = tf.Zamba2Config(**{**small, **WIDE_INIT, "tie_word_embeddings": True, "num_hidden_layers": 4,
                                 "layers_block_type": ["mamba", "mamba", "hybrid", "mamba"], "n_mamba_heads": 4,
                                 "mamba_d_state": 16, "chunk_size": 16, "use_mem_rope": True, **overrides})
    elif family == "falcon_h1":  # attention and Mamba in parallel in every layer
        cfg = tf.FalconH1Config(**{**SMALL, **MAMBA2, **WIDE_INIT, "mamba_d_ssm": 128, "num_hidden_layers": 3,
                                   **overrides})
    elif family == "kimi_linear":  # KDA layers + MLA attention without positions; layer 0 dense MLP, then MoE
        cfg = tf.KimiLinearConfig(**{**SMALL, "num_hidden_layers": 4, "layer_types": layers4, "num_key_value_heads": 4,
                                     "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16,
                                     "v_head_dim": 16, "linear_head_dim": 16, "linear_num_heads": 4,
                                     "num_experts": 4, "num_experts_per_token": 2, "moe_intermediate_size": 32,
                                     "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 1, **overrides})
    elif family == "minimax":  # lightning layer 0 like the released checkpoints; blocks of 16 tokens
        cfg = tf.MiniMaxConfig(**{**SMALL, "num_hidden_layers": 4, "layer_types": layers4, "block_size": 16,
                                  "num_local_experts": 4, "num_experts_per_tok": 2, **overrides})
    elif family == "qwen3":
        cfg = tf.Qwen3Config(**{**SMALL, "num_hidden_layers": 3, **overrides})
    elif family == "llama":
        cfg = tf.LlamaConfig(**{**SMALL, "num_hidden_layers": 3, **overrides})
    else:
        raise ValueError(f"unknown test family {family!r}; expected one of {FAMILIES}")
    return cfg


def tiny_model(family: str, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides) -> torch.nn.Module:
    """A random model of `family` with slow-decaying linear heads, in eval mode."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, **overrides), dtype=dtype).eval()
    slow_decay(model, seed)
    return model


def slow_decay(model: torch.nn.Module, seed: int = 0) -> None:
    """Give every linear head a per-token decay close to 1 (exp(g) ~ 0.98 .. 0.999)."""
    from .adapters import adapter_for
    from .adapters.lightning import LightningAdapter

    adapter = adapter_for(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        if isinstance(adapter, LightningAdapter):  # fixed decay per head: set the rates themselves
            for pos in range(len(adapter.linear_layers)):
                heads = adapter.state_shape(pos)[0]
                adapter.set_slopes(pos, torch.empty(heads).uniform_(0.002, 0.015, generator=gen))
            return
        for pos in range(len(adapter.linear_layers)):
            a_log, dt_bias = adapter.decay_parameters(pos)
            a_log.copy_(torch.log(torch.empty(a_log.shape).uniform_(0.01, 0.05, generator=gen)))
            dt_bias.fill_(-1.0)  # softplus(a - 1) ~ 0.3, so g = -A * 0.3 ~ -0.003 .. -0.015
