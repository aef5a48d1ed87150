"""The files of ``examples/`` do what their comments say.

- Every LMCache yaml is read by LMCache's own config loader and by our settings without a single warning (a key
  either does not know is a warning or an error there), and its header's ``vllm serve`` line is a command vLLM
  accepts: our connector, the role the file is for, ``kv_load_failure_policy: recompute``, a fixed
  ``PYTHONHASHSEED`` and ``LMCACHE_CONFIG_FILE`` naming the file itself.
- ``docker-compose.yml`` names an image built from a Dockerfile of ``docker/``, a Redis the LMCache yaml it mounts
  can reach, ports that match the server's, and only environment variables something reads.
- The Redis yaml serves: a real ``vllm serve`` of its header's line (MODEL the tiny local model, the yaml's Redis
  port a private ``redis-server``'s) stores, and a fresh one loads every whole chunk; the prefill/decode pair does
  the same across a producer and a consumer, and the consumer stores nothing.
- Every PromQL expression of the Grafana dashboard and the alert rules names only metric families, and labels,
  that those servers' ``/metrics`` export.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shlex
import shutil
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from lmcache_platforms.config import SETTINGS, PlatformSettings
from lmcache_platforms.tools.demo.client import Sampling, run_requests
from lmcache_platforms.tools.demo.model import TINY_MODEL, ensure_model
from lmcache_platforms.tools.demo.report import expected_hit_tokens
from lmcache_platforms.tools.demo.runners import Resources, free_port
from lmcache_platforms.tools.demo.scenario import BLOCK_SIZE
from lmcache_platforms.tools.demo.server import IN_CORE_WORKER, VllmServer, http_get, server_env, vllm_command
from lmcache_platforms.tools.demo.server_pass import serve_args
from lmcache_platforms.tools.demo.tokenizer import text_of
from lmcache_platforms.tools.demo.workload import TINY_WORKLOAD, build_workload
from lmcache_platforms.tools.redis_server import RedisServer
from tests.ci import missing
from tests.delivery.pins import REPO
from tests.serving.observe import PREFIX

EXAMPLES = REPO / "examples"
LMCACHE_YAMLS = ("cpu-tier.yaml", "local-disk.yaml", "redis.yaml", "redis-cluster.yaml", "pd-producer.yaml",
                 "pd-consumer.yaml")
ROLES = {"pd-producer.yaml": "kv_producer", "pd-consumer.yaml": "kv_consumer"}
CONNECTOR = "LMCachePlatformsConnector"


@dataclass(frozen=True)
class ServeLine:
    """The ``vllm serve`` line of an example's header: its environment assignments and its argv."""

    env: dict[str, str]
    argv: list[str]

    @property
    def kv_transfer_config(self) -> dict[str, Any]:
        at = self.argv.index("--kv-transfer-config")
        return json.loads(self.argv[at + 1])


def serve_line(path: Path) -> ServeLine:
    """The command under ``# Serve`` in ``path``'s header: the indented comment lines there, continuations
    joined."""
    header = path.read_text().split("\n\n", 1)[0].splitlines()
    start = next(i for i, line in enumerate(header) if line.startswith("# Serve"))
    lines = []
    for line in header[start + 1:]:
        if line.startswith("#   "):
            lines.append(line.removeprefix("#   "))
        elif lines:
            break
    words = shlex.split(" ".join(part.removesuffix("\\") for part in lines))
    env = {}
    while "=" in words[0]:
        name, value = words.pop(0).split("=", 1)
        env[name] = value
    return ServeLine(env, words)


def lmcache_loggers() -> list[logging.Logger]:
    """The root logger and every logger LMCache and we made (LMCache's do not propagate to the root)."""
    named = [logging.getLogger(name) for name in list(logging.Logger.manager.loggerDict)
             if name.startswith("lmcache")]
    return [logging.getLogger(), *named]


@contextmanager
def warnings_logged() -> Iterator[list[str]]:
    """Every log record at WARNING or above on LMCache's, our and the root loggers, and every Python warning, while
    the block runs."""
    found: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            found.append(f"{record.name}: {record.getMessage()}")

    handler = Collect(logging.WARNING)
    loggers = lmcache_loggers()
    for logger in loggers:
        logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield found
        found.extend(f"{w.category.__name__}: {w.message}" for w in caught)
    finally:
        for logger in loggers:
            logger.removeHandler(handler)


def load_example(path: Path) -> tuple[Any, PlatformSettings]:
    """LMCache's config of ``path`` as its loader makes it, and our settings from its ``extra_config`` (no
    environment: the file alone)."""
    from lmcache.v1.config import load_engine_config_with_overrides

    config = load_engine_config_with_overrides(config_file_path=str(path))
    return config, PlatformSettings.load(config.extra_config, env={})


def test_the_examples_folder_holds_the_documented_files() -> None:
    assert sorted(p.name for p in EXAMPLES.glob("*.yaml")) == sorted(LMCACHE_YAMLS)
    listed = re.findall(r"^\| (.+?) \|", (EXAMPLES / "README.md").read_text(), re.M)[1:]
    named = sorted(name for row in listed for name in re.findall(r"`([^`/]+)`", row))
    assert named == sorted(p.name for p in EXAMPLES.iterdir() if p.name != "README.md")


@pytest.mark.parametrize("name", LMCACHE_YAMLS)
def test_lmcache_and_our_settings_read_the_example_without_a_warning(name: str, monkeypatch) -> None:
    import lmcache.v1.config  # noqa: F401 - its loggers exist before they are watched

    for variable in [v for v in os.environ if v.startswith("LMCACHE_")]:
        monkeypatch.delenv(variable)
    path = EXAMPLES / name
    raw = yaml.safe_load(path.read_text())
    with warnings_logged() as found:
        config, settings = load_example(path)
    assert found == []
    for key, value in raw.items():
        if key != "extra_config":
            assert getattr(config, key) == (value[len("file://"):] if key == "local_disk" else value), key
    ours = raw.get("extra_config") or {}
    assert ours and all(key.startswith("platforms.") for key in ours), "extra_config holds our keys only"
    by_key = {setting.key: setting for setting in SETTINGS}
    for key, value in ours.items():
        field = key.removeprefix("platforms.")
        assert getattr(settings, field) == type(by_key[key].default)(value), key


@pytest.mark.parametrize("name", LMCACHE_YAMLS)
def test_the_header_says_when_to_use_it_and_serves_it_as_documented(name: str) -> None:
    from vllm.config import KVTransferConfig

    path = EXAMPLES / name
    assert "\n# Use when: " in path.read_text().split("\n\n", 1)[0]
    line = serve_line(path)
    assert line.env == {"PYTHONHASHSEED": "0", "LMCACHE_CONFIG_FILE": f"examples/{name}"}
    assert line.argv[:3] == ["vllm", "serve", "MODEL"] and len(line.argv) == 5
    assert line.kv_transfer_config == {"kv_connector": CONNECTOR, "kv_role": ROLES.get(name, "kv_both"),
                                       "kv_load_failure_policy": "recompute"}
    config = KVTransferConfig(**line.kv_transfer_config)
    assert config.is_kv_transfer_instance and config.kv_load_failure_policy == "recompute"


# The examples' Redis, replaced by a private redis-server's URL where they are served.
EXAMPLE_REDIS = "redis://localhost:6379"
MAX_TOKENS = 8


@dataclass
class Served:
    """What each server answered (the client's per-request results) and its ``/metrics`` after them."""

    answers: dict[str, list[dict[str, Any]]]
    metrics: dict[str, str]


def serve_example(name: str, label: str, redis_url: str, workdir: Path, max_tokens: int) -> tuple[
        list[dict[str, Any]], str]:
    """The tiny model's workload through a fresh ``vllm serve`` of example ``name``'s header line: MODEL the tiny
    local model, the yaml a copy whose Redis is ``redis_url``; the server's host and port, the tests' engine
    shape and the worker in the engine core added. Returns the answers and the server's ``/metrics``."""
    text = (EXAMPLES / name).read_text()
    assert text.count(EXAMPLE_REDIS) == 1, name
    config = workdir / f"{label}.yaml"
    config.write_text(text.replace(EXAMPLE_REDIS, redis_url))
    line = serve_line(EXAMPLES / name)
    port = free_port()
    argv = [vllm_command(), *line.argv[1:2], str(ensure_model(TINY_MODEL)), *line.argv[3:], "--host", "127.0.0.1",
            "--port", str(port), *serve_args(BLOCK_SIZE, TINY_MODEL.max_model_len), *IN_CORE_WORKER]
    env = server_env(Resources.available(), {**line.env, "LMCACHE_CONFIG_FILE": str(config)})
    requests = build_workload(TINY_WORKLOAD, TINY_MODEL.vocab_size)
    prompts = [(r.name, text_of(r.tokens), len(r.tokens)) for r in requests]
    log = workdir / f"{label}.log"
    server = VllmServer(argv, env, log, port, Resources.available())
    with server:
        answers = run_requests(server.base_url, prompts, Sampling(max_tokens=max_tokens))
        metrics = http_get(f"{server.base_url}/metrics", timeout_s=60.0)
    (workdir / f"{label}.metrics").write_text(metrics)  # beside the server's log, for a failing run's reader
    assert server.stopped_in_time and server.exit_code == 0, log.read_text()[-3000:]
    return answers, metrics


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Served:
    """The Redis example served cold then warm on one Redis; the prefill/decode pair, producer then consumer
    (asked with max_tokens 1, as its header's router does), on another."""
    if shutil.which("redis-server") is None:
        missing("redis-server is not on PATH (Debian package redis-server; scripts/test_services.sh installs it)")
    workdir = tmp_path_factory.mktemp("examples")
    answers, metrics = {}, {}
    for runs in ((("cold", "redis.yaml", MAX_TOKENS), ("warm", "redis.yaml", MAX_TOKENS)),
                 (("producer", "pd-producer.yaml", 1), ("consumer", "pd-consumer.yaml", MAX_TOKENS))):
        with RedisServer(str(workdir)) as redis:
            for label, name, max_tokens in runs:
                answers[label], metrics[label] = serve_example(name, label, redis.url, workdir, max_tokens)
    return Served(answers, metrics)


def samples(metrics: str, family: str) -> dict[str, float]:
    """One of our families' samples on ``/metrics``, by their label sets (as written there)."""
    found = {}
    for line in metrics.splitlines():
        match = re.match(rf"^{re.escape(PREFIX + family)}(\{{[^}}]*\}})? (\S+)$", line)
        if match:
            found[match.group(1) or ""] = float(match.group(2))
    return found


def hits(answers: list[dict[str, Any]]) -> list[int]:
    return [answer["lmcache_hit_tokens"] for answer in answers]


@pytest.mark.slow
def test_the_redis_example_serves_a_fresh_server_every_whole_chunk_from_redis(served: Served) -> None:
    chunk = yaml.safe_load((EXAMPLES / "redis.yaml").read_text())["chunk_size"]
    lengths = [answer["prompt_tokens"] for answer in served.answers["cold"]]
    assert hits(served.answers["cold"]) == [0, 0, 0]
    assert hits(served.answers["warm"]) == [expected_hit_tokens(n, chunk) for n in lengths] == [256, 256, 256]
    assert [a["tokens"] for a in served.answers["warm"]] == [a["tokens"] for a in served.answers["cold"]]
    tiers = samples(served.metrics["warm"], "tier_bytes_read_total")
    assert {re.search(r'tier="(\w+)"', label)[1] for label in tiers} == {"RemoteBackend"}  # a fresh server: Redis


@pytest.mark.slow
def test_the_pd_consumer_loads_what_the_producer_stored_and_stores_nothing(served: Served) -> None:
    lengths = [answer["prompt_tokens"] for answer in served.answers["producer"]]
    assert hits(served.answers["consumer"]) == [expected_hit_tokens(n, 256) for n in lengths] == [256, 256, 256]
    assert sum(samples(served.metrics["producer"], "chunks_stored_total").values()) > 0
    assert sum(samples(served.metrics["consumer"], "chunks_stored_total").values()) == 0
    assert [len(a["tokens"]) for a in served.answers["consumer"]] == [MAX_TOKENS] * 3


COMPOSE = EXAMPLES / "docker-compose.yml"


def compose_command_option(command: list[str], option: str) -> str:
    return command[command.index(option) + 1]


def known_environment(name: str) -> bool:
    """Whether something reads ``name``: Python, vLLM (its ``envs``), LMCache (``LMCACHE_<KEY>`` of a config
    key, or a name its code spells out) or our settings."""
    import lmcache
    from lmcache.v1.config import _CONFIG_DEFINITIONS
    from vllm import envs

    if name == "PYTHONHASHSEED" or name in envs.environment_variables or name in {s.env for s in SETTINGS}:
        return True
    if name.startswith("LMCACHE_") and name.removeprefix("LMCACHE_").lower() in _CONFIG_DEFINITIONS:
        return True
    sources = Path(lmcache.__file__).parent.rglob("*.py")
    return any(f'"{name}"' in source.read_text() for source in sources)


def test_compose_builds_our_image_and_serves_through_its_redis(monkeypatch) -> None:
    compose = yaml.safe_load(COMPOSE.read_text())
    services = compose["services"]
    assert sorted(services) == ["redis", "vllm"]
    vllm, redis = services["vllm"], services["redis"]
    context = (COMPOSE.parent / vllm["build"]["context"]).resolve()
    assert context == REPO and (context / vllm["build"]["dockerfile"]).is_file()
    assert vllm["build"]["dockerfile"] == "docker/Dockerfile.cuda" and vllm["image"] == "lmcache-platforms:cuda"
    command = vllm["command"]
    transfer = json.loads(compose_command_option(command, "--kv-transfer-config"))
    assert transfer == {"kv_connector": CONNECTOR, "kv_role": "kv_both", "kv_load_failure_policy": "recompute"}
    assert vllm["ports"] == [f"{compose_command_option(command, '--port')}:{compose_command_option(command, '--port')}"]
    assert vllm["depends_on"] == {"redis": {"condition": "service_healthy"}}
    environment = vllm["environment"]
    assert [name for name in environment if not known_environment(name)] == []
    assert environment["PYTHONHASHSEED"] == "0"
    mounts = dict(volume.removesuffix(":ro").split(":", 1)[::-1] for volume in vllm["volumes"])
    config_source = COMPOSE.parent / mounts[environment["LMCACHE_CONFIG_FILE"]]
    assert config_source == EXAMPLES / "redis.yaml"
    # What LMCache makes of the mounted yaml and the service's variables: the redis service's port, no warning.
    for variable in [v for v in os.environ if v.startswith("LMCACHE_")]:
        monkeypatch.delenv(variable)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    import lmcache.v1.config  # noqa: F401 - its loggers exist before they are watched

    with warnings_logged() as found:
        config, _settings = load_example(config_source)
    assert found == []
    redis_port = compose_command_option(redis["command"], "--port")
    assert config.remote_url == f"redis://redis:{redis_port}"
    assert redis["healthcheck"]["test"] == ["CMD", "redis-cli", "-p", redis_port, "ping"]



# What the examples' PromQL may call; any other word followed by "(" fails the check.
PROMQL_FUNCTIONS = {"sum", "rate", "increase", "histogram_quantile", "label_values"}
PROMQL_KEYWORDS = {"and", "or", "unless", "bool", "offset"}
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")


@dataclass(frozen=True)
class Names:
    """The metric names and label names one PromQL expression uses."""

    metrics: frozenset[str]
    labels: frozenset[str]


def promql_names(expr: str) -> Names:
    """``expr``'s metric and label names: label matchers (``{...}``) and grouping clauses give labels, ranges
    (``[...]``, Grafana's ``$__rate_interval`` included) are dropped, words before ``(`` must be functions, and
    every other word that is not a keyword is a metric name. A ``label_values(metric, label)`` query counts too."""
    labels: set[str] = set()
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    query = re.fullmatch(r"\s*label_values\(\s*([\w:]+)\s*,\s*(\w+)\s*\)\s*", expr)
    if query:
        return Names(frozenset({query.group(1)}), frozenset({query.group(2)}))
    for matchers in re.findall(r"\{([^}]*)\}", expr):
        labels.update(re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", matchers))
    expr = re.sub(r"\{[^}]*\}|\[[^\]]*\]", " ", expr)
    for match in _GROUPING.finditer(expr):
        labels.update(name.strip() for name in match.group(2).split(",") if name.strip())
    expr = _GROUPING.sub(" ", expr)
    metrics = set()
    for match in re.finditer(r"(?<![\w.])([A-Za-z_:][\w:]*)(\s*\()?", expr):
        word, call = match.group(1), match.group(2)
        if call:
            assert word in PROMQL_FUNCTIONS, f"{word!r} is not one of the functions the examples may use: {expr}"
        elif word not in PROMQL_KEYWORDS:
            metrics.add(word)
    return Names(frozenset(metrics), frozenset(labels))


def exported(metrics: str) -> dict[str, set[str]]:
    """Every sample name on a ``/metrics`` page, with the label names its samples carry."""
    found: dict[str, set[str]] = {}
    for line in metrics.splitlines():
        match = re.match(r"^([A-Za-z_:][\w:]*)(?:\{(.*)\})? \S+", line)
        if match:
            found.setdefault(match.group(1), set()).update(re.findall(r'(\w+)="', match.group(2) or ""))
    return found


def dashboard_expressions() -> list[str]:
    dashboard = json.loads((EXAMPLES / "grafana-dashboard.json").read_text())
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", ())]
    exprs += [v["query"]["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    return exprs


def alert_rules() -> list[dict[str, Any]]:
    return [rule for group in yaml.safe_load((EXAMPLES / "prometheus-alerts.yml").read_text())["groups"]
            for rule in group["rules"]]


def test_promql_names_reads_metrics_and_labels_apart() -> None:
    names = promql_names('histogram_quantile(0.99, sum by (model_name, le) (rate(vllm:a_bucket{cause="x", '
                         'model_name=~"$model_name"}[$__rate_interval]))) / on (le) vllm:b > 1 and c_total == 0')
    assert names == Names(frozenset({"vllm:a_bucket", "vllm:b", "c_total"}), frozenset({"model_name", "le", "cause"}))
    assert promql_names("label_values(vllm:x_total, model_name)") == Names(frozenset({"vllm:x_total"}),
                                                                         frozenset({"model_name"}))
    with pytest.raises(AssertionError, match="'avg_over_time' is not one of"):
        promql_names("avg_over_time(vllm:x[5m])")


def test_the_dashboard_and_the_alerts_are_what_grafana_and_prometheus_load() -> None:
    dashboard = json.loads((EXAMPLES / "grafana-dashboard.json").read_text())
    panels = dashboard["panels"]
    assert sorted(p["id"] for p in panels) == list(range(1, len(panels) + 1))
    for panel in panels:
        if panel["type"] != "row":
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"} and panel["targets"]
            assert [t["refId"] for t in panel["targets"]] == [chr(ord("A") + i) for i in range(len(panel["targets"]))]
    rules = alert_rules()
    assert len({rule["alert"] for rule in rules}) == len(rules)
    for rule in rules:
        assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}, rule["alert"]
        assert rule["labels"]["severity"] in {"info", "warning", "critical"}
        assert set(rule["annotations"]) == {"summary", "description"}
        # An annotation can name only labels the expression keeps.
        used = set(re.findall(r"\$labels\.(\w+)", json.dumps(rule["annotations"])))
        kept = set().union(*(set(m.group(2).replace(" ", "").split(",")) for m in _GROUPING.finditer(rule["expr"])))
        assert used <= kept, rule["alert"]


@pytest.mark.slow
@pytest.mark.parametrize("source", ["dashboard", "alerts"])
def test_every_expression_names_families_and_labels_the_servers_export(served: Served, source: str) -> None:
    """Against the Redis example's cold server (it stored) and warm one (it loaded): a family by KV-cache group or
    tier appears once it moved a byte. LMCache's own ``lmcache:`` families are not there: they live in the engine
    core's process, and ``vllm serve`` with one API server exports the API server's registry only."""
    families = exported(served.metrics["cold"] + served.metrics["warm"])
    assert any(name.startswith(PREFIX) for name in families)
    assert [name for name in families if name.startswith("lmcache:")] == []
    exprs = dashboard_expressions() if source == "dashboard" else [rule["expr"] for rule in alert_rules()]
    for expr in exprs:
        names = promql_names(expr)
        assert names.metrics and names.metrics <= set(families), (sorted(names.metrics - set(families)), expr)
        carried = set().union(*(families[name] for name in names.metrics))
        assert names.labels <= carried, (sorted(names.labels - carried), expr)
