"""The misuse probe (issue 46, item 7): every case of tests/_misuse_cases.py, each in isolation, classified by
tests/misuse_probe.py as clear / legit / vague / silent / hang / abort (/ refused_legit / n/a).

Every case must be ``clear`` (refused, naming the parameter or setting and what to do) or ``legit``
(accepted, and its result checked), except those in :data:`KNOWN_OPEN`, which fail today. A listed case
that passes fails the test too: remove its entry when its fix lands. The tally is printed (``-s``) and
written to ``misuse_probe/tally.json`` in pytest's temporary directory. The same probe from the command
line, with each remaining case's message: ``python -m tests.misuse_probe``.
"""

from __future__ import annotations

import json
import time

import pytest

from tests._misuse_cases import CASES
from tests.misuse_probe import GOOD, report, run_from_the_suite, tally

pytestmark = pytest.mark.multiprocess

#: the cases that fail today, and why (one line each: remove the line when the fix lands)
KNOWN_OPEN: dict[str, str] = {}


def test_the_probe_has_enough_cases_of_every_kind() -> None:
    """At least 60 cases, at least 10 of them multi-process; the known-open names are cases."""
    assert len(CASES) >= 60 and sum(case.world > 1 for case in CASES) >= 10
    assert set(KNOWN_OPEN) <= {case.name for case in CASES}, set(KNOWN_OPEN) - {case.name for case in CASES}
    for case in CASES:
        assert case.expect in ("refused", "legit") and (case.phrases or case.expect == "legit"), case.name


@pytest.fixture(scope="module")
def probe(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    directory = tmp_path_factory.mktemp("misuse_probe")
    began = time.monotonic()
    results = run_from_the_suite(directory / "results.json")
    # Six jobs at once on two cores: a multi-process case can miss its timeout under that load alone (seen: a
    # 4-rank job still creating its gloo group after 40 s, a torchft quorum case after 20 s; each passed alone
    # in 3 of 3 reruns). A case that hung runs once more, alone: one that hangs again is a hang.
    hung = [name for name, result in results.items() if result.cls == "hang"]
    if hung:
        results.update(run_from_the_suite(directory / "retried.json", names=hung, parallel=1))
    seconds = time.monotonic() - began
    (directory / "tally.json").write_text(json.dumps({"seconds": round(seconds, 1), "tally": tally(results),
                                                      "retried alone": hung}))
    return results, seconds


def test_every_misuse_is_refused_clearly_or_works(probe) -> None:
    """No hang, no abort, no silent run, no vague message, but for :data:`KNOWN_OPEN`."""
    results, _ = probe
    unexpected = [result for name, result in results.items() if result.cls not in GOOD and name not in KNOWN_OPEN]
    fixed = [name for name in KNOWN_OPEN if results[name].cls in GOOD]
    lines = [f"[{r.cls}] {r.name}: {' '.join(r.message.split())[:400]}" for r in unexpected]
    lines += [f"[{results[name].cls}] {name}: fixed, remove it from KNOWN_OPEN" for name in fixed]
    assert not lines, "\n".join(lines)


def test_tally(probe) -> None:
    """The tally and every case not clear or legit (shown with ``-s``)."""
    results, seconds = probe
    print(f"\n{report(results)}\n(the probe took {seconds:.1f} s)")
    assert sum(tally(results).values()) == len(CASES)
