"""Where the built-in model ships: the package data directory `meshd/model/builtin/`."""

from __future__ import annotations

import importlib.resources
import pathlib


def builtin_model_dir() -> pathlib.Path:
    """The built-in checkpoint directory inside the installed package."""
    resource = importlib.resources.files("meshd.model") / "builtin"
    # Installed as plain files (setuptools package-data), so the traversable is a real path.
    return pathlib.Path(str(resource))


def builtin_draft_dir() -> pathlib.Path:
    """The built-in model's draft (`meshd_train distill`), shipped beside it."""
    resource = importlib.resources.files("meshd.model") / "builtin_draft"
    return pathlib.Path(str(resource))
