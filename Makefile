# Two commands for learners: `make lab` (open the series) and `make test` (run every test).
# Both create the environment in .venv when it is missing or when requirements.txt changed.
PYTHON ?= python3
VENV   ?= .venv
KERNEL := shardlab
STAMP  := $(VENV)/.installed

.PHONY: lab test handout env clean-env

lab: $(STAMP)
	$(VENV)/bin/jupyter lab notebooks/ $(if $(filter 0,$(shell id -u)),--allow-root)

test: $(STAMP)
	$(VENV)/bin/python -m pytest

handout: $(STAMP)
	$(VENV)/bin/python -m shardlab.handout notebooks build/handout

env: $(STAMP)

$(STAMP): requirements.txt helpers/pyproject.toml
	@test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VENV)/bin/python -m pip install --quiet -r requirements.txt
	$(VENV)/bin/python -m pip install --quiet --no-deps -e helpers
	$(VENV)/bin/python -m ipykernel install --sys-prefix --name $(KERNEL) \
		--display-name "Python (shardlab: PhysicsNeMo distributed)"
	@touch $(STAMP)

clean-env:
	rm -rf $(VENV)
