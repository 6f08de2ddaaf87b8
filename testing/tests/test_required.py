"""testing.required: a missing shipped input fails under bazel test, skips in plain pytest."""

import pytest

from testing import required


def test_missing_fails_where_inputs_are_required_and_skips_elsewhere(monkeypatch) -> None:
    monkeypatch.setenv(required.REQUIRED_ENV, "1")
    with pytest.raises(pytest.fail.Exception, match="GOLDENS_REQUIRED=1: a shipped input"):
        required.missing("SmolLM2 not available")
    monkeypatch.delenv(required.REQUIRED_ENV)
    with pytest.raises(pytest.skip.Exception, match="SmolLM2 not available"):
        required.missing("SmolLM2 not available")
