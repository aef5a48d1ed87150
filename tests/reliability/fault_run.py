"""Fault scenarios on ONE real in-process vLLM engine (tiny hybrid model, our connector, a real LMCache backend).

``python -m tests.reliability.fault_run SPEC.json`` prints one JSON line: per scenario, the cold pass's and the
warm pass's answers, what LMCache and our connector logged at WARNING or above from the warm pass on (a chunk
buffer leaked meanwhile included: the scenario ends with a collection), the connector's chunk counters and
vLLM's LMCache hit tokens. One engine serves several scenarios (each on its own
prompt) because starting engines is what costs time; the fault is planted between a cold pass (stores) and a
warm pass (loads) of the same prompt. Without a connector (``connector: null``) it only answers every prompt,
the reference the tests compare with.

SPEC: ``model``, ``connector`` (``kv_connector_extra_config`` or null), ``policy`` (``kv_load_failure_policy``),
``store`` (what the faults act on: ``{"kind": "redis", "binary": ..., "dir": ...}``, ``{"kind": "disk"|"fs",
"dir": ...}`` or ``{"kind": "cpu"}``), ``scenarios`` (``[{"name", "fault", "chunk", "others", "warm_others",
"again"}]``, see ``Run.scenario``), ``single_group`` (vLLM's hybrid KV-cache manager off: one group, loads in
the step that computes the request) and, for the reference, ``prompts`` (names). The kernel faults switch the
test's faulty backend (``tests/faults``) through ``LMCACHE_PLATFORMS_FAULT``, read at every transfer.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import random
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import lmcache_platforms  # noqa: F401 - activation, as the vllm.general_plugins entry point does
from lmcache_platforms.tools.redis_server import RedisServer

PROMPT_TOKENS = 300
CHUNK = 64
MAX_TOKENS = 8
VOCAB = 2048
FAULT_ENV = "LMCACHE_PLATFORMS_FAULT"


def prompt(name: str) -> list[int]:
    """A scenario's own prompt: its chunks share nothing with another scenario's. A name ending in ``/N`` has
    N tokens (e.g. one whole chunk), others ``PROMPT_TOKENS``."""
    length = int(name.rsplit("/", 1)[1]) if "/" in name else PROMPT_TOKENS
    rng = random.Random(name)
    return [rng.randrange(1, VOCAB) for _ in range(length)]


class Captured(logging.Handler):
    """WARNING-and-above records of LMCache's and our loggers (each LMCache module has its own handler and does
    not propagate, so the handler goes on every one of them)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []
        self.attached: list[logging.Logger] = []
        # Our loggers propagate to their parents, which are attached too: one line per record. The records are
        # kept, so that an id is never reused by a later record.
        self._seen: dict[int, logging.LogRecord] = {}

    def emit(self, record: logging.LogRecord) -> None:
        if id(record) in self._seen:
            return
        self._seen[id(record)] = record
        self.lines.append(f"{record.levelname} {record.name}: {record.getMessage()}")

    def __enter__(self) -> Captured:
        names = [n for n in logging.root.manager.loggerDict if n.split(".")[0] in {"lmcache", "lmcache_platforms"}]
        for name in names:
            logger = logging.getLogger(name)
            logger.addHandler(self)
            self.attached.append(logger)
        return self

    def __exit__(self, *_exc: object) -> None:
        for logger in self.attached:
            logger.removeHandler(self)


def redis_client(server: RedisServer) -> Any:
    import redis

    return redis.Redis(host="127.0.0.1", port=server.port, socket_timeout=2)


class Run:
    """The engine and the store the faults act on."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.redis: RedisServer | None = None
        store = spec.get("store") or {"kind": "none"}
        self.store = store
        extra = dict(spec["connector"] or {})
        if store["kind"] == "redis":
            self.redis = RedisServer(store["dir"], store["binary"])
            self.redis.start()
            extra["lmcache.remote_url"] = self.redis.url
        self.llm = self._engine(spec["model"], extra if spec["connector"] is not None else None, spec["policy"],
                                bool(spec.get("single_group")))

    @staticmethod
    def _engine(model: str, extra: dict[str, Any] | None, policy: str, single_group: bool) -> Any:
        from vllm import LLM

        args: dict[str, Any] = {}
        if extra is not None:
            args["kv_transfer_config"] = {"kv_connector": "LMCachePlatformsConnector", "kv_role": "kv_both",
                                          "kv_load_failure_policy": policy, "kv_connector_extra_config": extra}
        return LLM(model=model, skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16", block_size=32,
                   max_model_len=1024, max_num_batched_tokens=1024, enable_prefix_caching=False, seed=0,
                   disable_log_stats=False, disable_hybrid_kv_cache_manager=single_group, **args)

    # ---------------------------------------------------------------- engine views

    @property
    def impl(self) -> Any:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        return get_kv_transfer_group().impl

    def counters(self) -> dict[str, int]:
        counters = self.impl.lmcache_engine.gpu_connector.binding.counters
        return {"chunks_stored": counters.chunks_stored, "chunks_loaded": counters.chunks_loaded,
                "layers_loaded": counters.layers_loaded}

    def lmcache_hits(self) -> int:
        return sum(int(m.value) for m in self.llm.get_metrics() if m.name == "vllm:external_prefix_cache_hits")

    def chunk_keys(self, name: str) -> list[Any]:
        """LMCache's keys of a prompt's whole chunks, tagged as our connector tags every store and load of a
        request without adapter or salt (of the full-attention part, which every hit needs, when chunks are
        stored in parts)."""
        from lmcache_platforms.connector.instance_adapter import with_tags
        from lmcache_platforms.connector.parts import part_configs
        from lmcache_platforms.integration.vllm.request_scope import SCOPE_TAG, request_scope

        impl = self.impl
        tokens = prompt(name)
        tokens = tokens[: len(tokens) // CHUNK * CHUNK]
        configs = with_tags({SCOPE_TAG: request_scope(None, None)}, impl._key_tags)
        parts = impl.lmcache_engine.gpu_connector.parts
        if parts:
            configs = part_configs(configs, parts[0])
        return [key for _, _, key in impl.lmcache_engine.token_database.process_tokens(
            tokens=tokens, request_configs=configs)]

    def generate(self, names: list[str]) -> list[dict[str, Any]]:
        """Greedy answers, in order; a request vLLM ended with an error keeps its finish reason."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, seed=0)
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=prompt(n)) for n in names], params,
                                    use_tqdm=False)
        return [{"name": n, "tokens": list(o.outputs[0].token_ids), "finish_reason": o.outputs[0].finish_reason,
                 "num_cached_tokens": o.num_cached_tokens} for n, o in zip(names, outputs, strict=True)]

    def drain(self) -> None:
        """The cold pass's writes have landed in the store (LMCache writes to disk and remotes asynchronously)."""
        from lmcache_platforms.integration.vllm.pending_writes import drain_writes

        drain_writes(self.impl.lmcache_engine, timeout_s=30)

    # ---------------------------------------------------------------- faults

    def plant(self, fault: str, name: str, chunk: int) -> Callable[[], None]:
        """Damage chunk ``chunk`` of ``name`` in the store (or arm a kernel fault); returns the undo (or a no-op)."""
        key = self.chunk_keys(name)[chunk]
        if fault == "none":
            return lambda: None
        if fault in {"raise", "zero"}:
            os.environ[FAULT_ENV] = fault
            return lambda: os.environ.__setitem__(FAULT_ENV, "none")
        if fault == "redis_stop":
            assert self.redis is not None
            self.redis.stop()
            return self.redis.start
        if self.redis is not None:
            client = redis_client(self.redis)
            name_of = {"metadata": key.to_string() + "metadata", "kv_bytes": key.to_string() + "kv_bytes"}
            if fault == "redis_shape":
                self.reshape(client, name_of["metadata"], name_of["kv_bytes"])
                return lambda: None
            part, how = fault.removeprefix("redis_").rsplit("_", 1)
            value = client.get(name_of[part])
            assert value is not None, f"{name_of[part]} not in Redis"
            client.set(name_of[part], damaged(value, how))
            return lambda: None
        path = self.chunk_path(key)
        assert path.is_file(), f"{path} is not in the store: {sorted(os.listdir(path.parent))[:8]}"
        if fault == "file_delete":
            path.unlink()
        elif fault == "file_truncate":
            data = path.read_bytes()
            path.write_bytes(data[: len(data) // 2])
        else:
            raise ValueError(f"unknown fault {fault!r}")
        return lambda: None

    @staticmethod
    def reshape(client: Any, metadata_key: str, kv_key: str) -> None:
        """Rewrite a chunk as a well-formed object of half its size: LMCache reads it back as a valid hit of the
        wrong size (what a chunk stored by another layout, or garbage that happens to parse, looks like)."""
        import torch
        from lmcache.v1.protocol import RemoteMetadata

        meta = RemoteMetadata.deserialize(client.get(metadata_key))
        shape = torch.Size([*meta.shapes[0][:-1], meta.shapes[0][-1] // 2])
        length = shape.numel() * meta.dtypes[0].itemsize
        half = RemoteMetadata(length, [shape], meta.dtypes, meta.fmt)
        client.set(kv_key, client.get(kv_key)[: half.length])
        client.set(metadata_key, half.serialize())

    def chunk_path(self, key: Any) -> Path:
        """Where the disk backend or the fs connector keeps a chunk (their own naming)."""
        directory = Path(self.store["dir"])
        if self.store["kind"] == "disk":
            return directory / (key.to_string().replace("/", "-") + ".pt")
        return directory / (key.to_string().replace("/", "-SEP-") + ".data")

    # ---------------------------------------------------------------- scenarios

    def scenario(self, item: dict[str, Any]) -> dict[str, Any]:
        """Cold pass of ``name`` (with ``others`` in the same batch), the fault, then the warm pass (with
        ``warm_others`` too), then ``again`` more passes of ``name`` alone."""
        name, others = item["name"], item.get("others", [])
        before = self.counters()
        cold = self.generate([name, *others])
        cold_stored = self.counters()["chunks_stored"] - before["chunks_stored"]
        self.drain()
        undo = self.plant(item["fault"], name, item.get("chunk", 0))
        hits, counters = self.lmcache_hits(), self.counters()
        failures = dict(self.impl.stats.totals)
        with Captured() as captured:
            try:
                warm = self.generate([name, *others, *item.get("warm_others", [])])
            finally:
                undo()
            after = self.counters()
            result = {
                "cold": cold, "cold_chunks_stored": cold_stored, "warm": warm, "log": captured.lines,
                "lmcache_hit_tokens": self.lmcache_hits() - hits,
                "chunks_loaded": after["chunks_loaded"] - counters["chunks_loaded"],
                "layers_loaded": after["layers_loaded"] - counters["layers_loaded"],
                "chunks_stored": after["chunks_stored"] - counters["chunks_stored"], "again": [],
                # The connector statistics' failed loads of the warm pass, by cause (only causes counted).
                "failed_causes": {name.removeprefix("failed_"): count - failures[name]
                                  for name, count in self.impl.stats.totals.items()
                                  if name.startswith("failed_") and count > failures[name]},
            }
            for _ in range(item.get("again", 0)):
                # The same prompt again: stored anew by the recomputation (or once the store is back).
                self.drain()
                hits, counters = self.lmcache_hits(), self.counters()
                (answer,) = self.generate([name])
                result["again"].append({**answer, "lmcache_hit_tokens": self.lmcache_hits() - hits,
                                        "chunks_loaded": self.counters()["chunks_loaded"] - counters["chunks_loaded"]})
            gc.collect()  # a chunk buffer these passes leaked is reported (by LMCache, when collected) here
        return result

    def close(self) -> None:
        self.llm.llm_engine.engine_core.shutdown()
        if self.redis is not None:
            self.redis.stop()


def damaged(value: bytes, how: str) -> bytes:
    """A Redis value cut to half its length, or replaced by as many random bytes."""
    if how == "truncate":
        return value[: len(value) // 2]
    if how == "garbage":
        return random.Random(len(value)).randbytes(len(value))
    raise ValueError(f"unknown damage {how!r}")


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[0]).read_text())
    os.environ.setdefault(FAULT_ENV, "none")
    run = Run(spec)
    try:
        if spec["connector"] is None:
            answers = run.generate(spec["prompts"])
            result: dict[str, Any] = {"reference": {a["name"]: a["tokens"] for a in answers}}
        else:
            result = {"scenarios": {item["name"]: run.scenario(item) for item in spec["scenarios"]},
                      "groups": run.impl.plan.describe()}
    finally:
        run.close()
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
