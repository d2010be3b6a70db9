"""Test helper: train.py on a file system where deleting an old checkpoint is slow.

    SCALETRAIN_TEST_SLOW_PRUNE=SECONDS python tests/helpers/slow_prune.py <train.py flags>

sleeps SECONDS before each deletion of the checkpoints beyond --save_total_limit (it wraps
scaletrain.checkpoint.commit.prune_checkpoints, which the checkpoint manager looks up at each call). The pipeline
holds no hook for this. Without the variable it is plain train.py.
"""

import os
import sys
import time


SLOW_ENV = "SCALETRAIN_TEST_SLOW_PRUNE"


def main() -> int:
    import train
    from scaletrain.checkpoint import commit

    seconds = float(os.environ.get(SLOW_ENV, "0"))
    if seconds:
        prune = commit.prune_checkpoints

        def slow_prune(*args, **kwargs):
            time.sleep(seconds)
            return prune(*args, **kwargs)

        commit.prune_checkpoints = slow_prune
    return train.main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
