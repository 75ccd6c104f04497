"""The helper that turns skips into failures where CI says every integration test must run."""

from __future__ import annotations

import pytest
from _require import REQUIRE_ENV, require_module, require_or_skip


@pytest.mark.parametrize("value", [None, "", "0", " 0 "])
def test_skips_when_not_required(monkeypatch: pytest.MonkeyPatch, value: str | None) -> None:
    if value is None:
        monkeypatch.delenv(REQUIRE_ENV, raising=False)
    else:
        monkeypatch.setenv(REQUIRE_ENV, value)
    with pytest.raises(pytest.skip.Exception, match="^no frobnicator$"):
        require_or_skip("no frobnicator")
    with pytest.raises(pytest.skip.Exception, match="no_such_module_xyz is not installed"):
        require_module("no_such_module_xyz")


@pytest.mark.parametrize("value", ["1", "yes"])
def test_fails_when_required(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(REQUIRE_ENV, value)
    with pytest.raises(pytest.fail.Exception, match=r"^no frobnicator \(COPYTRACE_REQUIRE"):
        require_or_skip("no frobnicator")
    with pytest.raises(pytest.fail.Exception, match="no_such_module_xyz is not installed"):
        require_module("no_such_module_xyz")
    assert require_module("json").dumps([]) == "[]"  # an installed module is returned
