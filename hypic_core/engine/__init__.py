"""The engine: the step loop (schedule -> execute -> update), its sequences, the cache manager,
prefill strategies, sampling and detokenization. The tensor work is hypic_core/runner/."""
