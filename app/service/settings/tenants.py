"""API keys and tenants (app/service/tenants.py; docs/deploy.md, "Teams")."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, PrivateAttr, SecretStr, field_validator, model_validator

from .base import AreaSettings


class TenantSettings(AreaSettings):
    """Who may call the gateway, the tenant each key opens, and each tenant's quotas."""

    api_key: SecretStr | None = Field(None, description="When set, requests need 'Authorization: Bearer <key>'; the key "
                                      "opens the tenant 'default' (its documents are the index in index_dir).")
    api_keys: SecretStr | None = Field(None, description='API keys and the tenant each opens, as JSON: {"<key>": "<tenant>", ...}; '
                                       "a tenant name is 1-63 of a-z 0-9 _ - (starting with a letter or digit), several keys "
                                       "may open one tenant. Beside api_key, which opens 'default'.")
    api_keys_file: Path | None = Field(None, description="A JSON file of the same shape as api_keys, read at startup.")
    collections_dir: Path | None = Field(None, description="Where tenants' collections of documents are kept (one index "
                                         "directory each); unset: a 'collections' directory beside index_dir.")
    shared_collections: dict[str, list[str]] = Field({}, description='Collections every tenant reads, with the tenants that may '
                                                     'write them: {"<collection>": ["<tenant>", ...]}. Their chunks\' cache '
                                                     "entries are shared by every tenant.")
    tenant_max_documents: int = Field(0, ge=0, description="Documents one tenant may keep in its collections; beyond: 429. 0: no limit.")
    tenant_max_bytes: int = Field(0, ge=0, description="UTF-8 bytes of chunk text one tenant may keep in its collections; "
                                  "beyond: 429. 0: no limit.")
    tenant_max_requests: int = Field(0, ge=0, description="Requests one tenant may have in flight at once (the probes "
                                     "excepted); beyond: 429 with Retry-After. 0: no limit.")
    metrics_tenant_labels: bool = Field(False, description="Label the hypic_tenant_* metrics with tenant names "
                                        "(/metrics needs no key: whoever reaches it then sees each tenant's name, traffic "
                                        "and cache reuse). Off: every tenant is counted under tenant=\"all\".")
    _tenant_keys: dict[str, str] = PrivateAttr(default_factory=dict)

    @field_validator("api_key")
    @classmethod
    def _blank_key_is_none(cls, value: SecretStr | None) -> SecretStr | None:
        return value if value is not None and value.get_secret_value() else None

    @model_validator(mode="after")
    def _tenant_keys_read(self) -> "TenantSettings":
        from ..tenants import DEFAULT_TENANT, check_shared_collection_name, parse_keys

        keys: dict[str, str] = {}
        sources = [("api_key", {self.api_key.get_secret_value(): DEFAULT_TENANT} if self.api_key is not None else {})]
        if self.api_keys is not None and self.api_keys.get_secret_value().strip():
            sources.append(("api_keys", parse_keys(self.api_keys.get_secret_value(), "api_keys")))
        if self.api_keys_file is not None:
            try:
                text = self.api_keys_file.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                raise ValueError(f"api_keys_file: cannot read {self.api_keys_file}: {exc}") from None
            sources.append(("api_keys_file", parse_keys(text, "api_keys_file")))
        for name, found in sources:
            for key, tenant in found.items():
                if keys.get(key, tenant) != tenant:
                    raise ValueError(f"{name}: a key opens two tenants ({keys[key]!r} and {tenant!r})")
                keys[key] = tenant
        self._tenant_keys = keys
        for collection, writers in self.shared_collections.items():
            check_shared_collection_name(collection, "shared_collections")
            for tenant in writers:
                parse_keys({"-": tenant}, "shared_collections")
        return self

    @property
    def tenant_keys(self) -> dict[str, str]:
        """Every API key and the tenant it opens (api_key, api_keys, api_keys_file); empty: no key needed."""
        return dict(self._tenant_keys)
