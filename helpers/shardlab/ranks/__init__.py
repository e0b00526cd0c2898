"""The machinery behind ``%%px`` and jobs of ranks; lessons reach it through ``sl.start_cluster`` and
``sl.detect_launch``, and read it from notebook 01 on.

- ``devices``: which device a job of ranks runs on (``place_ranks``), and the cores and GPUs its ranks have;
- ``settings``: a cluster's settings (ranks, device, engines, controller), resolved once from the request and the
  environment;
- ``owned``: which processes shardlab started (origin, pid and start time), so that only they are stopped;
- ``folders``: the owner-only folders shardlab trusts: the registry of clusters, profile folders;
- ``records``: each cluster's record (owner, processes, Slurm jobs, profile) and the clean-up it allows;
- ``subprocesses``: a command run as a process group with a deadline, or detached;
- ``slurm``: Slurm's node lists as host names, and jobs found by name and cancelled;
- ``commands``: the command lines that start ranks here (mpiexec, srun, torchrun), their flags and ports;
- ``launch``: what each launcher tells a rank, ``init_distributed``, ``run_job`` (a job of ranks);
- ``px``: ``%%px`` cells with a deadline, a failed cell's errors per rank, the start's status line;
- ``engine_launchers``: one object per way of starting the ipyparallel engines (mpiexec, a Slurm step, an sbatch
  job);
- ``forkserver``, ``forkstub``, ``forkchild``: engines (and a job's ranks) forked from one parent that imported
  PyTorch and PhysicsNeMo once, each started by the launcher as a small stub that hands over its environment;
- ``warm``: the pool on the host that keeps ranks for the next notebook (parked, claimed, stopped);
- ``rankstate``: on a rank, ``init_rank`` (what every engine runs first), and the reset and parking of a warm rank;
- ``bringup``: a cluster's ranks brought up, fresh or taken over;
- ``beacon`` and ``panel``: each rank writes its state, and ``cluster.panel()`` shows it live while a cell runs;
- ``cluster``: ``RankCluster`` and ``start_cluster``, the cluster a notebook owns.
"""

from .. import load_on_first_use

__getattr__, __dir__ = load_on_first_use(__name__)
