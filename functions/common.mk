# What the layer build (functions/layer/Makefile) and the bundled function build
# (functions/Makefile) share: installing manylinux wheels for the Lambda runtime without Docker,
# and pruning what no package ships (functions/layer/prune.txt).
FUNCTIONS_DIR := $(abspath $(dir $(lastword $(MAKEFILE_LIST))))
REPO_ROOT := $(abspath $(FUNCTIONS_DIR)/..)

# pip_for_lambda TARGET PYTHON_VERSION: install for x86_64 Linux wheels of that Python.
pip_for_lambda = python -m pip install --quiet --disable-pip-version-check --no-compile \
	--target "$(1)" --platform manylinux2014_x86_64 --implementation cp \
	--python-version $(2) --only-binary=:all: --upgrade

# prune TARGET: drop what prune.txt lists (globs relative to TARGET) and bytecode caches.
define prune
	cd "$(1)" && for pattern in $$(sed -e '/^#/d' -e '/^$$/d' "$(FUNCTIONS_DIR)/layer/prune.txt"); do rm -rf $$pattern; done
	find "$(1)" -name __pycache__ -type d -prune -exec rm -rf {} +
endef

# engine TARGET BACKEND PYTHON_VERSION [MORE_PIP_ARGS]: rdq_core, Powertools and the one driver of BACKEND.
define engine
	mkdir -p "$(1)"
	$(call pip_for_lambda,$(1),$(3)) -r "$(FUNCTIONS_DIR)/requirements/common.txt" -r "$(FUNCTIONS_DIR)/requirements/$(2).txt" $(4)
	cp -R "$(REPO_ROOT)/rdq_core" "$(1)/rdq_core"
endef
