"""SIGKILL in the middle of a workload, then a restart on the same disk tier.

A child process runs drawn workloads (``support.engines``, as test_tiers_random_workload) round after round
through a small pool with a disk tier, demoting and promoting blocks all the time; it is
killed with SIGKILL (no shutdown, writes in flight, a record possibly half written) at a
drawn moment. A new engine on the same directory must restore what was published, discard
what was torn (counted), hit the rest, and give every request the cache-off engine's tokens.
"""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.engines import draw_workload, run_workload
from support.processes import child_env

CHILD = """
import sys
from pathlib import Path
from support.engines import draw_workload, run_workload

for seed in range(1000):
    _, engine = run_workload(Path(sys.argv[1]), draw_workload(seed), False, num_kv_blocks=24,
                             disk_kv_path=sys.argv[2], disk_kv_cache_bytes=1 << 20)
    engine.shutdown()
    print("round", seed, flush=True)
"""


@pytest.mark.slow
@pytest.mark.parametrize("trial", [0, 1])
def test_a_killed_engine_leaves_nothing_wrong_on_disk(
    tiny_dirs: dict[str, Path], tmp_path: Path, trial: int
) -> None:
    model, disk = tiny_dirs["gqa_tied"], tmp_path / "kv"
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(model), str(disk)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=child_env(),
    )
    try:
        assert child.stdout is not None
        first = child.stdout.readline()  # one whole round: the tier holds blocks of every kind
        assert first.startswith("round"), first + child.stdout.read()
        time.sleep(random.Random(trial).uniform(0.5, 3.0))  # then anywhere in the next rounds
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=30)

    # A workload the child ran (round 0 completed; round 1 was running or done): its
    # prefixes are what the restored records hold.
    arrivals = draw_workload(trial)
    expected, reference = run_workload(model, arrivals, False, enable_prefix_caching=False, num_kv_blocks=400)
    reference.shutdown()
    got, engine = run_workload(
        model, arrivals, True, num_kv_blocks=24, disk_kv_path=str(disk), disk_kv_cache_bytes=1 << 20
    )
    assert engine.kv.tiers is not None and engine.kv.tiers.disk is not None
    report = engine.kv.tiers.disk.restart
    assert report.restored > 0  # the killed engine's published blocks are found again
    assert got == expected
    disk_tier = {m.tier: m for m in engine.kv.tiers.metrics()}["disk"]
    assert disk_tier.hits > 0 and disk_tier.promotions > 0  # and served as hits
    engine.shutdown()
