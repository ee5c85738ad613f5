"""The reasons catalogue (the docs' conditions reference) matches the reasons the code sets."""

import re
from pathlib import Path

from disagg_operator.condition_reasons import REASONS

SOURCE = Path(__file__).resolve().parents[2] / "operator" / "src" / "disagg_operator"
# The ways the operator writes a reason: a (status, reason) pair, a keyword or default, a
# TransferHealth verdict, a SpecWarning.
SET_REASON = re.compile(r'\("(?:True|False)", "(\w+)"|reason(?:: str)? ?= ?"(\w+)"|'
                        r'TransferHealth\((?:True|False), "(\w+)"|SpecWarning\("(\w+)"')


def _reasons_in_code() -> set[str]:
    found: set[str] = set()
    for path in SOURCE.glob("*.py"):
        if path.name != "condition_reasons.py":
            for match in SET_REASON.finditer(path.read_text()):
                found.add(next(group for group in match.groups() if group))
    return found


def test_every_reason_the_code_sets_is_catalogued_and_none_is_stale() -> None:
    catalogued = {r.name for r in REASONS}
    in_code = _reasons_in_code() - {"Transferring"}  # a healthy verdict: Degraded stays False
    assert in_code - catalogued == set(), "add these to condition_reasons.REASONS"
    assert catalogued - in_code == {"Conflict"}  # set through apply_error_reason="Conflict"
    assert len(catalogued) == len(REASONS)


def test_every_abnormal_reason_says_what_to_do() -> None:
    for reason in REASONS:
        abnormal = any(c in ("Ready=False", "Degraded=True", "ConfigWarning=True")
                       for c in reason.conditions)
        assert not abnormal or reason.action, reason.name
