"""What the vLLM connector class wrapping our engine impl carries between vLLM and it.

Our impl replaces LMCache's ``LMCacheConnectorV1Impl``, so every connector class built on that name runs it:
vLLM's ``LMCacheConnectorV1`` (0.23 and 0.32+), LMCache's ``LMCacheConnectorV1Dynamic`` (and its vLLM 0.8.5
variant), a deployment's subclass of any of them, and our ``LMCachePlatformsConnector``. The upstream wrappers
call the impl's upstream-named methods under upstream's contract: ``get_num_new_matched_tokens`` returns a count
(the wrapper itself adds ``False``: the load runs in the step that computes the request) and
``update_state_after_alloc(request, num_external_tokens)`` gets no blocks. So a load cannot wait for its request
under them, and a model with several saved KV-cache groups cannot be told apart from a failed load (vLLM takes
block-level load errors only for one group). Ours calls ``match`` and ``after_alloc``, which carry both.

The contract is read from the wrapper's class: ours declares ``CARRIES_WAITING_LOADS``; any class without it
(whatever its vLLM or LMCache version) gets upstream's.
"""

from __future__ import annotations

from dataclasses import dataclass

CONTRACT_MARKER = "CARRIES_WAITING_LOADS"
HMA_CONNECTOR = "LMCachePlatformsConnector"


@dataclass(frozen=True)
class WrapperContract:
    """``loads_wait``: the wrapper passes ``(n, True)`` on to vLLM and the request's blocks to the impl, so a hit
    may load while its request waits and a failed load is reported for that request alone."""

    wrapper: str
    loads_wait: bool

    def refuses(self, multi_group: bool) -> str | None:
        """Why no hit may be claimed under this wrapper (None: hits are fine)."""
        if multi_group and not self.loads_wait:
            return (f"{self.wrapper} loads a hit in the step that computes it, where a failed load of a model with "
                    f"several KV-cache groups cannot be reported; serve it with {HMA_CONNECTOR}")
        return None

    def switched_off(self, load_mode: str) -> str | None:
        """The one start-up line for an upstream wrapper: what it cannot carry (None under ours)."""
        if self.loads_wait:
            return None
        wanted = " (platforms.load_mode=async is ignored)" if load_mode == "async" else ""
        return (f"LMCache engine impl wrapped by {self.wrapper}: hits load in the step that computes them{wanted} "
                f"and only single-group models get hits; {HMA_CONNECTOR} loads while requests wait, reports a "
                "failed load per request and serves hybrid (HMA) models")


def contract_of(wrapper: object) -> WrapperContract:
    """The contract of the connector instance that built the impl (its class decides)."""
    cls = type(wrapper)
    return WrapperContract(wrapper=cls.__name__, loads_wait=bool(getattr(cls, CONTRACT_MARKER, False)))
