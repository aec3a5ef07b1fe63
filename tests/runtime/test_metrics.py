"""`runtime.metrics.Metrics.observe_batch`: KV pool use and preemptions as Prometheus series;
counters only grow, also across a restart of the shard group (a new batch counts from 0). The
speculation policy's decisions (`observe_speculation`, `observe_policy`)."""

from __future__ import annotations

from layersplit.runtime.batching import Batcher
from layersplit.runtime.metrics import Metrics
from layersplit.runtime.scheduler import SchedulerConfig
from layersplit.runtime.spec_policy import SpecPolicy
from layersplit.runtime.speculative import SpecStats

CFG = SchedulerConfig(slots=2, slot_tokens=64, block_tokens=16, micro_batches=1,
                      step_tokens=64, num_blocks=8)


def _value(m: Metrics, name: str, **labels) -> float:
    return m.registry.get_sample_value(name, labels or None)


def test_pool_use_and_preemptions_are_counted_once():
    m, b = Metrics(), Batcher(None, CFG, host_blocks=4)
    b.sched.submit("a", 40)
    b.sched.admit()  # 3 of 8 blocks
    b.host.allocate("x", 16)  # 1 of 4 host blocks
    b.stats.swapped_out, b.stats.reprefills = 2, 1
    m.observe_batch(b)
    m.observe_batch(b)  # nothing new
    assert _value(m, "layersplit_kv_cache_usage_ratio") == 3 / 8
    assert _value(m, "layersplit_kv_host_usage_ratio") == 1 / 4
    assert _value(m, "layersplit_preemptions_total", kind="swap") == 2
    assert _value(m, "layersplit_preemptions_total", kind="reprefill") == 1
    again = Batcher(None, CFG)  # the shard group restarted: its stats start at 0
    again.stats.swapped_out = 1
    m.observe_batch(again)
    assert _value(m, "layersplit_preemptions_total", kind="swap") == 3
    assert _value(m, "layersplit_kv_host_usage_ratio") == 0.0


def test_speculation_policy_decisions_are_shown():
    policy = SpecPolicy([7, 3])
    policy.observe_plain(1, 1.0)
    policy.observe_round(1, 7, 3.0)
    policy.observe_round(1, 3, 3.0)
    policy.observe_kept(False, {7: 2, 3: 2})
    for clock in range(80):  # a first look, plain steps to measure, then off (it loses)
        policy.plan(1, False, clock)
    m = Metrics()
    spec = SpecStats(off_steps=12, untapped=9, sizes={7: 5, 3: 2})
    m.observe_speculation(spec)
    m.observe_policy(policy)
    assert _value(m, "layersplit_spec_off_steps_total") == 12
    assert _value(m, "layersplit_spec_untapped_steps_total") == 9
    assert _value(m, "layersplit_spec_rounds_total", size="7") == 5
    assert _value(m, "layersplit_spec_size", batch="1") == 0  # off
    assert _value(m, "layersplit_spec_policy_switches") == policy.stats.switches == 1
