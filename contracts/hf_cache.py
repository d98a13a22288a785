"""A Hugging Face model id (``Qwen/Qwen3-0.6B``) as the directory the local HF cache holds for it, as
``vllm serve Qwen/Qwen3-0.6B`` finds it. Nothing is ever downloaded: an id that is not in the cache
is an error that says so.

The cache is huggingface_hub's layout: ``$HF_HUB_CACHE`` (else ``$HF_HOME/hub``, else
``~/.cache/huggingface/hub``) / ``models--{org}--{name}`` / ``snapshots/<revision>``, the revision named
by ``refs/main``.
"""
from __future__ import annotations

import os
import re

from contracts.config import ConfigError

_MODEL_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


def hub_cache_dir() -> str:
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
    return os.path.join(home, "hub")


def looks_like_model_id(name: str) -> bool:
    return bool(_MODEL_ID.match(name)) and not os.path.exists(name)


def cached_model_dir(model_id: str, revision: str = "main") -> str:
    """The snapshot directory of ``model_id`` in the local cache (ConfigError when it is not there)."""
    repo = os.path.join(hub_cache_dir(), "models--" + model_id.replace("/", "--"))
    snapshots = os.path.join(repo, "snapshots")
    ref = os.path.join(repo, "refs", revision)
    commit = None
    if os.path.isfile(ref):
        with open(ref, encoding="utf-8") as f:
            commit = f.read().strip()
    elif os.path.isdir(snapshots):
        found = sorted(os.listdir(snapshots))
        commit = found[0] if len(found) == 1 else None
    path = os.path.join(snapshots, commit) if commit else None
    if path is None or not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError(f"model {model_id!r} is neither a path nor in the local Hugging Face cache "
                          f"({hub_cache_dir()}); pagedserve never downloads models: fetch it first "
                          f"(`huggingface-cli download {model_id}`) or pass --model PATH")
    return path
