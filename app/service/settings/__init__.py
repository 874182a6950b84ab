"""Gateway settings: the only place environment variables are read.

Every field can be set as `HYPIC_<FIELD>` in the environment or in a `.env` file in the working
directory (environment wins), e.g. `HYPIC_PORT=9000`, `HYPIC_API_KEY=secret`; an empty variable
counts as unset and `none` sets an optional field to None. Paths are relative to the working
directory. Invalid values fail at startup with the field named.

The fields live by area, one module each (model, prompt, retrieval, engine, cache, guard, limits,
tenants, server, ray); `Settings` combines them into one flat model, so a field is read as
`settings.<field>` whatever its area. A new setting goes into its area's class, with a
`description`: docs/settings.md is generated from them (`python -m app.service.settings.reference`).
"""

from __future__ import annotations

from pathlib import Path

from pydantic import model_validator

from .cache import CacheSettings
from .engine import EngineSettings
from .guard import GuardSettings
from .limits import LimitSettings
from .model import DEFAULT_MODEL, ModelSettings
from .prompt import PromptSettings
from .ray import RaySettings
from .retrieval import (DEFAULT_INDEX_DIR, DEMO_CORPUS_PATH, TINY_CORPUS_PATH, TINY_INDEX_DIR, TINY_MODEL, RetrievalSettings,
                        default_index_dir, demo_corpus)
from .server import ServerSettings
from .tenants import TenantSettings

# In the order docs/settings.md lists them (the reference's sections).
AREAS = (ModelSettings, PromptSettings, RetrievalSettings, EngineSettings, CacheSettings, GuardSettings, LimitSettings,
         TenantSettings, ServerSettings, RaySettings)


class Settings(RaySettings, ServerSettings, TenantSettings, LimitSettings, GuardSettings, CacheSettings, EngineSettings,
               RetrievalSettings, PromptSettings, ModelSettings):
    """Configuration of one gateway process: every area's fields, flat."""

    @model_validator(mode="after")
    def _defaults_of_the_model(self) -> "Settings":
        # The model as `_former_model_path` settles it (validators of the areas may run after this one).
        model = self.model_path if self.model_path is not None and "model" not in self.model_fields_set else self.model
        # Assigning marks a field as set: these two stay unset, since corpus_to_seed (app/service/runtime.py)
        # tells the demo corpus from one the user named by that.
        if "index_dir" not in self.model_fields_set:
            self.index_dir = default_index_dir(model)
            self.__pydantic_fields_set__.discard("index_dir")
        if "corpus_path" not in self.model_fields_set:
            self.corpus_path = demo_corpus(model)
            self.__pydantic_fields_set__.discard("corpus_path")
        # Unset (not even "none"): the disk tier lives beside the index, so an index pointed
        # elsewhere (a test's tmp dir) takes its cache along instead of writing into data/.
        if "cache_dir" not in self.model_fields_set:
            self.cache_dir = self.index_dir.parent / "cache"
        return self

    @property
    def demo_index(self) -> bool:
        """Whether index_dir is the model's default one, the only index the demo corpus (an unset corpus_path) seeds."""
        return self.index_dir == default_index_dir(self.model)

    @property
    def collections_root(self) -> Path:
        """`collections_dir`, or 'collections' beside index_dir when unset."""
        return self.collections_dir if self.collections_dir is not None else self.index_dir.parent / "collections"


__all__ = ["AREAS", "DEFAULT_INDEX_DIR", "DEFAULT_MODEL", "DEMO_CORPUS_PATH", "Settings", "TINY_CORPUS_PATH", "TINY_INDEX_DIR",
           "TINY_MODEL", "default_index_dir", "demo_corpus", *(area.__name__ for area in AREAS)]
