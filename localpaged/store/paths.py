"""Where the store keeps things, and which model names are safe to turn into paths."""

from __future__ import annotations

import os
import re
from pathlib import Path

import platformdirs

APP = "localpaged"

# `smollm2:135m`, `qwen2.5-coder:7b-awq`, `my-model`: lower-case words, one optional `:tag`.
_NAME_RE = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}(:[a-z0-9][a-z0-9._-]{0,63})?")
# `org/repo` as the Hugging Face hub spells them.
_REPO_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}")


def home() -> Path:
    """The data folder: `$LOCALPAGED_HOME`, else the platform's user data dir."""
    env = os.environ.get("LOCALPAGED_HOME")
    return Path(env).expanduser() if env else Path(platformdirs.user_data_dir(APP))


def models_dir() -> Path:
    """Where pulled models live, one folder each."""
    return home() / "models"


def staging_dir() -> Path:
    """Where pulls download before they are complete (kept between runs, for resuming)."""
    return home() / "partial"


def registry_path() -> Path:
    """The JSON registry of pulled and imported models."""
    return home() / "registry.json"


def user_catalog_path() -> Path:
    """The user's own catalog: `$LOCALPAGED_HOME/models.toml`, else the user config dir's."""
    env = os.environ.get("LOCALPAGED_HOME")
    if env:
        return Path(env).expanduser() / "models.toml"
    return Path(platformdirs.user_config_dir(APP)) / "models.toml"


def is_repo_id(name: str) -> bool:
    """Whether `name` is spelled like a hub `org/repo` id."""
    return bool(_REPO_RE.fullmatch(name)) and ".." not in name


def check_name(name: str) -> str:
    """Return `name` if it is a safe model name or `org/repo` id; raise ValueError otherwise.

    Names become folder names, so `..`, absolute paths, backslashes, empty parts and other
    path tricks are refused."""
    if not isinstance(name, str) or not name:
        raise ValueError("empty model name")
    problem = None
    if name.startswith(("/", "~")) or re.match(r"[A-Za-z]:[\\/]", name):
        problem = "it is an absolute path"
    elif ".." in name:
        problem = "it contains '..'"
    elif "\\" in name or "//" in name or name.endswith("/"):
        problem = "it contains '\\', '//' or a trailing '/'"
    elif any(ord(c) < 32 or ord(c) == 127 for c in name):
        problem = "it contains control characters"
    elif name.count("/") > 1:
        problem = "a repo id has exactly one '/' (org/repo)"
    elif "/" in name and not is_repo_id(name):
        problem = "a repo id is org/repo with letters, digits, '.', '_' and '-'"
    elif "/" not in name and not _NAME_RE.fullmatch(name):
        problem = "a name is lower-case letters, digits, '.', '_', '-' and one optional ':tag'"
    if problem:
        raise ValueError(
            f"refusing model name {name!r}: {problem}. "
            "To use a local file or folder, give a path that exists."
        )
    return name


def dirname_for(name: str) -> str:
    """The folder name a checked model name is stored under (`org/repo` -> `org--repo`)."""
    check_name(name)
    return name.replace("/", "--").replace(":", "__")
