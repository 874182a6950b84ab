"""The engine: the step loop (schedule -> execute -> update), its sequences, prefill strategies, model runner,
layer managers, decode batch, sampling and detokenization."""
