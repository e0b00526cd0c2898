# Two commands for learners: `make lab` (open the series) and `make test` (run every test).
# Both create the environment in .venv when it is missing or when the lock (requirements.txt) changed.
# Versions: edit requirements.in, then `make lock` regenerates requirements.txt (every package, with hashes).
# Neither changes anything outside the checkout and the temp folder; `make test-system` is the command that may set
# this machine up for the Slurm, MPICH and browser tests (as root: apt-get, /etc/slurm, /etc/munge, daemons).
PYTHON ?= python3
VENV   ?= .venv
KERNEL := shardlab
KERNEL_NAME := Python (shardlab: PhysicsNeMo distributed)
STAMP  := $(VENV)/.installed
# Extra options for `jupyter lab`, e.g. LAB_ARGS="--ip=0.0.0.0 --no-browser" in a container (container/).
LAB_ARGS ?=
# Seconds the ranks a notebook stopped wait for the next notebook before they exit (shardlab.warm; README "Ranks
# ready without the wait"); 0: every notebook starts and stops ranks of its own.
SHARDLAB_KEEP_WARM ?= 900

# ipykernel's installer leaves an empty tmp*_kernels folder in the temp folder at every install (ipykernel 7.4:
# install() removes the spec it wrote, not the folder it made for it), so it gets a temp folder of its own.
# tests/test_workarounds.py says when that is no longer needed.
define install_kernel
	scratch=$$(mktemp -d) && TMPDIR=$$scratch $(VENV)/bin/python -m ipykernel install $(1) --name $(KERNEL) \
		--display-name "$(KERNEL_NAME)"; status=$$?; rm -rf "$$scratch"; exit $$status
endef

# The lock is made by uv, installed into its own throwaway venv (never into .venv).
LOCK_VENV  ?= .venv-lock
UV_VERSION := 0.13.9
LOCK_CMD   := uv pip compile requirements.in --generate-hashes --python-version 3.11 \
	--python-platform x86_64-manylinux_2_28 --no-header --quiet -o requirements.txt
# e.g. `make lock LOCK_ARGS=--upgrade` moves every package not pinned in requirements.in to its newest release;
# without it, packages already in requirements.txt keep their versions where requirements.in still allows them.
LOCK_ARGS  ?=

# The interpreter .venv is made from, checked before .venv exists. The lock is for CPython 3.11 (its torch, numpy...
# wheels are cp311); in the container .venv takes the container's packages, so any 3.11 or newer does there.
PYTHON_NEEDED := $(if $(filter 1,$(SHARDLAB_CONTAINER)),3.11 or newer,3.11)
PYTHON_FITS   := $(if $(filter 1,$(SHARDLAB_CONTAINER)),sys.version_info >= (3, 11),sys.version_info[:2] == (3, 11))
CHECK_PYTHON   = found=$$($(PYTHON) -c 'import platform, sys; print("Python", platform.python_version()); \
	sys.exit(not ($(PYTHON_FITS)))' 2>/dev/null) || { echo "make: $(VENV) needs Python $(PYTHON_NEEDED), but" \
	"PYTHON=$(PYTHON) is $${found:-not a Python that runs}. Pass one: make $(or $(MAKECMDGOALS),env)" \
	"PYTHON=python3.11 (or PYTHON=/path/to/python3.11)." >&2; exit 1; }
# A .venv without its stamp is what a failed install left: it is made again from scratch, never reused. The stamp
# is removed before an update and written last, so a complete .venv whose update fails is not reused either.
define fresh_venv
	@if [ -e $(VENV) ] && [ ! -e $(STAMP) ]; then \
		echo "make: $(VENV) is incomplete (an earlier install did not finish): making it again" >&2; rm -rf $(VENV); fi
	@rm -f $(STAMP)
	@test -x $(VENV)/bin/python || { $(CHECK_PYTHON); $(PYTHON) -m venv $(1) $(VENV); }
endef

.PHONY: lab test test-fast test-system gpu-check lint handout env lock clean-env kernel-user slurm-start slurm-stop

# JupyterLab runs with a pool of warm ranks of its own, stopped when it exits.
lab: $(STAMP)
	$(VENV)/bin/python -m shardlab.warm run --idle-s $(SHARDLAB_KEEP_WARM) -- \
		$(VENV)/bin/jupyter lab notebooks/ $(if $(filter 0,$(shell id -u)),--allow-root) $(LAB_ARGS)

# The kernel spec in ~/.local/share/jupyter/kernels, where any Jupyter server of this user finds it: a JupyterHub
# single-user server, or a JupyterLab not started from .venv. It runs .venv's Python (absolute path).
kernel-user:
	@test -x $(VENV)/bin/python || { echo "no $(VENV) yet: run make env first" >&2; exit 1; }
	$(call install_kernel,--user)

# A single-node Slurm (and MPICH) on this machine, as root, for the Slurm tests and to try the Slurm recipe.
slurm-start:
	bash scripts/local-slurm.sh start
slurm-stop:
	bash scripts/local-slurm.sh stop

# Everything, notebooks included, two tests at a time (each worker runs one test's ranks at a time). The Slurm,
# MPICH and browser tests run where the machine has what they need, and skip with a line saying how otherwise.
test: $(STAMP)
	$(VENV)/bin/python -m pytest -n 2 --dist worksteal

# `make test` that may set the machine up first (what CI does; as root): installs Debian's slurm-wlm, munge, mpich and
# chromium where missing, writes /etc/slurm and /etc/munge, and runs a single-node Slurm for the run's duration.
test-system: export SHARDLAB_SYSTEM_SETUP = 1
test-system: test

# What needs no ranks, no notebooks and no browser: the loop to run after every change (a minute or more).
test-fast: $(STAMP)
	$(VENV)/bin/python -m pytest -m unit -n 2

# On a GPU node: what only GPUs prove (NCCL, CUDA engines, allocator peaks, compiled speed); exits 0 without a GPU.
gpu-check: $(STAMP)
	$(VENV)/bin/python -m shardlab.gpucheck --json test-artifacts/gpu-check.json

lint: $(STAMP)
	$(VENV)/bin/ruff check .

handout: $(STAMP)
	$(VENV)/bin/python -m shardlab.handout notebooks build/handout

env: $(STAMP)

ifeq ($(SHARDLAB_CONTAINER),1)
# Inside a container that brings PyTorch, PhysicsNeMo and an MPI (the NGC PhysicsNeMo image, container/): .venv
# sees the container's packages, and only what the container lacks is added, under constraints that pin every
# package the container has, so torch and its CUDA build are never replaced.
$(STAMP): container/requirements.txt helpers/pyproject.toml
	$(call fresh_venv,--system-site-packages)
	$(VENV)/bin/python -m pip freeze --all > $(VENV)/container-constraints.txt
	$(VENV)/bin/python -m pip install --quiet -c $(VENV)/container-constraints.txt -r container/requirements.txt
	$(VENV)/bin/python -m pip install --quiet --no-deps -e helpers
	$(call install_kernel,--sys-prefix)
	@touch $(STAMP)
else
# The lock is installed hash-checked; the local helpers package (editable, so not hash-checkable) separately.
$(STAMP): requirements.txt helpers/pyproject.toml
	$(call fresh_venv)
	$(VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VENV)/bin/python -m pip install --quiet --require-hashes -r requirements.txt
	$(VENV)/bin/python -m pip install --quiet --no-deps -e helpers
	$(call install_kernel,--sys-prefix)
	@touch $(STAMP)
endif

lock:
	@test -x $(LOCK_VENV)/bin/python || $(PYTHON) -m venv $(LOCK_VENV)
	$(LOCK_VENV)/bin/python -m pip install --quiet uv==$(UV_VERSION)
	$(LOCK_VENV)/bin/$(LOCK_CMD) $(LOCK_ARGS)
	@{ printf '%s\n' \
		"# Lock for Linux x86_64 / CPython 3.11 (what CI runs): every package \`make env\` installs, with hashes." \
		"# Generated from requirements.in by \`make lock\`; do not edit by hand. The command (uv $(UV_VERSION)):" \
		"#   $(LOCK_CMD)" \
		"# \`make env\` installs it with: pip install --require-hashes -r requirements.txt" \
		"# 3.11 means any 3.11.x: packages that need a later patch release (soupsieve 4 needs 3.11.5) stay older." \
		"#"; cat requirements.txt; } > requirements.txt.tmp
	@mv requirements.txt.tmp requirements.txt

clean-env:
	rm -rf $(VENV)
