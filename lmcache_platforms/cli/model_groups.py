"""The KV-cache groups vLLM would make for a model folder, computed by vLLM itself without reading a weight.

vLLM's engine asks every attention-like layer of the built model for its ``KVCacheSpec``, then groups them
(``get_kv_cache_groups``, the hybrid KV-cache manager's grouping). The same happens here, with the model built
on the meta device: no memory, no weights, no download (a folder that is not local is refused before vLLM
sees it, so it never reaches for the Hugging Face hub). Figures are those of vLLM on this machine's platform:
its default block size differs between CPU and GPU (``--block-size`` sets it).
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

OPTIONS = {"dtype": "--dtype", "cache_dtype": "--kv-cache-dtype", "block_size": "--block-size"}
"""vLLM's config fields and the options of ``plan --model`` that set them, for error messages."""


class ModelFolderError(ValueError):
    """The model folder or a setting for it is unusable; the message is one line for the user."""


@dataclass(frozen=True)
class ModelGroups:
    """vLLM's groups (``KVCacheGroupSpec``s) and the settings they were made with."""

    architecture: str
    dtype: str
    kv_cache_dtype: str
    block_size: int | None
    groups: tuple[Any, ...]


def config_folder(path: str) -> Path:
    """The local folder holding ``config.json``: ``path`` itself, or the folder of a ``config.json`` given."""
    given = Path(path)
    folder = given.parent if given.name == "config.json" and given.is_file() else given
    if not (folder / "config.json").is_file():
        raise ModelFolderError(f"--model {path}: no config.json there (give a local model folder or its "
                               "config.json; nothing is downloaded)")
    return folder


class _Placeholder:
    """Stands in for a CUDA event or stream while a model is built where torch has no CUDA: vLLM's CPU worker
    replaces them the same way, as some model classes create them in ``__init__`` and only use them on GPU."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        del args, kwargs


@contextlib.contextmanager
def _cuda_placeholders() -> Iterator[None]:
    import torch

    if torch.cuda.is_available():
        yield
        return
    saved = torch.cuda.Event, torch.Event, torch.cuda.Stream
    torch.cuda.Event = torch.Event = torch.cuda.Stream = _Placeholder  # type: ignore[misc, assignment]
    try:
        yield
    finally:
        torch.cuda.Event, torch.Event, torch.cuda.Stream = saved  # type: ignore[misc]


@contextlib.contextmanager
def _single_rank(vllm_config: Any) -> Iterator[None]:
    """vLLM's parallel state for one rank (its layers ask it for their shard), torn down after unless the
    process already had one."""
    import torch.distributed
    from vllm.config import set_current_vllm_config
    from vllm.distributed.parallel_state import (
        destroy_distributed_environment,
        destroy_model_parallel,
        ensure_model_parallel_initialized,
        init_distributed_environment,
    )

    owned = not torch.distributed.is_initialized()
    with set_current_vllm_config(vllm_config), tempfile.TemporaryDirectory(prefix="lmcache-platforms-plan-") as tmp:
        if owned:
            init_distributed_environment(1, 0, f"file://{tmp}/rendezvous", 0, "gloo")
            ensure_model_parallel_initialized(1, 1)
        try:
            yield
        finally:
            if owned:
                destroy_model_parallel()
                destroy_distributed_environment()


@contextlib.contextmanager
def _quiet_vllm() -> Iterator[None]:
    """vLLM logs its start-up notes to stdout at INFO; the plan is the output here."""
    logger = logging.getLogger("vllm")
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)


def _layer_specs(vllm_config: Any) -> dict[str, Any]:
    """Every layer's spec as vLLM's model runner collects them: layers sharing another's cache, and those
    needing none (encoder-only attention), have none."""
    from vllm.config.vllm import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention import Attention
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
    from vllm.v1.kv_cache_interface import AttentionSpec
    from vllm.v1.worker.utils import customize_attention_spec

    specs = {}
    layers = get_layers_from_vllm_config(vllm_config, cast(type[Any], AttentionLayerBase))
    for name, layer in layers.items():
        if isinstance(layer, Attention) and layer.kv_sharing_target_layer_name:
            continue
        spec = layer.get_kv_cache_spec(vllm_config)
        if spec:
            if isinstance(spec, AttentionSpec):
                spec = customize_attention_spec(layer.get_attn_backend(), spec)
            specs[name] = spec
    return specs


def _configs(folder: Path, dtype: str, kv_cache_dtype: str, block_size: int | None) -> Any:
    from pydantic import ValidationError
    from vllm.config import CacheConfig, ModelConfig, VllmConfig

    try:
        # The user's strings as given: vLLM's own validation names what it accepts.
        model_args: dict[str, Any] = {"model": str(folder), "dtype": dtype, "skip_tokenizer_init": True}
        cache_args: dict[str, Any] = {"cache_dtype": kv_cache_dtype}
        if block_size:
            cache_args["block_size"] = block_size
        model = ModelConfig(**model_args)
        cache = CacheConfig(**cache_args)
        return VllmConfig(model_config=model, cache_config=cache)
    except ValidationError as exc:
        error = exc.errors()[0]
        field = str(error["loc"][0]) if error["loc"] else ""
        option = f"{OPTIONS.get(field, field)} {error.get('input')!r}: " if field else ""
        raise ModelFolderError(f"--model {folder}: vLLM refuses {option or 'it: '}{_first_sentence(error['msg'])}"
                               ) from exc
    except (ValueError, OSError) as exc:
        raise ModelFolderError(f"--model {folder}: vLLM refuses it: {_first_sentence(str(exc))}") from exc


def _first_sentence(message: str) -> str:
    """vLLM's reason without its appendix (the list of every supported architecture, ...)."""
    text = " ".join(message.split()).removeprefix("Value error, ")
    cut = text.find(". ")
    return text[: cut + 1] if cut > 0 else text


def model_groups(path: str, dtype: str = "auto", kv_cache_dtype: str = "auto",
                 block_size: int | None = None) -> ModelGroups:
    """vLLM's KV-cache groups for the model at ``path`` with these settings (those of ``vllm serve``'s
    ``--dtype``, ``--kv-cache-dtype`` and ``--block-size``)."""
    import torch
    from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts, resolve_kv_cache_layout
    from vllm.v1.core.kv_cache_utils import get_kv_cache_groups

    folder = config_folder(path)
    with _quiet_vllm():
        vllm_config = _configs(folder, dtype, kv_cache_dtype, block_size)
        architecture = vllm_config.model_config.architectures[0]
        with _single_rank(vllm_config), _cuda_placeholders(), torch.device("meta"):
            try:
                initialize_model(vllm_config)
                specs = _layer_specs(vllm_config)
                backends = get_current_attn_backends(vllm_config)
                layouts = [layout.name for layout in get_supported_kv_cache_layouts(backends)]
                resolve_kv_cache_layout(vllm_config, [layouts], specs.values())
                groups = get_kv_cache_groups(vllm_config, specs)
            except (AssertionError, AttributeError, KeyError, NotImplementedError, TypeError, ValueError) as exc:
                # vLLM checks a config's dimensions as it builds the layers, by assertions among others.
                raise ModelFolderError(f"--model {folder}: vLLM cannot build {architecture} from this config.json: "
                                       f"{type(exc).__name__}: {_first_sentence(str(exc))}") from exc
    cache = vllm_config.cache_config
    return ModelGroups(
        architecture=architecture,
        dtype=str(vllm_config.model_config.dtype).removeprefix("torch."),
        kv_cache_dtype=cache.cache_dtype,
        block_size=cache.block_size,
        groups=tuple(groups),
    )
