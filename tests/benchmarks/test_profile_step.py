"""`benchmarks/profile_step.py`'s FLOP count of the matrix products in a dumped HLO module: a plain dot, a
batched one, and a fusion whose computation holds a dot (the name the trace reports is the fusion's)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

MODULE = """HloModule jit_step, entry_computation_layout={()->f32[8,16]{1,0}}

%fused_computation.3 (param_0.1: f32[8,32], param_1.1: f32[16,32]) -> f32[8,16] {
  %param_0.1 = f32[8,32]{1,0} parameter(0)
  %param_1.1 = f32[16,32]{1,0} parameter(1)
  ROOT %dot.9 = f32[8,16]{1,0} dot(%param_0.1, %param_1.1), lhs_contracting_dims={1}, rhs_contracting_dims={1}
}

ENTRY %main.5 (a: f32[8,32], b: f32[16,32], q: f32[2,4,6,5], k: f32[2,4,5,7]) -> f32[8,16] {
  %a = f32[8,32]{1,0} parameter(0)
  %b = f32[16,32]{1,0} parameter(1)
  %q = f32[2,4,6,5]{3,2,1,0} parameter(2)
  %k = f32[2,4,5,7]{3,2,1,0} parameter(3)
  %ynn_fusion.3 = f32[8,16]{1,0} fusion(%a, %b), kind=kCustom, calls=%fused_computation.3
  %dot_general.4 = f32[2,4,6,7]{3,2,1,0} dot(%q, %k), lhs_batch_dims={0,1}, lhs_contracting_dims={3}
  ROOT %copy.1 = f32[8,16]{1,0} copy(%ynn_fusion.3)
}
"""


def test_dot_flops_counts_plain_batched_and_fused_products(tmp_path: Path) -> None:
    (tmp_path / "module_0007.jit_step.cpu_after_optimizations.txt").write_text(MODULE)
    code = (
        "import json, sys; sys.path.insert(0, 'benchmarks'); import profile_step as p; "
        f"print(json.dumps({{k[1]: v for k, v in p.dot_flops({str(tmp_path)!r}).items() if k[0] == 'jit_step'}}))"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    flops = json.loads(proc.stdout.strip().splitlines()[-1])
    assert flops["ynn_fusion.3"] == 2 * 8 * 16 * 32
    assert flops["dot_general.4"] == 2 * (2 * 4 * 6 * 7) * 5
    assert "copy.1" not in flops
