"""The gateway area (app/): HTTP and the OpenAI API against live servers, hostile input, limits and
connections, tenants, the documents API and its settings, the CLI, SSE and logs, prompt building,
the accuracy guard, startup failures, Ray Serve replicas and the Docker files. `gateways.py` is the
area's fixture factory: `gateway(root, tokenizer, corpus, **settings)` serves a tiny gateway,
`served(app)` any other app, `engine(tokenizer)` the tiny engine a module's gateways share."""

from helpers import ROOT, RedisServer, load_script, random_segments  # noqa: F401 - `from conftest import` finds them
