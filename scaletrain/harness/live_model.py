"""The live model as an lm-evaluation-harness `LM`: lm-eval's own Hugging Face model (HFLM: its tokenization,
batching, scoring and generation, unchanged) over the engine's module, with the requests split over the data-parallel
ranks (lm-eval deals each rank every world_size-th document and gathers the metrics on rank 0 through this class's
all_gather, gather_object and barrier, on the run's process group).

Under ZeRO-3 with several ranks every forward is a collective (each layer's weights are all-gathered), but the ranks
need not run as many forwards as each other: lm-eval merges requests that share a context, pads a rank's rolling
windows, and greedy generation stops when a rank's batch is done. ForwardLockstep makes them meet: before each forward
every rank says in one all-reduce whether it is working, and a rank whose requests are done keeps answering, with a
one-token forward of its own, until no rank is working (the idea of torch's Join context for uneven inputs).
"""

from __future__ import annotations

from collections.abc import Callable


def engine_lm(
    module,
    tokenizer,
    batch_size: int,
    *,
    rank: int = 0,
    world_size: int = 1,
    lockstep: bool = False,
    progress: Callable[[str], None] | None = None,
):
    """An lm-eval LM (HFLM) over `module` (which stays where it is: no copy, no move) for this rank of `world_size`
    data-parallel ranks; `lockstep` under ZeRO-3 with several ranks; `progress` hears of each forward."""
    from scaletrain.harness.hflm import EngineLM

    return EngineLM(
        module,
        tokenizer=tokenizer,
        batch_size=batch_size,
        rank=rank,
        world_size=world_size,
        lockstep=lockstep,
        progress=progress,
    )
