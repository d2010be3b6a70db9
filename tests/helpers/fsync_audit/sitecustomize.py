"""Test helper: every Python process started with this folder on PYTHONPATH (a rank, the checkpoint writer, a
launcher) records what it fsyncs: one line per call, the path of the synced file or folder, in
$SCALETRAIN_TEST_FSYNC_AUDIT/<pid>.txt. Python imports `sitecustomize` at start-up, so the writer process that
multiprocessing spawns records too. The pipeline holds no hook for this."""

import os

_AUDIT = os.environ.get("SCALETRAIN_TEST_FSYNC_AUDIT")
if _AUDIT:
    _fsync = os.fsync

    def _recorded_fsync(fd):
        _fsync(fd)  # first: what is recorded is on disk
        number = fd if isinstance(fd, int) else fd.fileno()
        with open(os.path.join(_AUDIT, f"{os.getpid()}.txt"), "a") as record:
            record.write(os.readlink(f"/proc/self/fd/{number}") + "\n")

    os.fsync = _recorded_fsync
