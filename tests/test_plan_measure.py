"""``measure_topology``: two local gloo ranks fill the same-host and local link figures."""

import numpy as np

from embedscale.plan.measure import measure_topology


def test_measure_two_local_ranks():
    t = measure_topology(num_hosts=2, ranks_per_host=2, sizes=(1 << 12, 1 << 18), repeats=2)
    assert t.source == "measured" and t.world_size == 4
    cls = t.link_class()
    assert np.all(t.bandwidth[cls == 1] > 0) and np.all(np.isfinite(t.bandwidth))
    assert t.notes["from_spec"] == ["other_host"]
    assert t.allreduce_bw > 0
