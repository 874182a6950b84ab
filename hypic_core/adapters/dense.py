"""Dense full-attention models (llama, qwen2, qwen3, mistral): PIC with no linear layers."""

from __future__ import annotations

from .base import ModelAdapter


class DenseAdapter(ModelAdapter):
    family = "dense"
    model_types = ("llama", "qwen2", "qwen3", "mistral")
    supports_fused_stitch = True  # attention only: the position mask is all a fused stitch needs

    def _classify_layers(self) -> None:
        window = getattr(self.config, "sliding_window", None)
        use_window = getattr(self.config, "use_sliding_window", window is not None)
        from .base import require

        require(not (window and use_window), self.config.model_type,
                "sliding-window attention drops old keys, so cached keys cannot be reused at any offset")
        self.attention_layers = list(range(self.num_layers))
