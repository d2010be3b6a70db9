"""Preference pairs for tests, in TRL's three formats, written as local JSON-lines files: arithmetic questions whose
chosen answer is right and rejected answer wrong, with prompts and completions of varied lengths (so padding, the
loss normaliser and per-token averages are all exercised)."""

from __future__ import annotations

import json
import random
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CHAT_TEMPLATE = REPO / "tests" / "fixtures" / "chat_templates" / "qwen2.5-instruct.jinja"


def _pairs(n: int, seed: int) -> list:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        a, b = rng.randint(1, 60), rng.randint(1, 60)
        pad = " please" * rng.randint(0, 6)
        prompt = f"Question {i}: what is {a} plus {b}?{pad} Answer:"
        right = f" {a + b}." + " I added the two numbers." * rng.randint(0, 3)
        wrong = f" {a + b + rng.randint(1, 9)}." + " I am not sure." * rng.randint(0, 2)
        out.append((prompt, right, wrong))
    return out


def _write(path: Path, rows: list) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def explicit_text(path: Path, n: int = 48, seed: int = 0) -> Path:
    """prompt / chosen / rejected as plain text (TRL's standard explicit-prompt format)."""
    return _write(path, [{"prompt": p, "chosen": c, "rejected": r} for p, c, r in _pairs(n, seed)])


def explicit_conversational(path: Path, n: int = 48, seed: int = 0) -> Path:
    """prompt / chosen / rejected as message lists."""
    rows = [
        {
            "prompt": [{"role": "user", "content": p}],
            "chosen": [{"role": "assistant", "content": c.strip()}],
            "rejected": [{"role": "assistant", "content": r.strip()}],
        }
        for p, c, r in _pairs(n, seed)
    ]
    return _write(path, rows)


def implicit_conversational(path: Path, n: int = 48, seed: int = 0) -> Path:
    """chosen / rejected conversations that share their prompt turns (no prompt column)."""
    rows = []
    for p, c, r in _pairs(n, seed):
        prompt = [{"role": "user", "content": p}]
        rows.append(
            {
                "chosen": [*prompt, {"role": "assistant", "content": c.strip()}],
                "rejected": [*prompt, {"role": "assistant", "content": r.strip()}],
            }
        )
    return _write(path, rows)
