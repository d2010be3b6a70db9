"""The state of a run that changes as it trains, in one object that checkpoints save and restore."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class TrainState:
    step: int = 0  # optimizer updates done
    samples_seen: int = 0  # training blocks consumed, counted globally (the data position)
    tokens_seen: int = 0  # loss targets trained on, globally (padding excluded)
    skipped_steps: int = 0  # updates the engine skipped (fp16 overflow)

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, key, value)
