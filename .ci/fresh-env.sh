# Sourced by .ci/main-command and .ci/drift-check from the repo root: what a newcomer starts
# from. Leaves the shell in a fresh copy of the tree (what git tracks or would track: no build
# outputs, no demo_output/) with a fresh virtual environment active; $scratch holds both and is
# removed on exit.
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
tree="$scratch/megatron-rlhf"
mkdir "$tree"
git ls-files -z --cached --others --exclude-standard \
    | tar --null --ignore-failed-read -T - -cf - 2>/dev/null | tar -xf - -C "$tree"
python -m venv "$scratch/venv"
# shellcheck disable=SC1091
source "$scratch/venv/bin/activate"
cd "$tree"
