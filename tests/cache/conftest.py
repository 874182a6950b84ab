"""The cache area: segment entries and their keys, serialization and salts, the store's tiers (host
memory, disk, Redis) alone and together, several processes on one cache, forgetting a deleted
document, an engine answering from each tier, and slow or stopped shared tiers that must not stall
HTTP. `stores.py` is the area's fixture factory (the two-layer model, the tiny engine over a store,
a gateway over the tiers); the `model` fixture below gives each module its own two-layer model."""

import pytest

import stores
from helpers import ROOT, RedisServer, load_script, random_segments  # noqa: F401 - `from conftest import` finds them


@pytest.fixture(scope="module")
def model():
    return stores.model()
