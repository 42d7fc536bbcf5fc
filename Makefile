# Warden — the two commands are `make run` and `make test`.
CARGO ?= cargo

.PHONY: run test test-python build bench lint fmt clean

## Build, start the whole mesh in one process (SQLite, no servers needed), run the demo plan.
run:
	$(CARGO) build -q -p warden
	./target/debug/warden dev --demo examples/hello.plan.json

## Every test: unit tests, then integration/conformance tests against separate processes,
## a throwaway Redis and PostgreSQL (or REDIS_URL / DATABASE_URL when set), then the Python
## SDK's tests against a mesh of the built binaries.
test:
	$(CARGO) build --workspace --bins
	$(CARGO) test --workspace
	./sdk/python/run-tests.sh

## The Python SDK's tests alone (a virtualenv in ~/.cache/warden-test; the binaries built).
test-python:
	$(CARGO) build --workspace --bins
	./sdk/python/run-tests.sh

build:
	$(CARGO) build --workspace --bins

## Benchmarks (dev shape and production shape); figures go to BENCHMARKS.md.
bench:
	$(CARGO) build --release --workspace --bins
	./target/release/warden bench

lint:
	$(CARGO) fmt --all --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings

fmt:
	$(CARGO) fmt --all

clean:
	$(CARGO) clean
	rm -rf .warden
