"""What the config tests share: flags name ds_configs/, data/ and recipes relative to the working directory, as a
user's command line in the repository does."""

import pytest

from tests.harness import REPO


@pytest.fixture
def in_repo(monkeypatch) -> None:
    """The test runs in the repository (its working directory restored after)."""
    monkeypatch.chdir(REPO)
