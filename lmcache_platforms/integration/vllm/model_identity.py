"""Which model computed a chunk: its config as vLLM sees it and its weights' identity, in every chunk key.

LMCache keys a chunk by the model's name (vLLM's ``model``: a path or a hub id), and our layout fingerprint
by the KV's shape; neither changes when the weights do. Two servers sharing a store that serve different
weights under one name (a fine-tune written over a folder, a hub id at another revision) read each other's
chunks and answer wrongly. The weights are identified without reading them:
  - a file in the Hugging Face cache is a link to a blob named by its content hash (sha256 for LFS files,
    git's blob hash otherwise): that name, the same on every machine;
  - any other file: its size and modification time, which change whenever it is rewritten (two copies of one
    checkpoint differ unless the copy kept the times: they then share nothing, never something wrong);
  - ``platforms.model_revision``, when set, replaces the files' identity: the user vouches that servers given
    the same revision hold the same weights (e.g. a checkpoint's hash), so copies share chunks.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MODEL_TAG = "lmcache.tag.lmcp_model"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
# Keys of a config that name where or by what it was saved, not the model.
_NOT_THE_MODEL = ("_name_or_path", "transformers_version", "_commit_hash")
_BLOB_NAME = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")


@dataclass(frozen=True)
class ModelIdentity:
    """The key tag's value and what it was made of (for the start-up log)."""

    tag: str
    config: str
    weights: str
    weights_found: bool = True

    def describe(self) -> str:
        return f"model identity {self.tag} (config {self.config}, weights {self.weights})"


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]


def config_identity(hf_config: Any) -> str:
    """A hash of the model's config as vLLM sees it, without where it was loaded from."""
    as_dict = hf_config.to_dict() if hasattr(hf_config, "to_dict") else dict(vars(hf_config))
    return _digest({k: v for k, v in as_dict.items() if k not in _NOT_THE_MODEL})


def file_identity(path: Path) -> str:
    """A weight file's content hash when the Hugging Face cache names its blob by it, else size and mtime."""
    target = Path(os.path.realpath(path))
    if target.parent.name == "blobs" and _BLOB_NAME.fullmatch(target.name):
        return f"blob:{target.name}"
    stat = target.stat()
    return f"stat:{stat.st_size}:{stat.st_mtime_ns}"


def weight_files(model: str, revision: str | None) -> list[Path] | None:
    """The model's weight files: in its folder, a single file, or its Hugging Face cache snapshot (never
    downloaded here); None when none can be found."""
    path = Path(model)
    if path.is_file():
        return [path]
    if not path.is_dir():
        try:
            from huggingface_hub import snapshot_download

            path = Path(snapshot_download(model, revision=revision, local_files_only=True))
        except (OSError, ValueError):  # not in the local cache, or not a hub id: nothing to stat
            return None
    files = sorted(p for p in path.iterdir() if p.name.endswith(WEIGHT_SUFFIXES))
    return files or None


def model_identity(model_config: Any, model_revision: str = "") -> ModelIdentity:
    """The identity of the model vLLM serves (``vllm_config.model_config``) as one short key tag value."""
    config = config_identity(model_config.hf_config)
    quantization = getattr(model_config, "quantization", None)
    if model_revision:
        weights: Any = {"revision": model_revision}
        described = f"revision {model_revision!r} (platforms.model_revision)"
    else:
        files = weight_files(str(model_config.model), getattr(model_config, "revision", None))
        if files is None:
            weights = {"unfound": [str(model_config.model), getattr(model_config, "revision", None)]}
            described = "not found: named by model and revision only"
        else:
            weights = {p.name: file_identity(p) for p in files}
            kinds = sorted({identity.split(":", 1)[0] for identity in weights.values()})
            described = f"{len(files)} file(s) by {'+'.join(kinds)}"
    tag = _digest([config, quantization, weights])
    return ModelIdentity(tag=tag, config=config, weights=f"{_digest(weights)}: {described}",
                         weights_found="unfound" not in weights)
