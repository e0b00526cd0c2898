"""The machinery behind ``%%px`` and jobs of ranks; lessons reach it through ``sl.start_cluster`` and
``sl.detect_launch``, and read it from notebook 01 on.

- ``devices``: which device a job of ranks runs on (``place_ranks``), and the cores and GPUs its ranks have;
- ``procs``: which processes shardlab started, so that only they are stopped;
- ``programs``: the launcher programs on this machine (mpiexec, srun), their flags, a job's command line;
- ``launch``: what each launcher tells a rank, ``init_distributed``, ``run_job`` (a job of ranks);
- ``px``: ``%%px`` cells with a deadline, a failed cell's errors per rank, the start's status line;
- ``engines``: one object per way of starting the ipyparallel engines (mpiexec, a Slurm step, an sbatch job);
- ``forkserver``, ``forkstub``, ``forkchild``: engines (and a job's ranks) forked from one parent that imported
  PyTorch and PhysicsNeMo once, each started by the launcher as a small stub that hands over its environment;
- ``warm``: ranks kept for the next notebook and the reset that makes them fresh; ``init_rank``;
- ``bringup``: a cluster's ranks brought up, fresh or taken over;
- ``beacon`` and ``panel``: each rank writes its state, and ``cluster.panel()`` shows it live while a cell runs;
- ``cluster``: ``MPICluster`` and ``start_cluster``, the cluster a notebook owns.
"""

from .. import load_on_first_use

__getattr__, __dir__ = load_on_first_use(__name__)
