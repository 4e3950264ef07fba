"""How a job ends: every process group gone once main returns (none left to the interpreter's shutdown), and the
final barrier, where every rank leaves together, still watched by the flight recorder."""

from __future__ import annotations

import datetime
import os
import re
import subprocess
import sys
import time

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


STUCK_AT_THE_END = """import os, sys, time
import megatron_lite.training.pretrain as pretrain
close = pretrain.MetricsLogger.close
def stuck(self, *args, **kwargs):  # rank 1 never gets past its end (a hung file system, a stuck W&B upload)
    if os.environ["RANK"] == "1":
        time.sleep(600)
    return close(self, *args, **kwargs)
pretrain.MetricsLogger.close = stuck
sys.exit(pretrain.main(sys.argv[1:]))
"""


def test_a_rank_stuck_at_the_end_is_reported_at_the_final_barrier(tmp_path):
    """Rank 1 trains to the end, then never reaches the job's final barrier. That barrier ran after the flight
    recorder was uninstalled: rank 0 waited there, unexplained, for gloo's own timeout (2 x 15 + 60 s here). Now the
    recorder still watches it: the report comes at --distributed-timeout-minutes (15 s), names the final barrier
    and rank 1 as the one missing, finishing."""
    (tmp_path / "wrapper.py").write_text(STUCK_AT_THE_END)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(tmp_path / "wrapper.py"), *ARGS, "--train-iters", "2",
           "--distributed-timeout-minutes", "0.25"]  # fmt: skip
    out = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    ended, err = time.time(), out.stderr[-4000:]
    done = re.search(r"^\[([^\]]+)\] done: iteration 2,", out.stdout, re.M)  # (rank 0 trained to the end)
    assert done, out.stdout[-2000:] + err
    waited = ended - datetime.datetime.strptime(done[1], "%Y-%m-%d %H:%M:%S").timestamp()
    assert out.returncode != 0 and waited < 15 + 45, (waited, err)
    assert "hang: rank 0 has waited" in err and "barrier on ranks [0,1]" in err, err
    assert "in the job's final barrier (every rank leaves together)" in err, err
    assert "rank 1: MISSING" in err and "computing (in no collective) (finishing" in err, err
