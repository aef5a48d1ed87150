"""Which requests may share a chunk: exactly those whose blocks vLLM's own prefix cache would share.

vLLM's block hashes carry, besides the tokens, the request's LoRA adapter (name and path: the adapter changes
the KV wherever it touches k_proj/v_proj) and its ``cache_salt`` (tenants kept apart). LMCache's chunk keys
carry only tokens, so without this a request under an adapter loaded the base model's KV, and a salted
request loaded another tenant's. Every chunk key therefore gets one more tag, the request's *scope*: a hash of
adapter and salt. Only the scheduler sees a request's salt (vLLM's ``NewRequestData`` does not carry it), so
the scheduler computes the scope and sends it along: to the worker's lookup server inside the lookup's request
configs, and to the worker's stores and loads inside each request's step metadata.

The scope also carries the scheduler's *generation*: empty until vLLM resets its prefix cache through the
connector (``reset_cache``: weights updated, or ``/reset_prefix_cache?reset_external=true``), then a new random
value, so KV computed before the reset never hits again. Random, not a counter: the store may be shared with
other servers and outlive this one, whose generations must never coincide with ours. The workers need not be
told: they only ever use the scope the scheduler sent.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

SCOPE_TAG = "lmcache.tag.lmcp_scope"


def request_scope(lora_request: Any, cache_salt: str | None, generation: str = "") -> str:
    """The scope tag's value: equal exactly when vLLM's prefix cache would treat two requests' prefixes as one
    (its block hashes use the adapter's name and path, and a non-empty salt), within one ``generation``."""
    lora = None if lora_request is None else [lora_request.lora_name, lora_request.lora_path]
    identity = json.dumps([lora, cache_salt or None] + ([generation] if generation else []))
    return hashlib.sha256(identity.encode()).hexdigest()[:16]


def scoped_configs(request: Any, request_configs: Mapping[str, Any] | None, generation: str = "") -> dict[str, Any]:
    """A vLLM ``Request``'s LMCache request configs with its scope (ours wins: a request's own
    ``kv_transfer_params`` cannot name another tenant's scope)."""
    scope = request_scope(getattr(request, "lora_request", None), getattr(request, "cache_salt", None), generation)
    return {**(request_configs or {}), SCOPE_TAG: scope}
