"""The skip check (issue 46): a run of the whole suite (CI's ``make test``) fails when a test skips
that may not. A proof that skips itself proves nothing: without Ray every resident proof would
skip, without s3fs and moto the object-storage ones, without root the full-disk one. The
SIGKILL rows of the rotation's other groups (``tests/rotation.py``) skip by design; any other
skip must be listed in ``EXPECTED_SKIPS``, with the most it may have, in review.
``tests/conftest.py`` collects the skips and applies the check; ``RFT_SKIP_CHECK=1`` applies it
to a partial run too, ``RFT_SKIP_CHECK=0`` turns it off."""
from __future__ import annotations

from tests.rotation import SKIP_REASON

# reason prefix -> the most tests that may skip with it
EXPECTED_SKIPS = {"RFT_UPSTREAM not set": 9,  # tests/standins/test_upstream.py: make test-upstream
                  "this run rewrites tests/durations.txt": 2}  # tests/test_suite_time.py under make test-durations


def unexpected_skips(skips: list[tuple[str, str]], expected: dict[str, int] | None = None) -> list[str]:
    """``node id: reason`` of each skip in ``skips`` ((node id, reason) pairs) beyond the
    rotation's and ``expected``'s (reason prefix -> most allowed; default ``EXPECTED_SKIPS``)."""
    expected = EXPECTED_SKIPS if expected is None else expected
    seen = dict.fromkeys(expected, 0)
    bad = []
    for nodeid, reason in skips:
        if reason.startswith(SKIP_REASON):
            continue
        key = next((k for k in expected if reason.startswith(k)), None)
        if key is not None and seen[key] < expected[key]:
            seen[key] += 1
            continue
        bad.append(f"{nodeid}: {reason}")
    return bad
