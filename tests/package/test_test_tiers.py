"""The test tiers: ``pytest -m "not slow"`` is the quick subset. Slow tests carry the marker themselves
(``@pytest.mark.slow``, or ``pytestmark = pytest.mark.slow`` for a whole module), so a renamed test keeps
its tier."""


def test_the_slow_marker_is_registered(pytestconfig):
    assert any(line.startswith("slow:") for line in pytestconfig.getini("markers"))
