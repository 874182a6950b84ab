"""The training area: the training script's pieces and the synthetic world, the question sets under
data/ (real_qa, short_qa) and the bench scripts that load and score them (`helpers.load_script`
loads a script by path). The distilled hybrid's own tests run its model, so they live in engine/."""

from helpers import ROOT, RedisServer, load_script, random_segments  # noqa: F401 - `from conftest import` finds them
