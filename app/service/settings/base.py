"""The configuration every area's settings class shares: `HYPIC_` variables, a `.env` file."""

from __future__ import annotations

from pydantic_settings import BaseSettings, SettingsConfigDict


class AreaSettings(BaseSettings):
    """Base of each area's settings; `Settings` (the package) combines the areas into one flat model."""

    model_config = SettingsConfigDict(env_prefix="HYPIC_", env_file=".env", env_file_encoding="utf-8", extra="ignore",
                                      env_ignore_empty=True, env_parse_none_str="none")
