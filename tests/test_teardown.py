"""How a job ends: every process group gone once main returns (none left to the interpreter's shutdown)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from test_fault_tolerance import ARGS

pytestmark = pytest.mark.slow

AFTER_MAIN = """import os, sys
import torch.distributed as dist
from megatron_lite.training.pretrain import main
rc = main(sys.argv[1:])
names = []
for t in os.listdir("/proc/self/task"):
    try:
        names.append(open(f"/proc/self/task/{t}/comm").read().strip())
    except OSError:  # (a thread that ended meanwhile)
        pass
print(f"after main: rc={rc} initialized={dist.is_initialized()} gloo threads={sorted(n for n in names if 'gloo' in n)}")
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads the process's threads from /proc")
def test_no_process_group_outlives_main(tmp_path):
    """A 2-rank FSDP2 job under torchrun. After main returned its groups were destroyed, yet the default group's C++
    backend lived on, with its gloo threads, into the interpreter's shutdown (where a gloo group left alive can
    abort a finished process): held by the defaults of torch.distributed.nn.functional (imported by torch.optim
    once the group existed), by the device mesh (kept in torch's DTensor caches) and by FSDP2's state in
    reference cycles. Now none is left once main returns."""
    (tmp_path / "after_main.py").write_text(AFTER_MAIN)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(tmp_path / "after_main.py"), *ARGS, "--train-iters", "1", "--use-torch-fsdp2"]  # fmt: skip
    out = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.count("after main:") == 2, out.stdout[-2000:] + out.stderr[-3000:]
    said = "after main: rc=0 initialized=False gloo threads=[]"
    assert out.stdout.count(said) == 2, out.stdout[-1000:]  # (on each rank)
