#!/usr/bin/env bash
# The suite's reference tests (the test files that compare graphcp with transformers) against
# the newest transformers, or the release given as $1, in a throwaway venv that shares this
# Python's other packages; then says what moved: the packages whose versions differ from
# constraints.txt, and the tests that fail there but pass with the pinned versions.
#
#   scripts/check_latest.sh            # the newest transformers on the registry
#   scripts/check_latest.sh 5.24.0     # one release
#
# Run it from an environment set up by the README's command 2 (the pinned versions).
# Exit 0: nothing moved; 1: a reference test moved; 2: the set-up failed.
set -euo pipefail
cd "$(dirname "$0")/.."

spec=${1:+"transformers==$1"}
spec=${spec:-transformers}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

pinned=$(python -c "import transformers; print(transformers.__version__)") || {
    echo "check_latest: transformers is not installed here: run the README's command 2 first" >&2; exit 2; }
want=$(sed -n 's/^transformers==//p' constraints.txt)
if [ "$pinned" != "$want" ]; then
    echo "check_latest: this Python has transformers $pinned, constraints.txt pins $want:" \
         "run the README's command 2 first" >&2
    exit 2
fi

python -m venv --system-site-packages "$work/venv"
"$work/venv/bin/pip" install --quiet --upgrade "$spec" || { echo "check_latest: cannot install $spec" >&2; exit 2; }
newest=$("$work/venv/bin/python" -c "import transformers; print(transformers.__version__)")

echo "transformers: pinned $pinned, checked $newest"
echo "packages that moved (constraints.txt -> the checked venv):"
"$work/venv/bin/pip" freeze --local | while IFS='=' read -r name _ version; do
    old=$(grep -i "^${name}==" constraints.txt | cut -d= -f3 || true)
    [ "$old" != "$version" ] && echo "  $name ${old:-(not pinned)} -> $version"
done || true

mapfile -t files < <(grep -lE "\bhf_model\b|from transformers|import transformers|AutoModel" tests/test_*.py)
echo "running ${#files[@]} reference test files with transformers $newest ..."
set +e
PYTHONPATH=$PWD "$work/venv/bin/python" -m pytest -n 2 --dist loadfile -q -p no:cacheprovider -rf \
    "${files[@]}" > "$work/newest.txt" 2>&1
rc=$?
set -e
tail -n 1 "$work/newest.txt"
mapfile -t failed < <(sed -n 's/^FAILED \([^ ]*\).*/\1/p' "$work/newest.txt" | sort -u)
if [ "$rc" -ne 0 ] && [ "${#failed[@]}" -eq 0 ]; then
    echo "check_latest: the run with transformers $newest did not finish (exit $rc):" >&2
    tail -n 20 "$work/newest.txt" >&2
    exit 2
fi
if [ "${#failed[@]}" -eq 0 ]; then
    echo "nothing moved: every reference test passes with transformers $newest as with $pinned"
    exit 0
fi

echo "${#failed[@]} failed with $newest; rerunning them with the pinned $pinned ..."
set +e
python -m pytest -q -p no:cacheprovider -rf "${failed[@]}" > "$work/pinned.txt" 2>&1
set -e
moved=0
for test in "${failed[@]}"; do
    if grep -q "^FAILED $test" "$work/pinned.txt"; then
        echo "  fails with both (not a transformers change): $test"
    else
        echo "  MOVED (passes with $pinned, fails with $newest): $test"
        grep -A3 "^FAILED $test" "$work/newest.txt" | head -n 1 | cut -c1-300 | sed 's/^/      /'
        moved=1
    fi
done
exit "$moved"
