"""The web page's settings (``rollwire ui``), read from ``ROLLWIRE_UI_*``; the command's options override them."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from schemas.ui_links import DEFAULT_UI_PORT

DEFAULT_MAX_BYTES = 512 * 1024 * 1024


class UiSettings(BaseSettings):
    """Where the page listens, how much of the log it keeps, and the vocabulary it decodes tokens with."""

    model_config = SettingsConfigDict(env_prefix="ROLLWIRE_UI_", extra="ignore", env_ignore_empty=True)

    host: str = Field(default="127.0.0.1", description="Listen address of `rollwire ui`.")
    port: int = Field(default=DEFAULT_UI_PORT, ge=1, le=65535, description="Listen port of `rollwire ui`.")
    max_bytes: int = Field(default=DEFAULT_MAX_BYTES, ge=1, description=(
        "The page's memory budget in bytes: past it, the sessions updated least recently are dropped whole "
        "(the page is rebuilt from the log by starting it again)."))
    tokenizer: str | None = Field(default=None, description=(
        "`tokenizer.json`, or the model folder holding it, that the trace page decodes with; unset: the "
        "embedded engine's model when it serves, else the Qwen vocabulary."))
