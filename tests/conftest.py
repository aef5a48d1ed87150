"""Hypothesis profiles for the whole suite, loaded before any test module builds its ``settings``; and how the
suite is spread over pytest-xdist workers (``make test`` runs ``-n 2 --dist loadgroup``).

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


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Slow tests (real engines and servers) first, so that the workers finish together instead of one running
    the last server alone; and a module whose tests share a module-scoped fixture (an engine, a served run) kept
    on one worker (an ``xdist_group``), which builds the fixture once. Other tests spread one by one. Runs before
    xdist reads the groups."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        if info is not None and any(fixture.scope == "module" for fixtures in info.name2fixturedefs.values()
                                    for fixture in fixtures):
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::", 1)[0]))
