"""The persistent compile cache's directory and the compile counter over its hits (fresh processes)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

PROGRAM = """
import sys
from pathlib import Path
import jax, jax.numpy as jnp
from tx.engine.compiles import compile_count, enable_persistent_cache
enable_persistent_cache(Path(sys.argv[1]))
before = compile_count()
jax.jit(lambda x: jnp.sin(x) * 2 + 1)(jnp.ones(7)).block_until_ready()
print(jax.config.jax_compilation_cache_dir, compile_count() - before)
"""


def _run(default_dir: Path, env: dict[str, str]) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", PROGRAM, str(default_dir)], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    directory, count = out.stdout.split()
    return directory, int(count)


def test_an_operators_cache_directory_is_used_and_its_hits_count_as_compiles(tmp_path: Path) -> None:
    default, shared = tmp_path / "data" / "compile-cache", tmp_path / "shared"
    env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(shared)}
    first = _run(default, env)
    # The program compiles in milliseconds and is cached all the same.
    assert first[0] == str(shared) and any(shared.iterdir()) and not default.exists()
    again = _run(default, env)  # every program now comes from the cache, and each still counts
    assert again[1] == first[1] > 0
