"""Convert a llama checkpoint (SmolLM2-135M-Instruct) into a Bamba hybrid, and assemble it from trained mixers.

Layout (recipe 2): Mamba2 mixers with inner width 2 x hidden (`mamba_expand` 2), the layout
llama.cpp's `granitehybrid` graph and vLLM's Bamba load. For a teacher with H query heads of
width P (H * P = hidden), a mixer has 2H heads of width P and H B/C groups of state size P, so
mixer heads 2j and 2j+1 share group j. Both are initialised from attention head j (linear
attention is attention without the softmax, so the projections carry over):

    C (queries, group j)      <- Q_j = W_q h               (head j's rows of W_q)
    B (keys, group j)         <- K of head j's KV group     (GQA: KV heads repeated)
    x (values, heads 2j, 2j+1) <- V of head j's KV group
    z (output gate)           <- the same V rows (a GLU-style gate; trained)
    out_proj                  <- W_o's columns of head j, half to each of the two copies
    dt, A                     <- head 2j remembers briefly, head 2j+1 long (`DT_SHORT`, `DT_LONG`,
                                 spread log-uniformly over j); the dt rows of in_proj start at 0
    conv1d                    <- identity (last tap 1), so the short convolution starts as a no-op
    norm                      <- the gated RMSNorm over each group (the pair of heads), standing in
                                 for the softmax's normaliser; its scale is fitted by least squares

Which layers keep attention is `ATTN_LAYERS`, chosen by measurement (the model card's tables;
`python -m training.hybrid.sensitivity`, then `python -m training.hybrid.restore`). Training (training/hybrid/distill.py) learns
low-rank corrections (LoRA) to the projections and the small mixer parameters in full, and
LoRA corrections to the teacher's own linears that stay (`ADAPTER_RANKS`: the kept attention
layers' projections and every layer's MLP), so the layers around a mixer adapt to it; the
shipped file `mixers.safetensors` holds only those, and `assemble()` rebuilds the full
checkpoint from the teacher's weights in seconds (the corrections merged into the weights, so
the checkpoint is a plain Bamba one). A file without adapter factors is the same model with
zero corrections.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from torch import nn

# Layers of SmolLM2-135M (30 layers) that keep their attention: the layers holding the teacher's
# copying (retrieval) heads (17-24: training/hybrid/retrieval_heads.py) keep it, and of the
# others the least sensitive 15 become mixers (the model card's sensitivity table); then the two
# trained mixers that alone cost the teacher's answers the most (8 and 14:
# training/hybrid/restore.py) got their attention back, leaving 13 mixers. Other layer counts
# (the tests' tiny models) keep every other layer, starting with the second.
ATTN_LAYERS: tuple[int, ...] | None = (0, 1, 2, 3, 8, 11, 13, 14, 16, 17, 18, 19, 20, 21, 22, 23, 24)
LORA_RANK_IN = 128
LORA_RANK_OUT = 64
DT_SHORT = (1 / 64, 1 / 4)  # softplus(dt_bias) of the even heads: memory 1/dt of 4 to 64 tokens
DT_LONG = (1 / 2048, 1 / 96)  # the odd heads: 96 to 2048 tokens
RECIPE_VERSION = 2
# LoRA ranks of the teacher linears that are corrected in training, by the decoder layer's
# submodule (Bamba names): the kept attention layers' q/k/v/o, every layer's gate/up/down
ADAPTER_RANKS = {"self_attn": 32, "feed_forward": 16}
ATTN_PROJ = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJ = ("gate_proj", "up_proj", "down_proj")


def attn_layers(n_layers: int) -> list[int]:
    if ATTN_LAYERS is not None and n_layers == 30:
        return list(ATTN_LAYERS)
    return [i for i in range(n_layers) if i % 2 == 1]


def bamba_config(teacher_cfg: dict, attn: list[int] | None = None):
    """The BambaConfig of the hybrid for a llama config dict (teacher's config.json); `attn`
    overrides which layers keep attention."""
    from transformers import BambaConfig

    heads, kv, hidden = teacher_cfg["num_attention_heads"], teacher_cfg["num_key_value_heads"], teacher_cfg["hidden_size"]
    head_dim = teacher_cfg.get("head_dim") or hidden // heads
    if head_dim * heads != hidden:
        raise ValueError("the conversion needs heads * head_dim == hidden_size (mixer width 2 x hidden = 2 copies of each head)")
    rope = dict(teacher_cfg.get("rope_parameters") or {"rope_type": "default", "rope_theta": teacher_cfg.get("rope_theta", 10000.0)})
    rope["partial_rotary_factor"] = 1.0  # Bamba defaults to 0.5; llama rotates the whole head
    n = teacher_cfg["num_hidden_layers"]
    cfg = BambaConfig(
        vocab_size=teacher_cfg["vocab_size"], hidden_size=hidden, intermediate_size=teacher_cfg["intermediate_size"],
        num_hidden_layers=n, num_attention_heads=heads, num_key_value_heads=kv, hidden_act=teacher_cfg["hidden_act"],
        rms_norm_eps=teacher_cfg["rms_norm_eps"], tie_word_embeddings=teacher_cfg.get("tie_word_embeddings", False),
        max_position_embeddings=teacher_cfg["max_position_embeddings"],
        attn_layer_indices=sorted(attn) if attn is not None else attn_layers(n),
        mamba_n_heads=2 * heads, mamba_d_head=head_dim, mamba_n_groups=heads, mamba_d_state=head_dim, mamba_d_conv=4,
        mamba_expand=2, mamba_chunk_size=64, mamba_conv_bias=True, mamba_proj_bias=False,
        rope_parameters=rope, attention_bias=teacher_cfg.get("attention_bias", False), mlp_bias=teacher_cfg.get("mlp_bias", False),
        pad_token_id=teacher_cfg.get("pad_token_id"), bos_token_id=teacher_cfg.get("bos_token_id"),
        eos_token_id=teacher_cfg.get("eos_token_id"),
    )
    cfg.architectures = ["BambaForCausalLM"]  # llama.cpp's convert_hf_to_gguf.py picks its converter by this
    return cfg


class LoRALinear(nn.Module):
    """`base + up @ down` with a frozen base; `weight` is the merged matrix (what Bamba's fused
    path reads). `up` starts at zero, so a fresh LoRALinear computes exactly the base."""

    def __init__(self, base: torch.Tensor, rank: int, seed: int = 0):
        super().__init__()
        self.register_buffer("base", base.detach().clone(), persistent=False)
        out_f, in_f = base.shape
        gen = torch.Generator().manual_seed(seed)
        self.down = nn.Parameter(torch.randn(rank, in_f, generator=gen, dtype=base.dtype) / math.sqrt(in_f))
        self.up = nn.Parameter(torch.zeros(out_f, rank, dtype=base.dtype))
        self.bias = None

    @property
    def weight(self) -> torch.Tensor:
        return self.base + self.up @ self.down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.base.T + (x @ self.down.T) @ self.up.T


def _per_head(w: torch.Tensor, n_in: int, n_out: int) -> torch.Tensor:
    """(n_in*hd, hidden) -> (n_out*hd, hidden): head blocks repeated in order (repeat_interleave)."""
    hd = w.shape[0] // n_in
    return w.reshape(n_in, hd, -1).repeat_interleave(n_out // n_in, dim=0).reshape(n_out * hd, -1)


def base_in_proj(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, kv: int) -> torch.Tensor:
    """The mixer's in_proj rows [z | x | B | C | dt] from the attention's projections."""
    v2 = _per_head(v, kv, 2 * heads)  # mixer head m reads V of attention head m // 2's KV group
    k1 = _per_head(k, kv, heads)  # group j: K of head j's KV group
    dt = torch.zeros(2 * heads, q.shape[1], dtype=q.dtype)
    return torch.cat([v2, v2, k1, q, dt], 0)


def base_out_proj(o: torch.Tensor, heads: int) -> torch.Tensor:
    """(hidden, 2*hidden): W_o's columns of head j, halved, for each of mixer heads 2j and 2j+1."""
    hidden = o.shape[0]
    hd = o.shape[1] // heads
    return 0.5 * o.reshape(hidden, heads, 1, hd).expand(hidden, heads, 2, hd).reshape(hidden, 2 * heads * hd)


def init_dt(heads: int) -> torch.Tensor:
    """softplus(dt_bias) of the 2*heads mixer heads: even ones short memory, odd ones long."""
    short = torch.exp(torch.linspace(math.log(DT_SHORT[1]), math.log(DT_SHORT[0]), heads, dtype=torch.float64))
    long_ = torch.exp(torch.linspace(math.log(DT_LONG[1]), math.log(DT_LONG[0]), heads, dtype=torch.float64))
    return torch.stack([short, long_], 1).reshape(-1)


def init_small(heads: int, conv_dim: int, kernel: int, d_inner: int, dtype=torch.float32) -> dict[str, torch.Tensor]:
    """Deterministic initial values of the mixer's small parameters (`heads`: the teacher's)."""
    dt = init_dt(heads)
    conv = torch.zeros(conv_dim, 1, kernel, dtype=dtype)
    conv[:, 0, -1] = 1.0
    return {
        "dt_bias": (dt + torch.log(-torch.expm1(-dt))).to(dtype),  # softplus^-1(dt)
        "A_log": torch.zeros(2 * heads, dtype=dtype),  # A = -1
        "D": torch.zeros(2 * heads, dtype=dtype),
        "conv1d.weight": conv,
        "conv1d.bias": torch.zeros(conv_dim, dtype=dtype),
        "norm.weight": torch.ones(d_inner, dtype=dtype),
    }


def teacher_layer_weights(teacher_sd: dict[str, torch.Tensor], i: int) -> tuple[torch.Tensor, ...]:
    p = f"model.layers.{i}.self_attn."
    return tuple(teacher_sd[p + n + ".weight"].float() for n in ("q_proj", "k_proj", "v_proj", "o_proj"))


def make_mixer(config, layer_idx: int, teacher_sd: dict[str, torch.Tensor]):
    """A trainable BambaMixer for layer `layer_idx` initialised from the teacher's attention:
    in_proj and out_proj are LoRALinear over the mapped weights."""
    from transformers.models.bamba.modeling_bamba import BambaMixer

    mixer = BambaMixer(config, layer_idx)
    q, k, v, o = teacher_layer_weights(teacher_sd, layer_idx)
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    mixer.in_proj = LoRALinear(base_in_proj(q, k, v, heads, kv), LORA_RANK_IN, seed=2 * layer_idx)
    mixer.out_proj = LoRALinear(base_out_proj(o, heads), LORA_RANK_OUT, seed=2 * layer_idx + 1)
    small = init_small(heads, mixer.conv_dim, mixer.conv_kernel_size, mixer.intermediate_size)
    with torch.no_grad():
        for name, value in small.items():
            mixer.get_parameter(name).copy_(value)
    return mixer


SMALL = ("dt_bias", "A_log", "D", "conv1d.weight", "conv1d.bias", "norm.weight")


def mixer_state(mixer) -> dict[str, torch.Tensor]:
    """What is trained (and shipped) of one mixer."""
    return {
        "in_proj.down": mixer.in_proj.down, "in_proj.up": mixer.in_proj.up,
        "out_proj.down": mixer.out_proj.down, "out_proj.up": mixer.out_proj.up,
        **{n: mixer.get_parameter(n) for n in SMALL},
    }


def load_mixer_state(mixer, state: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for name, tensor in mixer_state(mixer).items():
            tensor.copy_(state[name].to(tensor.dtype))


def adapted_linears(config, layer_idx: int) -> list[str]:
    """The teacher linears of one decoder layer (names under the layer) that carry a LoRA
    correction: a kept attention layer's projections, and the MLP of every layer."""
    names = [f"feed_forward.{n}" for n in MLP_PROJ]
    if layer_idx in config.attn_layer_indices:
        names = [f"self_attn.{n}" for n in ATTN_PROJ] + names
    return names


def is_adapter_key(key: str) -> bool:
    """Whether a layer's trained-state key is an adapter factor (`self_attn.q_proj.down`), not a mixer's."""
    return key.split(".", 1)[0] in ADAPTER_RANKS


def has_mixer_state(state: dict[str, torch.Tensor]) -> bool:
    """Whether a layer's trained state holds a mixer (any key that is not an adapter factor)."""
    return any(not is_adapter_key(k) for k in state)


def add_adapters(layer, config, layer_idx: int, state: dict[str, torch.Tensor] | None = None) -> list[nn.Parameter]:
    """Wrap the adapted linears of a decoder layer in LoRALinear (factors from `state` where it
    has them, else a zero correction); returns the new trainable factors."""
    params = []
    for k, name in enumerate(adapted_linears(config, layer_idx)):
        parent, attr = name.rsplit(".", 1)
        owner = layer.get_submodule(parent)
        lin = getattr(owner, attr)
        if getattr(lin, "bias", None) is not None:
            raise ValueError(f"layer {layer_idx} {name}: a linear with a bias is not adapted")
        lora = LoRALinear(lin.weight.detach().float(), ADAPTER_RANKS[parent], seed=10_000 + 16 * layer_idx + k)
        if state is not None and f"{name}.down" in state:
            with torch.no_grad():
                for part in ("down", "up"):
                    src, dst = state[f"{name}.{part}"], getattr(lora, part)
                    if src.shape != dst.shape:
                        raise ValueError(f"layer {layer_idx} {name}.{part}: shape {tuple(src.shape)}, this recipe's is {tuple(dst.shape)}")
                    dst.copy_(src.to(dst.dtype))
        setattr(owner, attr, lora)
        params += [lora.down, lora.up]
    return params


def layer_state(layer) -> dict[str, torch.Tensor]:
    """What is trained (and shipped) of one decoder layer: its mixer's state (a converted layer
    with a trainable mixer) and the factors of its adapted linears."""
    out: dict[str, torch.Tensor] = {}
    mixer = getattr(layer, "mamba", None)
    if mixer is not None and isinstance(mixer.in_proj, LoRALinear):
        out.update(mixer_state(mixer))
    for name, m in layer.named_modules():
        if isinstance(m, LoRALinear) and is_adapter_key(name):
            out[f"{name}.down"], out[f"{name}.up"] = m.down, m.up
    return out


def merged_mixer_weights(config, layer_idx: int, teacher_sd: dict[str, torch.Tensor], state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The plain BambaMixer weights (names under `mamba.`) for one layer."""
    q, k, v, o = teacher_layer_weights(teacher_sd, layer_idx)
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    f = lambda t: t.float()  # noqa: E731
    out = {
        "in_proj.weight": base_in_proj(q, k, v, heads, kv) + f(state["in_proj.up"]) @ f(state["in_proj.down"]),
        "out_proj.weight": base_out_proj(o, heads) + f(state["out_proj.up"]) @ f(state["out_proj.down"]),
    }
    for n in SMALL:
        out[n] = f(state[n])
    return out


def hybrid_state_dict(config, teacher_sd: dict[str, torch.Tensor], mixers: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The full Bamba state dict: the teacher's embeddings, norms, MLPs and kept attention layers,
    with merged mixers at the converted layers and the adapter corrections merged into the
    teacher's linears. `mixers` is keyed `layers.{i}.{name}`."""
    attn = set(config.attn_layer_indices)
    sd: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": teacher_sd["model.embed_tokens.weight"],
        "model.final_layernorm.weight": teacher_sd["model.norm.weight"],
    }
    if not config.tie_word_embeddings:
        sd["lm_head.weight"] = teacher_sd["lm_head.weight"]
    for i in range(config.num_hidden_layers):
        t, b = f"model.layers.{i}.", f"model.layers.{i}."
        sd[b + "input_layernorm.weight"] = teacher_sd[t + "input_layernorm.weight"]
        sd[b + "pre_ff_layernorm.weight"] = teacher_sd[t + "post_attention_layernorm.weight"]
        for n in MLP_PROJ:
            sd[b + f"feed_forward.{n}.weight"] = teacher_sd[t + f"mlp.{n}.weight"]
        state = {n[len(f"layers.{i}."):]: v for n, v in mixers.items() if n.startswith(f"layers.{i}.")}
        if i in attn:
            for n in ATTN_PROJ:
                sd[b + f"self_attn.{n}.weight"] = teacher_sd[t + f"self_attn.{n}.weight"]
        elif has_mixer_state(state):  # a layer without trained mixers is left out (the caller installs its mixer)
            for n, v in merged_mixer_weights(config, i, teacher_sd, state).items():
                sd[b + f"mamba.{n}"] = v
        for name in adapted_linears(config, i):
            if f"{name}.down" in state:
                w = sd[b + name + ".weight"]
                sd[b + name + ".weight"] = w.float() + state[f"{name}.up"].float() @ state[f"{name}.down"].float()
    return {k: v.float().contiguous() for k, v in sd.items()}


def load_teacher_state(teacher_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    sd: dict[str, torch.Tensor] = {}
    for f in sorted(Path(teacher_dir).glob("*.safetensors")):
        sd.update(load_file(f))
    return sd


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json",
                   "special_tokens_map.json")


def mixers_config(mixers_file: Path) -> list[int] | None:
    """The attention layers recorded in a mixers file's metadata (None when it has none)."""
    from safetensors import safe_open

    with safe_open(str(mixers_file), "pt") as f:
        meta = f.metadata() or {}
    return json.loads(meta["attn_layers"]) if "attn_layers" in meta else None


def assemble(teacher_dir: Path, mixers_file: Path, target: Path, stamp: dict | None = None) -> Path:
    """Write the hybrid checkpoint (config, fp32 safetensors, tokenizer) into `target` from the
    teacher's directory and the trained mixers; atomic (a temporary directory, then a rename)."""
    import shutil

    from safetensors.torch import load_file, save_file

    teacher_dir, target = Path(teacher_dir), Path(target)
    teacher_cfg = json.loads((teacher_dir / "config.json").read_text())
    config = bamba_config(teacher_cfg, mixers_config(mixers_file))
    sd = hybrid_state_dict(config, load_teacher_state(teacher_dir), load_file(mixers_file))
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    config.save_pretrained(tmp)
    save_file(sd, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    for name in TOKENIZER_FILES:
        if (teacher_dir / name).is_file():
            shutil.copy2(teacher_dir / name, tmp / name)
    if stamp is not None:
        (tmp / "hypic-model.json").write_text(json.dumps(stamp, indent=1) + "\n")
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    return target
