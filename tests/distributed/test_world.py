"""Rank facts from each launcher's environment."""

from scaletrain.distributed.world import cpu_threads_per_rank, read_launch_env


def test_torchrun_and_deepspeed_launcher_env():
    d = read_launch_env({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1"})
    assert (d.rank, d.local_rank, d.world_size, d.launcher) == (3, 1, 8, "torchrun/deepspeed")


def test_srun_env_is_mapped_when_no_launcher_set_ranks():
    d = read_launch_env({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1"})
    assert (d.rank, d.local_rank, d.world_size, d.launcher) == (5, 1, 8, "srun")


def test_launcher_env_wins_over_slurm_and_single_task_batch_step_is_not_a_rank():
    d = read_launch_env({"RANK": "0", "WORLD_SIZE": "2", "SLURM_PROCID": "1", "SLURM_NTASKS": "4"})
    assert (d.rank, d.world_size) == (0, 2)
    d = read_launch_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"})
    assert (d.world_size, d.launcher) == (1, "single")


def test_plain_python_is_a_single_rank():
    d = read_launch_env({})
    assert (d.rank, d.world_size, d.is_main, d.launcher) == (0, 1, True, "single")


def test_cpu_ranks_share_the_nodes_cores_unless_omp_num_threads_is_set():
    assert cpu_threads_per_rank({"LOCAL_SIZE": "2"}, 2) == 1  # the deepspeed launcher's local rank count
    assert cpu_threads_per_rank({"LOCAL_WORLD_SIZE": "4"}, 16) == 4  # torchrun's
    assert cpu_threads_per_rank({"SLURM_NTASKS_PER_NODE": "8"}, 4) == 1  # srun: at least one thread
    assert cpu_threads_per_rank({}, 2) == 2  # one rank: every core, torch's default
    assert cpu_threads_per_rank({"OMP_NUM_THREADS": "3", "LOCAL_SIZE": "2"}, 2) is None  # the user's choice stands
