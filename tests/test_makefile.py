"""``make test`` prints the slowest tests, so a newcomer sees where the suite's time goes."""

from __future__ import annotations

import re
from pathlib import Path

MAKEFILE = Path(__file__).resolve().parents[1] / "Makefile"


def test_make_test_reports_the_15_slowest_tests() -> None:
    recipe = re.search(r"^test:.*\n((?:\t.*\n)+)", MAKEFILE.read_text(), re.M)
    assert recipe is not None, "no test target in the Makefile"
    pytest_line = next(line for line in recipe.group(1).splitlines() if "-m pytest" in line)
    assert "--durations=15" in pytest_line.split()
