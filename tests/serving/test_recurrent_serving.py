"""The tiny random Qwen3-Next (GDN hybrid) under ``vllm serve`` at vLLM's default step budget, driven by a real
streaming client: a first server stores a 1,100-token prompt (vLLM keeps its state at 1,024 only), then answers a
1,400-token prompt extending it from its own prefix cache (1,024) and stores that prompt's state at 1,280 (its
last block boundary); a fresh server answers the 1,400-token prompt from LMCache (1,280 tokens) with the same
tokens and raw top-5 logits, bit for bit. The first server runs LMCache's layerwise mode (``LMCACHE_USE_LAYERWISE``:
each attention layer stored as the forward writes it, the GDN layers once it ends), the fresh one the default
paged mode: the chunks are the same objects. (In-process, vLLM's own hit is bit-identical to no cache at all:
``tests/integration/test_recurrent_e2e.py``.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from lmcache_platforms.tools.demo.client import Sampling, run_requests
from lmcache_platforms.tools.demo.runners import Resources
from lmcache_platforms.tools.demo.server import VllmServer
from lmcache_platforms.tools.demo.tokenizer import FIRST_WORD_ID, save_word_tokenizer, text_of
from tests.integration.recurrent_model import SPEC, ensure_tiny_qwen3_next

pytestmark = pytest.mark.slow

WORDS = SPEC["vocab_size"] - FIRST_WORD_ID
TURN_ONE = [FIRST_WORD_ID + (i * 37) % WORDS for i in range(1100)]
TURN_TWO = TURN_ONE + [FIRST_WORD_ID + (i * 11) % WORDS for i in range(300)]
ARGS = ["--max-model-len", "2048", "--enforce-eager", "--dtype", "bfloat16", "--seed", "0",
        "--logprobs-mode", "raw_logits", "--enable-prefix-caching", "--mamba-cache-mode", "align",
        "--disable-uvicorn-access-log"]


def test_a_fresh_server_answers_from_lmcache_at_the_kept_state(tmp_path: Path) -> None:
    model = ensure_tiny_qwen3_next(tmp_path / "model")
    save_word_tokenizer(model, SPEC["vocab_size"])
    config = tmp_path / "lmcache.yaml"
    config.write_text(f"chunk_size: 256\nlocal_cpu: true\nmax_local_cpu_size: 0.5\n"
                      f"remote_url: fs://localhost:0{tmp_path / 'store'}\nremote_serde: naive\n")
    (tmp_path / "store").mkdir()
    prompts = [("turn one", text_of(TURN_ONE), len(TURN_ONE)), ("turn two", text_of(TURN_TWO), len(TURN_TWO))]
    results = {}
    for name, requests, layerwise in (("first", prompts, "True"), ("fresh", prompts[1:], "False")):
        server = VllmServer.for_model(model, {"kv_connector": "LMCachePlatformsConnector", "kv_role": "kv_both"},
                                      ARGS, tmp_path / f"{name}.log", Resources.available(),
                                      {"LMCACHE_CONFIG_FILE": str(config), "LMCACHE_USE_LAYERWISE": layerwise})
        with server:
            results[name] = run_requests(server.base_url, requests, Sampling(max_tokens=8))
    first, fresh = results["first"], results["fresh"]
    log = (tmp_path / "first.log").read_text()
    assert "stored tokens [0, 1024) in LMCache" in log and "recurrent state at [1024], layer by layer" in log
    assert "stored tokens [1024, 1280) in LMCache" in log and "recurrent state at [1280], layer by layer" in log
    assert [(r["vllm_hit_tokens"], r["lmcache_hit_tokens"]) for r in first] == [(0, 0), (1024, 0)]
    assert [(r["vllm_hit_tokens"], r["lmcache_hit_tokens"]) for r in fresh] == [(0, 1280)]
    assert (fresh[0]["tokens"], fresh[0]["top_logits"]) == (first[1]["tokens"], first[1]["top_logits"])
