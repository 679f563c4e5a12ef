#!/usr/bin/env bash
# The interpreter tests/e2e/test_cookbook.py runs the tinker-cookbook 0.6.1 recipes with (.venv-cookbook):
# the main venv's packages through a .pth file, then the cookbook itself and what its text recipes import
# beyond them. `--no-deps` for the cookbook: it requires tml-renderers>=0.4.1, which the package registry
# does not have and the text recipes never import.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv-cookbook
main_site=$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
cookbook_site=$(.venv-cookbook/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
echo "$main_site" > "$cookbook_site/smolgym-main-venv.pth"
.venv-cookbook/bin/pip install -q --no-deps tinker-cookbook==0.6.1
.venv-cookbook/bin/pip install -q datasets chz blobfile pyrage termcolor tiktoken pillow rich cloudpickle aiohttp \
    pylatexenc math-verify  # rl_loop and math_rl import the math grader
echo "$PWD/.venv-cookbook/bin/python"
