"""Test helper: train.py whose snapshot buffers live on a small file system the test mounted, in place of /dev/shm,
and that another writer fills up just before the run's first buffer is made (after the start's check of free space).

    SCALETRAIN_TEST_SHM=/mounted/tmpfs python tests/helpers/shm_full.py <train.py flags>

points scaletrain.checkpoint.async_save.SHM_ROOT at the folder and wraps its _allocate (looked up at each call) to
fill the folder once, before the first allocation: the real posix_fallocate then meets a real full tmpfs. The
pipeline holds no hook for this. Without the variable it is plain train.py.
"""

import os
import sys
from pathlib import Path


SHM_ENV = "SCALETRAIN_TEST_SHM"


def main() -> int:
    import train
    from scaletrain.checkpoint import async_save
    from tests.harness import fill_up

    folder = os.environ.get(SHM_ENV)
    if folder:
        async_save.SHM_ROOT = Path(folder)
        allocate = async_save._allocate

        def allocate_on_a_full_disk(path, capacity):
            if not (Path(folder) / "filler").exists():
                fill_up(Path(folder))
            return allocate(path, capacity)

        async_save._allocate = allocate_on_a_full_disk
    return train.main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
