#!/usr/bin/env bash
# The Python SDK's tests against a real mesh (the workspace's built Rust binaries).
#
# Installs what it needs itself: a virtualenv under ~/.cache/warden-test (reused while the
# SDK's pyproject.toml and location are unchanged) with the SDK installed in editable mode
# and its test extras, from PyPI. Needs python3 >= 3.10 and `cargo build --workspace --bins`
# done first (`make test` does both). Extra arguments go to pytest.
#
# `run-tests.sh --generate` regenerates the checked-in contract (src/warden_sdk/v1) from
# proto/ instead of testing: run it after changing a .proto (tests/test_codegen.py fails
# until then).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
cache="${WARDEN_TEST_CACHE:-$HOME/.cache/warden-test}"
python="${PYTHON:-python3}"

if ! "$python" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else 1)' 2>/dev/null; then
    echo "run-tests.sh: $python is missing or older than 3.10" >&2
    exit 1
fi
pyver="$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
venv="$cache/venv-py$pyver"
stamp_want="$( (cat "$here/pyproject.toml"; echo "$here") | sha256sum | cut -c1-16)"

mkdir -p "$cache"
# One installer at a time: two test runs on one machine share the virtualenv.
exec 9>"$cache/venv-py$pyver.lock"
flock 9
if [ ! -x "$venv/bin/python" ] || [ "$(cat "$venv/.warden-stamp" 2>/dev/null)" != "$stamp_want" ]; then
    echo "run-tests.sh: installing warden-sdk[test] into $venv"
    [ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --upgrade pip
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check -e "$here[test]"
    echo "$stamp_want" > "$venv/.warden-stamp"
fi
flock -u 9

if [ "${1:-}" = "--generate" ]; then
    exec "$venv/bin/python" "$here/tools/gen_protos.py"
fi

bins="${WARDEN_BIN_DIR:-${CARGO_TARGET_DIR:-$repo/target}/debug}"
for b in warden warden-ledger warden-policy warden-planner warden-executor warden-tools; do
    if [ ! -x "$bins/$b" ]; then
        echo "run-tests.sh: $bins/$b is not built: run \`cargo build --workspace --bins\` first" >&2
        exit 1
    fi
done
export WARDEN_BIN_DIR="$bins"
export MYPY_CACHE_DIR="$cache/mypy-cache-py$pyver"

cd "$here"
set +e
"$venv/bin/python" -m pytest -p no:cacheprovider "$@"
status=$?
set -e
if [ "$status" -eq 5 ]; then
    echo "run-tests.sh: pytest collected no tests" >&2
    exit 1
fi
exit "$status"
