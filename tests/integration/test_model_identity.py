"""Chunk keys carry the model's identity: servers sharing a store that serve other weights under the same model
path never read each other's chunks (real vLLM engines over one ``fs://`` store, weights rewritten in place),
with a negative control (one identity for every model: the rewritten model loads the old KV and answers
wrongly); the same weights, or the same ``platforms.model_revision``, share chunks."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoConfig

from lmcache_platforms.integration.vllm.model_identity import (
    config_identity,
    file_identity,
    model_identity,
    weight_files,
)
from tests.integration.test_request_scope import HIT, run


@pytest.fixture(scope="module")
def tiny() -> Path:
    from lmcache_platforms.tools.demo.model import TINY_MODEL, ensure_model

    return ensure_model(TINY_MODEL)


def model_config(folder: Path, quantization: str | None = None) -> SimpleNamespace:
    return SimpleNamespace(model=str(folder), revision=None, quantization=quantization,
                           hf_config=AutoConfig.from_pretrained(folder))


def test_the_config_counts_not_where_it_was_loaded_from(tiny, tmp_path):
    copy = shutil.copytree(tiny, tmp_path / "copy")
    assert config_identity(AutoConfig.from_pretrained(copy)) == config_identity(AutoConfig.from_pretrained(tiny))
    changed = AutoConfig.from_pretrained(copy)
    changed.rope_theta = 1.0
    assert config_identity(changed) != config_identity(AutoConfig.from_pretrained(tiny))


def test_weight_files_are_known_by_size_and_mtime_or_by_their_hub_blob(tmp_path):
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"x" * 10)
    os.utime(weights, ns=(1, 2_000))
    assert file_identity(weights) == "stat:10:2000"
    os.utime(weights, ns=(1, 3_000))
    assert file_identity(weights) == "stat:10:3000"
    blob = tmp_path / "blobs" / ("ab" * 32)
    blob.parent.mkdir()
    blob.write_bytes(b"y")
    snapshot = tmp_path / "snapshot"
    snapshot.mkdir()
    (snapshot / "model.safetensors").symlink_to(blob)
    (snapshot / "config.json").write_text("{}")
    assert file_identity(snapshot / "model.safetensors") == f"blob:{'ab' * 32}"
    assert weight_files(str(snapshot), None) == [snapshot / "model.safetensors"]
    assert weight_files("no/such/model-anywhere", None) is None


def test_the_identity_follows_the_weights_unless_a_revision_names_them(tiny, tmp_path):
    folder = shutil.copytree(tiny, tmp_path / "m")
    before = model_identity(model_config(folder))
    assert before.weights_found and "1 file(s) by stat" in before.weights
    assert model_identity(model_config(folder)).tag == before.tag
    os.utime(folder / "model.safetensors", ns=(1, 1))
    assert model_identity(model_config(folder)).tag != before.tag
    named = model_identity(model_config(folder), "r1")
    os.utime(folder / "model.safetensors", ns=(1, 2))
    assert model_identity(model_config(folder), "r1").tag == named.tag != model_identity(model_config(folder),
                                                                                         "r2").tag
    assert model_identity(model_config(folder, quantization="fp8"), "r1").tag != named.tag
    unfound = model_identity(SimpleNamespace(model="org/not-cached", revision=None, quantization=None,
                                             hf_config=AutoConfig.from_pretrained(folder)))
    assert not unfound.weights_found


def rewrite_weights(folder: Path) -> None:
    """Other weights of the same shapes in the same file (a fine-tune written over the folder)."""
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    generator = torch.Generator().manual_seed(7)
    save_file({name: t + torch.randn(t.shape, generator=generator).to(t.dtype) * 0.05 for name, t in
               tensors.items()}, str(path), metadata={"format": "pt"})


def store(path: Path) -> dict:
    return {"lmcache.remote_url": f"fs://localhost:0{path}", "lmcache.remote_serde": "naive"}


ONE = [{"salt": None}]


@pytest.mark.slow
def test_servers_with_other_weights_under_one_path_never_share_chunks(tiny, tmp_path):
    model = shutil.copytree(tiny, tmp_path / "model")
    shared, control = tmp_path / "shared", tmp_path / "control"
    [first] = run(model, {"requests": ONE, "extra": store(shared)})
    assert run(model, {"requests": ONE, "extra": store(control), "unidentified": True})[0]["loaded_tokens"] == 0
    [same] = run(model, {"requests": ONE, "extra": store(shared)})
    assert (first["loaded_tokens"], same["loaded_tokens"], same["output"]) == (0, HIT, first["output"])

    rewrite_weights(model)
    [other] = run(model, {"requests": ONE, "extra": store(shared)})
    assert other["loaded_tokens"] == 0
    assert other["output"] != first["output"]  # the new weights answer differently
    [wrong] = run(model, {"requests": ONE, "extra": store(control), "unidentified": True})
    assert wrong["loaded_tokens"] == HIT and wrong["output"] != other["output"]


@pytest.mark.slow
def test_one_model_revision_shares_chunks_across_copies_of_the_weights(tiny, tmp_path):
    model = shutil.copytree(tiny, tmp_path / "model")
    revision = {**store(tmp_path / "store"), "platforms.model_revision": "r1"}
    [first] = run(model, {"requests": ONE, "extra": revision})
    shutil.copyfile(tiny / "model.safetensors", model / "model.safetensors")  # same bytes, new mtime
    [copy] = run(model, {"requests": ONE, "extra": revision})
    assert (first["loaded_tokens"], copy["loaded_tokens"], copy["output"]) == (0, HIT, first["output"])
