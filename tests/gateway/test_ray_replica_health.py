"""A gateway replica on Ray Serve whose model fails to load is replaced (`GatewayReplica.check_health`),
on a real local Ray instance."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
CORPUS = [{"id": "varo", "title": "Varo", "text": "Varo is a city on the river Alna. Its mayor is Ines Kell."}]


def test_a_replica_whose_model_failed_to_load_is_replaced(tmp_path):
    """Before: the replica stayed up answering 503 (/ready: "status": "failed") for good, since Serve's
    health check (the default: the actor is alive) passed. Now it fails `check_health`, Serve
    starts another, and once the model is repaired the new replica serves."""
    import ray
    from ray import serve

    from app.serve_ray.deployments import APP_NAME, build_application
    from app.service.settings import Settings
    from app.testing import free_port

    model = tmp_path / "model"
    shutil.copytree(ROOT / "models" / "hypic-tiny", model)
    config = (model / "config.json").read_text()
    (model / "config.json").write_text("{ not json")
    (tmp_path / "corpus.jsonl").write_text("".join(json.dumps(d) + "\n" for d in CORPUS))
    settings = Settings(_env_file=None, model=str(model), index_dir=tmp_path / "index", corpus_path=tmp_path / "corpus.jsonl",
                        embedder="hashing", cache_dir=None, guard_enabled=False, torch_threads=1, ray_replicas=1,
                        ray_replica_cpus=0, ray_health_check_s=2, host="127.0.0.1", log_level="warning")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _system_config={"worker_register_timeout_seconds": 300},
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}})
    port = free_port()  # after ray.init: Ray binds fixed ports of its own as it starts
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve._run(build_application(settings), name=APP_NAME, route_prefix="/", _blocking=False)
        url, failed, deadline = f"http://127.0.0.1:{port}", set(), time.monotonic() + 240
        # The first replica's load fails. Serve says so once its health check fails (it retries a
        # replica failing at startup 3 times, then gives up: a model that never loads fails the
        # deployment); without the check, the replica is up and says so on /ready, for good.
        while not failed:
            assert time.monotonic() < deadline, "no replica failed its load"
            gateway = serve.status().applications[APP_NAME].deployments.get("gateway")
            if gateway is not None and "failed to start" in (gateway.message or ""):
                failed.add("startup")
            r = _get(f"{url}/ready", timeout=1)
            if _load_failed(r):
                failed.add(r.headers["x-hypic-replica"])
            time.sleep(0.2)
        (model / "config.json").write_text(config)  # repaired: a replica started from now on loads
        while True:
            assert time.monotonic() < deadline, f"no replica became ready; failed ones: {failed}"
            r = _get(f"{url}/ready")
            if r is not None and r.status_code == 200:
                break
            if _load_failed(r):
                failed.add(r.headers["x-hypic-replica"])
            time.sleep(0.2)
        assert r.headers["x-hypic-replica"] not in failed  # a new replica, not the failed one recovering
        answer = httpx.post(f"{url}/v1/completions", json={"model": "model", "prompt": "Varo is", "max_tokens": 2}, timeout=120)
        assert answer.status_code == 200, answer.text
    finally:
        serve.shutdown()
        ray.shutdown()


def _get(url: str, timeout: float = 10) -> httpx.Response | None:
    try:
        return httpx.get(url, timeout=timeout)
    except httpx.HTTPError:
        return None  # the proxy or ingress is (re)starting


def _load_failed(r: httpx.Response | None) -> bool:
    """Whether `r` is a replica's /ready saying its load failed."""
    return r is not None and r.status_code == 503 and "x-hypic-replica" in r.headers and r.json().get("status") == "failed"
