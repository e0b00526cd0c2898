"""The folder ``python -m shardlab.port`` writes: train.py and test_parity.py (copied from ``port/run/``, the same for
every model), model.py (how this model is built, ``spec.model_source``), run.json (the case, the layout and the
figures the port measured), README.md with the launch lines, and train.sbatch. Written into a new folder beside the
destination, then renamed into place: a folder that exists is never overwritten."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from .spec import PortError

RUN_FILES = ("train.py", "test_parity.py")
TEMPLATES = Path(__file__).resolve().parent / "run"


def check_free(out) -> Path:
    out = Path(out)
    if out.exists():
        raise PortError(f"{out} exists: the port never overwrites a folder; pass --out with a new folder, or move "
                        "this one away.")
    if not out.parent.is_dir():
        raise PortError(f"{out.parent} is not a folder: create it, or pass --out inside a folder that exists.")
    return out


def write_run(out, config: dict, model_py: str) -> list[str]:
    """The folder at ``out`` (which must not exist); returns its files."""
    out = check_free(out)
    writing = out.with_name(f".{out.name}.writing")
    shutil.rmtree(writing, ignore_errors=True)
    writing.mkdir()
    for name in RUN_FILES:
        shutil.copyfile(TEMPLATES / name, writing / name)
    (writing / "model.py").write_text(model_py)
    (writing / "run.json").write_text(json.dumps(config, indent=1) + "\n")
    (writing / "README.md").write_text(readme(config))
    (writing / "train.sbatch").write_text(sbatch(config))
    try:
        os.rename(writing, out)  # fails where out appeared meanwhile: never replaced
    except OSError:
        shutil.rmtree(writing, ignore_errors=True)
        raise PortError(f"{out} appeared while the run was written: nothing replaced; pass another --out.") from None
    return sorted(p.name for p in out.iterdir())


def _launch(config: dict) -> dict:
    gpus, nodes = config["gpus"], config["nodes"]
    per_node = gpus // nodes
    return {"gpus": gpus, "nodes": nodes, "per_node": per_node, "ddp": gpus // config["domain"],
            "domain": config["domain"]}


def readme(config: dict) -> str:
    k = _launch(config)
    parity = "\n".join(f"  - {line}" for line in config["port"]["parity"])
    if not config["port"]["parity_held"]:
        parity += "\n  - **parity FAILED**: written with --skip-parity-gate; this run trains a wrong model until fixed"
    planned = config["port"]["plan"]
    loading = "slab (zarr)" if config["zarr"] else "scatter_tensor"
    mpich = (f"mpiexec -n {k['gpus']} -ppn {k['per_node']} -hosts $NODES -genv MASTER_ADDR $HEAD "
             "-genv MASTER_PORT 29500 python train.py")
    return f"""# {config['model']}, domain-parallel

Written by `python -m shardlab.port` ({config['port']['command']}). It imports torch and PhysicsNeMo, not shardlab.

- Layout: {k['gpus']} GPUs on {k['nodes']} node(s), ddp {k['ddp']} × domain {k['domain']}, {config['wrapper']}
  ({'spatial parameters ' + ', '.join(config['spatial']) + ' split on domain, the rest fully_shard on ddp'
    if config['spatial'] else 'plain parameters'}); size N = {config['size']}; {config['dtype']}; global batch
  {config['global_batch']} (one sample per domain group); loading: {loading}.
- Planned: {planned}
- Parity, measured by the port on CPU ranks in float64 (CPU ranks rehearse the program; GPUs prove it):
{parity}

## Files

- `train.py`: the run (mesh, loading, sync and wrapper, sampler over ddp, DCP checkpoints), the lesson for each part
  named where it starts.
- `model.py`: `build_model(size)`. `run.json`: the case (inputs and target as shapes of N, split dims), the layout and
  what the port measured. `test_parity.py`: this run's layout against one process.

## Check, then launch

```bash
torchrun --nproc-per-node 4 test_parity.py          # parity on 4 ranks (CPU or GPU), before trusting a change
torchrun --nproc-per-node {k['per_node']} --nnodes {k['nodes']} --rdzv-backend c10d --rdzv-endpoint $HEAD:29500 train.py
mpirun -np {k['gpus']} --host $SLOTS -x MASTER_ADDR=$HEAD -x MASTER_PORT=29500 python train.py   # OpenMPI
{mpich}   # MPICH
srun --nodes {k['nodes']} --ntasks-per-node {k['per_node']} --gpus-per-node {k['per_node']} python train.py
sbatch train.sbatch
```

`$HEAD` is the first node's address (one node: `localhost`), `$NODES` the nodes, comma-separated, first node first,
and `$SLOTS` the same with each node's GPU count (`node1:{k['per_node']},node2:{k['per_node']}`: OpenMPI starts a rank
per slot).
The torchrun line runs on every node at once (the c10d rendezvous numbers the nodes). DistributedManager reads the
launcher's variables (torchrun, OpenMPI, Slurm); under MPICH `train.py` hands its `PMI_RANK`, `PMI_SIZE` and
`MPI_LOCALRANKID` to PhysicsNeMo's ENV method (OpenMPI's method reads `MASTER_ADDR`/`MASTER_PORT` too, default
localhost: physicsnemo/distributed/manager.py:395-396). Start `srun` on the allocation's first node, as
`train.sbatch` does: PhysicsNeMo 2.2.2 meets rank 0 at the address of the node srun runs on
(`SLURM_LAUNCH_NODE_IPADDR`, physicsnemo/distributed/manager.py:359), and no rank listens on a login node. Slurm
gets `--gpus-per-node`, not `--gpus-per-task 1`: with one GPU per task each rank sees its GPU as `cuda:0`, while
PhysicsNeMo 2.2.2 takes `cuda:<local rank>`.

## Options

`--steps`, `--global-batch` (a multiple of ddp), `--domain` (another layout on the same or another rank count),
`--size`, `--dtype`, `--lr`, `--zarr STORE` (each rank reads only its rows; `--write-zarr STORE` writes the synthetic
samples in that layout: one array per input and `target`, `(samples, *sample shape[1:])`), `--checkpoints DIR`,
`--save-every K`, `--resume` (the last checkpoint, on whatever layout this launch has: DCP reads the pieces each rank
needs; the step, the sampler's position and the random state come back, so the losses continue as an uninterrupted
run's). Replace `SyntheticSamples` in train.py with your data, or write your data as such a store.
"""


def sbatch(config: dict) -> str:
    k = _launch(config)
    return f"""#!/bin/bash
# {config['model']}: ddp {k['ddp']} x domain {k['domain']} on {k['gpus']} GPUs, {k['nodes']} node(s)
#SBATCH --job-name=port-run
#SBATCH --nodes={k['nodes']}
#SBATCH --ntasks-per-node={k['per_node']}
#SBATCH --gpus-per-node={k['per_node']}
#SBATCH --time=01:00:00
set -euo pipefail
cd "$SLURM_SUBMIT_DIR"
# Every task is a rank; DistributedManager reads SLURM_PROCID, SLURM_NPROCS, SLURM_LOCALID and the launch node.
srun python train.py --checkpoints checkpoints --save-every 100 --resume "$@"
"""
