"""Ranks agree before they train together: each phase before training (pre-flight; resume conversion and token store)
ends in one collective carrying every rank's outcome and what it found on its own file system. A failure anywhere stops
every rank at once, rather than leaving the others in the next collective for 30 minutes; a fact that differs from
global rank 0's (resume checkpoint, tokenizer, run configuration, token store) stops every rank naming the rank, its
host and both values, since such ranks would diverge silently or hang.
"""

from __future__ import annotations

import socket
import sys
from collections.abc import Sequence

from scaletrain.distributed import world as distributed
from scaletrain.errors import PeerStopped, RanksDisagree, RunEnded
from scaletrain.parts import DistInfo, ResumePoint

# Commands that print and exit without a process group: scripts/train.sbatch runs `--print_config` as rank 0 of the
# job's world, alone, so a rank of such a command has nobody to wait for.
READ_ONLY_FLAGS = ("--print_config", "--plan")

HINTS = {
    "resume checkpoint": "every rank must see the same --output_dir (one shared folder at the same path); a file "
    "system that shows the nodes different listings for a while (NFS attribute caching) "
    "can do this: restart, or name the checkpoint with --resume_from_checkpoint",
    "tokenizer": "every node must load the same tokenizer (the same model folder, or the same --tokenizer_name)",
    "run configuration": "every node must run the same code and configs (the same checkout, recipe and DeepSpeed "
    "JSON; relative paths resolve in each node's working directory)",
    "token store": "every node must read the same data: the same files (or the same prepared --data_path)",
}


def joins_the_others(argv: Sequence[str] | None, dist: DistInfo) -> bool:
    """Whether a rank whose pre-flight failed joins the process group to tell the other ranks."""
    args = sys.argv[1:] if argv is None else argv
    return dist.world_size > 1 and not any(a.split("=")[0] in READ_ONLY_FLAGS for a in args)


def stop_with_the_others(err: RunEnded, dist: DistInfo, argv: Sequence[str] | None) -> RunEnded:
    """A rank whose pre-flight failed: join the rendezvous and share the failure, so that no rank waits there for it
    (a mistake that exists on one node only would otherwise keep the others at the rendezvous for 30 minutes).
    Returns the error to report, with its host where the ranks span several."""
    if not joins_the_others(argv, dist):
        return err
    try:
        distributed.init_distributed(dist)
        settle(dist, err)
    except RunEnded as agreed:
        return agreed
    finally:
        distributed.teardown_distributed(dist.rank)
    return err  # settle always raises when given an error


def settle(dist: DistInfo, error: RunEnded | None = None, facts: dict | None = None) -> None:
    """The collective that ends a phase: every rank's outcome (`error` or None) and `facts` (name -> value).

    Raises on every rank when any rank failed (its own error, or PeerStopped naming the first rank that failed), or
    when a rank's facts differ from global rank 0's (RanksDisagree); returns when all agree."""
    host = socket.gethostname()
    mine = {
        "rank": dist.rank,
        "host": host,
        "local_rank": dist.local_rank,
        "facts": facts or {},
        "error": None if error is None else {"message": str(error), "exit_code": error.exit_code},
    }
    try:
        records = distributed.all_gather_objects(mine)
    except Exception:  # a rank died (gloo: connection closed by peer); one that failed still says why itself
        if error is not None:
            raise error from None
        raise
    several_nodes = sum(r["local_rank"] == 0 for r in records) > 1  # then each message says where it comes from
    failed = [r for r in records if r["error"] is not None]
    if failed:
        if error is None:
            first = failed[0]
            error = PeerStopped(
                f"rank {first['rank']} on {first['host']} could not go on: {first['error']['message'].splitlines()[0]}",
                first["error"]["exit_code"],
            )
        if several_nodes:
            error.node = host
        raise error
    problem = disagreement(records)
    if problem:
        raise RanksDisagree(problem)


def disagreement(records: list) -> str | None:
    """The first fact on which a rank differs from global rank 0, in words, or None."""
    main = records[0]
    for record in records[1:]:
        for name, value in record["facts"].items():
            expected = main["facts"].get(name)
            if value == expected:
                continue
            detail = (
                first_difference(value, expected)
                if isinstance(value, dict) and isinstance(expected, dict)
                else (value, expected)
            )
            hint = HINTS.get(name)
            return (
                f"ranks disagree on the {name}: rank {record['rank']} on {record['host']} has {detail[0]}, "
                f"rank 0 on {main['host']} has {detail[1]}; nothing was trained" + (f"\n  hint: {hint}" if hint else "")
            )
    return None


def first_difference(value: dict, expected: dict) -> tuple:
    """("key=value", "key=expected") for the first key (flattened, dotted) where two nested dicts differ."""
    flat_value, flat_expected = _flatten(value), _flatten(expected)
    for key in sorted(set(flat_value) | set(flat_expected)):
        if flat_value.get(key, "(unset)") != flat_expected.get(key, "(unset)"):
            return f"{key}={flat_value.get(key, '(unset)')}", f"{key}={flat_expected.get(key, '(unset)')}"
    return str(value), str(expected)


def _flatten(value, prefix: str = "") -> dict:
    if isinstance(value, dict):
        flat = {}
        for key, item in value.items():
            flat.update(_flatten(item, f"{prefix}{key}."))
        return flat
    if isinstance(value, list) and any(isinstance(item, dict) for item in value):
        flat = {}
        for i, item in enumerate(value):
            flat.update(_flatten(item, f"{prefix}{i}."))
        return flat
    return {prefix.rstrip("."): value}


def preflight_facts(
    *, run_configuration: dict, block_size: int, ds_config: dict, tokenizer, resume: ResumePoint | None
) -> dict:
    """What every rank decided in its pre-flight from its own file system and environment: the checkpoint it
    resumes, its tokenizer, and its run configuration (`run_configuration`: the flags, RunConfig.to_dict) with the
    block size and the resolved DeepSpeed JSON."""
    from scaletrain.data import tokenizer_hash

    configuration = {k: v for k, v in run_configuration.items() if k != "local_rank"}  # the launcher's
    configuration.update({"block_size": block_size, "deepspeed": ds_config})
    return {
        "resume checkpoint": "none (a fresh start)" if resume is None else f"{resume.checkpoint} (step {resume.step})",
        "tokenizer": f"tokenizer sha256 {tokenizer_hash(tokenizer)[:16]}",
        "run configuration": configuration,
    }


def store_facts(stores: list) -> dict:
    """The fingerprints of the token stores a rank opened: what its data was made from."""
    return {"token store": {str(i): store["manifest"]["fingerprint"] for i, store in enumerate(stores)}}
