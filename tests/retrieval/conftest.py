"""The retrieval area (retrieval/): the chunker and its properties, embedders, the vector index and
several processes writing one, ingestion (file formats, the pipeline, `hypic ingest`) and strict
JSON. `index_child.py` is the index writers' child-process side (it imports only the index). Live
gateways come from the gateway area's factory (`gateways.py`)."""

from helpers import ROOT, RedisServer, load_script, random_segments  # noqa: F401 - `from conftest import` finds them
