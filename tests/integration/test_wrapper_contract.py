"""Every connector class that wraps the impl name we replace calls our impl the way it expects upstream's.

Read from the wrappers' source as installed (vLLM 0.32's ``LMCacheConnectorV1``, vLLM 0.23's from
``.venv/vllm023``, LMCache's ``LMCacheConnectorV1Dynamic`` and its vLLM 0.8.5 variant): each
``self._lmcache_engine.<method>(...)`` call must bind to our impl's signature, and a method whose result the
wrapper wraps in a tuple must return a count, not a tuple. A release that changes a wrapper fails here first.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import typing
from dataclasses import dataclass
from pathlib import Path

import pytest

import lmcache_platforms
from lmcache_platforms.integration.vllm.wrapper_contract import contract_of
from tests.ci import missing

REPO = Path(__file__).resolve().parents[2]
VLLM023 = REPO / ".venv" / "vllm023"


def _source(module: str) -> Path:
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin is not None, module
    return Path(spec.origin)


def _wrappers() -> dict[str, Path]:
    found = {
        "vllm LMCacheConnectorV1": _source("vllm.distributed.kv_transfer.kv_connector.v1.lmcache_connector"),
        "lmcache LMCacheConnectorV1Dynamic": _source("lmcache.integration.vllm.lmcache_connector_v1"),
        "lmcache LMCacheConnectorV1Dynamic (vLLM 0.8.5)": _source("lmcache.integration.vllm.lmcache_connector_v1_085"),
    }
    old = VLLM023 / "vllm/distributed/kv_transfer/kv_connector/v1/lmcache_connector.py"
    if old.is_file():
        found["vllm 0.23 LMCacheConnectorV1"] = old
    return found


@dataclass(frozen=True)
class ImplCall:
    wrapper_method: str
    method: str
    positional: int
    keywords: tuple[str, ...]
    star_kwargs: bool
    wrapped_in_tuple: bool


def impl_calls(path: Path) -> list[ImplCall]:
    """Every ``self._lmcache_engine.<m>(...)`` in the wrapper classes of ``path``."""
    calls = []
    for cls in (n for n in ast.parse(path.read_text()).body if isinstance(n, ast.ClassDef)):
        for func in (n for n in cls.body if isinstance(n, ast.FunctionDef)):
            tuple_items = {id(e) for node in ast.walk(func) if isinstance(node, ast.Tuple) for e in node.elts}
            for node in ast.walk(func):
                target = node.func if isinstance(node, ast.Call) else None
                if (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Attribute)
                        and target.value.attr == "_lmcache_engine"):
                    assert isinstance(node, ast.Call)
                    calls.append(ImplCall(
                        func.name, target.attr, len(node.args),
                        tuple(k.arg for k in node.keywords if k.arg is not None),
                        any(k.arg is None for k in node.keywords), id(node) in tuple_items))
    return calls


def _returns(method: typing.Any) -> str:
    """The declared return type as written (upstream's names exist only under TYPE_CHECKING)."""
    returned = inspect.signature(method).return_annotation
    assert returned is not inspect.Signature.empty, f"{method.__qualname__} declares no return type"
    return str(returned).replace(" ", "")


def _impl_class() -> type:
    lmcache_platforms.ensure_patched()
    from lmcache_platforms.integration.vllm.engine_impl import MultiGroupConnectorImpl

    return MultiGroupConnectorImpl


@pytest.mark.parametrize("name", ["vllm LMCacheConnectorV1", "lmcache LMCacheConnectorV1Dynamic",
                                  "lmcache LMCacheConnectorV1Dynamic (vLLM 0.8.5)", "vllm 0.23 LMCacheConnectorV1"])
def test_every_call_a_wrapper_makes_binds_to_our_impl(name: str) -> None:
    wrappers = _wrappers()
    if name not in wrappers:
        missing(f"vLLM 0.23 is not installed in {VLLM023} (make setup installs it)")
    impl = _impl_class()
    calls = impl_calls(wrappers[name])
    assert {c.method for c in calls} >= {"get_num_new_matched_tokens", "update_state_after_alloc",
                                        "build_connector_meta", "start_load_kv", "wait_for_save"}
    for call in calls:
        method = getattr(impl, call.method, None)
        assert callable(method), f"{name}.{call.wrapper_method} calls impl.{call.method}, which our impl lacks"
        args = [object()] * call.positional
        kwargs = {k: object() for k in call.keywords}
        if call.star_kwargs:
            kwargs["some_future_kwarg"] = object()
        inspect.signature(method).bind(object(), *args, **kwargs)  # self first: raises TypeError on a mismatch
        if call.wrapped_in_tuple:
            returned = _returns(method)
            assert not returned.startswith("tuple"), (
                f"{name}.{call.wrapper_method} wraps impl.{call.method}'s result in a tuple; ours returns {returned}")


def test_the_call_check_catches_a_wrong_signature_and_a_tuple_return() -> None:
    """Negative control: our own connector's calls (blocks passed, a tuple returned) fail upstream's methods, and
    the parser sees vLLM's wrapper adding ``False`` to the count (what the tuple-returning impl broke)."""
    impl = _impl_class()
    matched = [c for c in impl_calls(_wrappers()["vllm LMCacheConnectorV1"])
               if c.method == "get_num_new_matched_tokens"]
    assert [(c.positional, c.wrapped_in_tuple) for c in matched] == [(2, True)]
    with pytest.raises(TypeError):
        inspect.signature(impl.update_state_after_alloc).bind(object(), object(), object(), object())
    assert _returns(impl.match).startswith("tuple")


def test_the_wrapper_class_decides_the_contract() -> None:
    from lmcache.integration.vllm.lmcache_connector_v1 import LMCacheConnectorV1Dynamic
    from vllm.distributed.kv_transfer.kv_connector.v1.lmcache_connector import LMCacheConnectorV1

    from lmcache_platforms.integration.vllm.connector import LMCachePlatformsConnector

    def bare(cls: type) -> object:
        return cls.__new__(cls)

    class DeploymentsOwn(LMCacheConnectorV1):
        pass

    class OursSubclassed(LMCachePlatformsConnector):
        pass

    assert [contract_of(bare(c)).loads_wait for c in (LMCacheConnectorV1, LMCacheConnectorV1Dynamic, DeploymentsOwn,
                                                      LMCachePlatformsConnector, OursSubclassed)] == [
        False, False, False, True, True]
    upstream = contract_of(bare(LMCacheConnectorV1))
    assert upstream.refuses(multi_group=False) is None
    assert upstream.refuses(multi_group=True) == (
        "LMCacheConnectorV1 loads a hit in the step that computes it, where a failed load of a model with several "
        "KV-cache groups cannot be reported; serve it with LMCachePlatformsConnector")
    assert contract_of(bare(LMCachePlatformsConnector)).refuses(multi_group=True) is None
    assert "platforms.load_mode=async is ignored" in (upstream.switched_off("async") or "")
    assert contract_of(bare(LMCachePlatformsConnector)).switched_off("async") is None
