"""The tensor work the engine and the prefill pool's replicas share: the model runner, its layer
managers and the decode batch (tensors and the transformers cache only; no requests or stores)."""
