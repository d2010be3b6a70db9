"""What the bad-input tests share: the DeepSpeed JSON they start from, a digest of a folder (to prove nothing was
written), a file writer, and the check that train.py's main refuses an input in one line that names its culprit.
tests/core/test_bad_input*.py use them; other wings' tests import tree_digest and assert_refused (also through
tests/core/test_bad_input.py)."""

from __future__ import annotations

import hashlib
import re
import traceback
from pathlib import Path

import pytest

from tests.harness import REPO

ZERO2 = REPO / "ds_configs" / "zero2.json"


def tree_digest(root: Path) -> str:
    h = hashlib.sha256()
    if root.exists():
        for path in sorted(root.rglob("*")):
            h.update(str(path.relative_to(root)).encode())
            if path.is_file():
                h.update(path.read_bytes())
    return h.hexdigest()


def text_file(tmp: Path, name: str, content: str) -> Path:
    path = tmp / name
    path.write_text(content)
    return path


def assert_refused(
    name: str, argv: list, out: Path, capsys, culprit: str, expected: str, hint: str | None = None
) -> None:
    """train.py's main on `argv` exits 2 with one error line naming `culprit` and holding `expected` (then the
    `hint` line, where given), no traceback, and `out` untouched."""
    from train import main

    before = tree_digest(out)
    try:
        code = main(argv)
    except BaseException:
        pytest.fail(f"{name}: raised instead of a clean error:\n{traceback.format_exc()}")
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, err
    assert 1 <= len(err) <= 2 and err[0].startswith("train.py: error: ") and expected in err[0], err
    assert names(culprit, err[0]), f"the error does not name {culprit}: {err[0]}"
    if hint is not None:
        assert err[1] == f"  hint: {hint}", err
    assert tree_digest(out) == before


def names(culprit: str, line: str) -> bool:
    """`culprit` appears in `line` as a whole flag or key: --config is not named by --config_name, nor
    zero_optimization.offload_optimizer by zero_optimization.offload_optimizer.device."""
    return re.search(rf"(?<![\w.-]){re.escape(culprit)}(?![\w.-])", line) is not None


def check_bad_input(name: str, case: tuple, tmp_path: Path, capsys) -> None:
    """train.py's main on one bad-input case `(make_flags, culprit, expected)`: exit code 2, one line (a hint line at
    most) naming the culprit, no traceback, and the output folder untouched."""
    from train import main

    make_flags, culprit, expected = case
    extra = make_flags(tmp_path)
    out = tmp_path / "out"
    before = tree_digest(out)
    try:
        code = main(["--config", str(ZERO2), "--output_dir", str(out), *extra])
    except BaseException:  # a traceback is a failure of this test, whatever the exit code would have been
        pytest.fail(f"{name}: raised instead of a clean error:\n{traceback.format_exc()}")
    captured = capsys.readouterr()
    assert code == 2, captured.out + captured.err
    lines = captured.err.strip().splitlines()
    assert 1 <= len(lines) <= 2 and lines[0].startswith("train.py: error: "), captured.err
    assert expected in lines[0], lines
    assert names(culprit, lines[0]), f"the error does not name {culprit}: {lines[0]}"
    if len(lines) == 2:
        assert lines[1].startswith("  hint: ")
    assert tree_digest(out) == before
