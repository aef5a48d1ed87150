"""Hypothesis profiles for the whole suite, loaded before any test module builds its ``settings``; and how the
suite is spread over pytest-xdist workers (``make test`` runs ``-n 2 --no-loadscope-reorder``).

``ci`` (the default, what ``make test`` runs) is derandomized: every run draws the same examples, so a
failure in CI reproduces on any machine with the same code and the same Hypothesis, and no example
database carries state between runs. ``dev`` keeps Hypothesis' random exploration (and its local
database) to hunt for new counterexamples; ``thorough`` is ``dev`` with ten times the examples. Choose
with ``HYPOTHESIS_PROFILE=ci|dev|thorough``.

The core properties (real-engine round trips of random layouts, the scheduler model, the connector's
stream order) take their example count from the profile, at least ``CORE_EXAMPLES`` in every one; tests
that name ``max_examples`` themselves keep their own count.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

PROFILE_ENV = "HYPOTHESIS_PROFILE"
CORE_EXAMPLES = 100

settings.register_profile(
    "ci",
    derandomize=True,
    database=None,
    deadline=None,
    max_examples=CORE_EXAMPLES,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", deadline=None, max_examples=CORE_EXAMPLES, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("thorough", parent=settings.get_profile("dev"), max_examples=10 * CORE_EXAMPLES)
settings.load_profile(os.environ.get(PROFILE_ENV, "ci"))


# Modules whose tests share no module-scoped fixture and each start their own servers or fork-server children:
# spread test by test over the workers. Every other module runs whole on one worker, which builds its
# module-scoped fixtures (engines, served runs) once.
SPREAD_MODULES = {"tests/serving/test_upstream_names.py", "tests/test_import_orders.py"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Slow tests (real engines and servers) first, so that the workers finish together instead of one running
    the last server alone (``make test`` keeps this order: ``--no-loadscope-reorder``)."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """pytest-xdist's scope scheduling with modules as scopes, but for ``SPREAD_MODULES``. (Its ``loadgroup``
    marks do nothing under pytest 9: xdist 3.8 renames the items' ``_nodeid``, which pytest 9 no longer reads.)"""
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return nodeid if module in SPREAD_MODULES else module

    return ModuleScheduling(config, log)
