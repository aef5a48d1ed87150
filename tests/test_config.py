"""Our settings as docs/configuration.md documents them: every key, variable and default in its settings table, the
order in which the three sources win (vLLM's kv_connector_extra_config, then the environment, then extra_config),
and a bad ``platforms.mode`` refused from any of them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from lmcache_platforms.config import SETTINGS, PlatformSettings, connector_settings

CONFIGURATION = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"


def _documented_settings_table() -> dict[str, tuple[str, str]]:
    """``extra_config`` key -> (environment variable, default) from docs/configuration.md's settings table."""
    rows = re.findall(r"^\| `(platforms\.[a-z_]+)` \| `([A-Z_]+)` \| ([^|]+) \|", CONFIGURATION.read_text(), re.M)
    return {key: (env, default.strip().strip("`")) for key, env, default in rows}


def test_the_configuration_page_lists_every_setting_with_its_variable_and_default() -> None:
    documented = _documented_settings_table()
    declared = {s.key: (s.env, "empty" if s.default == "" else str(s.default).lower() if isinstance(s.default, bool)
                        else str(s.default)) for s in SETTINGS}
    assert documented == declared


def test_defaults_without_any_source() -> None:
    assert PlatformSettings.load({}, env={}) == PlatformSettings()


@pytest.mark.parametrize("setting", SETTINGS, ids=[s.key for s in SETTINGS])
def test_environment_overrides_extra_config_and_kv_connector_extra_config_overrides_both(setting) -> None:
    field = setting.key.removeprefix("platforms.")
    values = {"platforms.mode": ("exploded", "bundled", "exploded"),
              "platforms.kernel_backend": ("cpu", "torch", "triton"),
              "platforms.load_mode": ("sync", "async", "sync"),
              "platforms.load_timeout_s": ("1.5", "0.0", "7.0"),
              "platforms.remote_lookup_timeout_s": ("0.25", "0.0", "2.0"),
              "platforms.remote_connect_timeout_s": ("4.0", "0.0", "0.5"),
              "platforms.remote_retry_s": ("5.0", "0.0", "60.0"),
              "platforms.drain_timeout_s": ("1.0", "0.0", "90.0"),
              "platforms.remote_close_timeout_s": ("2.0", "0.0", "9.0"),
              "platforms.chunk_parts": ("whole", "window", "whole"),
              "platforms.chunk_rows": ("tokens", "blocks", "tokens"),
              "platforms.poison_loads": ("True", "False", "True")}.get(setting.key, ("A", "B", "C"))
    file_value, env_value, vllm_value = values

    def got(settings: PlatformSettings) -> object:
        value = getattr(settings, field)
        return ",".join(value) if isinstance(value, tuple) else str(value)

    assert got(PlatformSettings.load({setting.key: file_value}, env={})) == file_value
    assert got(PlatformSettings.load({setting.key: file_value}, env={setting.env: env_value})) == env_value
    both = PlatformSettings.load({setting.key: file_value}, env={setting.env: env_value},
                                 overrides={setting.key: vllm_value})
    assert got(both) == vllm_value


@pytest.mark.parametrize(("raw", "value"), [(True, True), ("true", True), ("1", True), ("off", False), (False, False)])
def test_a_switch_takes_true_or_false(raw: object, value: bool) -> None:
    assert PlatformSettings.load({"platforms.poison_loads": raw}, env={}).poison_loads is value


def test_a_switch_refuses_anything_else() -> None:
    with pytest.raises(ValueError, match=r"^platforms.poison_loads must be true or false, got 'maybe'$"):
        PlatformSettings.load({"platforms.poison_loads": "maybe"}, env={})


@pytest.mark.parametrize(("source", "where"), [("file", "LMCache's extra_config"),
                                               ("vllm", "vLLM's kv_connector_extra_config")])
def test_a_misspelt_key_is_refused_naming_the_nearest_one(source: str, where: str) -> None:
    given = {"platforms.lod_mode": "async"}
    with pytest.raises(ValueError) as caught:
        PlatformSettings.load(given if source == "file" else None, env={},
                              overrides=given if source == "vllm" else None)
    assert str(caught.value) == (f"unknown setting 'platforms.lod_mode' in {where}; "
                                 "did you mean 'platforms.load_mode'?")


def test_one_group_index_written_without_a_list_is_a_list_of_one() -> None:
    assert PlatformSettings.load({"platforms.save_groups": 0}, env={}).save_groups == ("0",)


def test_a_number_of_seconds_refuses_a_switch() -> None:
    with pytest.raises(ValueError, match=r"^platforms.load_timeout_s must be a number of seconds, got True$"):
        PlatformSettings.load({"platforms.load_timeout_s": True}, env={})


def test_only_platforms_keys_of_kv_connector_extra_config_are_ours() -> None:
    settings = PlatformSettings.load({}, env={}, overrides={"lmcache.chunk_size": 64, "mode": "exploded",
                                                           "kernel_backend": "torch"})
    assert settings == PlatformSettings()


def test_connector_settings_reads_lmcache_config_object_and_vllm_extra(monkeypatch) -> None:
    from lmcache.v1.config import LMCacheEngineConfig

    monkeypatch.setenv("LMCACHE_PLATFORMS_KERNEL_BACKEND", "cpu")
    config = LMCacheEngineConfig.from_defaults(chunk_size=64, extra_config={
        "platforms.kernel_backend": "triton", "platforms.skip_groups": "1, MambaSpec"})
    settings = connector_settings(config, {"platforms.kernel_backend": "torch"})
    assert (settings.kernel_backend, settings.skip_groups) == ("torch", ("1", "MambaSpec"))
    assert connector_settings(config, None).kernel_backend == "cpu"


@pytest.mark.parametrize("source", ["extra_config", "environment", "kv_connector_extra_config"])
def test_a_bad_mode_is_refused_from_every_source(source: str) -> None:
    kwargs = {"extra_config": {}, "env": {}, "overrides": None}
    if source == "extra_config":
        kwargs["extra_config"] = {"platforms.mode": "fused"}
    elif source == "environment":
        kwargs["env"] = {"LMCACHE_PLATFORMS_MODE": "fused"}
    else:
        kwargs["overrides"] = {"platforms.mode": "fused"}
    with pytest.raises(ValueError, match=r"^platforms.mode must be one of bundled, exploded, got 'fused'$"):
        PlatformSettings.load(**kwargs)


@pytest.mark.parametrize(("raw", "error"), [
    ("soon", r"^platforms.load_timeout_s must be a number of seconds, got 'soon'$"),
    ("-1", r"^platforms.load_timeout_s must be >= 0, got '-1'$"),
    ("nan", r"^platforms.load_timeout_s must be >= 0, got 'nan'$"),
])
def test_a_bad_load_timeout_is_refused(raw: str, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        PlatformSettings.load({}, env={"LMCACHE_PLATFORMS_LOAD_TIMEOUT_S": raw})


def test_a_bad_load_mode_is_refused_and_a_timeout_reads_as_seconds() -> None:
    with pytest.raises(ValueError, match=r"^platforms.load_mode must be one of async, sync, got 'later'$"):
        PlatformSettings.load({"platforms.load_mode": "later"}, env={})
    assert PlatformSettings.load({}, env={}, overrides={"platforms.load_timeout_s": 2}).load_timeout_s == 2.0
