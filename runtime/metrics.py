"""Prometheus metrics of the server (prometheus-client), one registry per server instance."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28,
                   2.5, 5, 10, 20, 40, 80)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("layersplit_requests", "HTTP requests, by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.ttft = Histogram("layersplit_time_to_first_token_seconds",
                              "request arrival to first token", buckets=LATENCY_BUCKETS,
                              registry=r)
        self.ttft_phase = Histogram("layersplit_time_to_first_token_phase_seconds",
                                    "request arrival to first token, by phase (parse, wait, "
                                    "tokenize, queue, slot, restore, prefill, emit: "
                                    "docs/server.md)", ["phase"], buckets=LATENCY_BUCKETS,
                                    registry=r)
        self.itl = Histogram("layersplit_inter_token_latency_seconds",
                             "time between streamed tokens", buckets=LATENCY_BUCKETS,
                             registry=r)
        self.prompt_tokens = Counter("layersplit_prompt_tokens", "prompt tokens received",
                                     registry=r)
        self.generated_tokens = Counter("layersplit_generation_tokens", "tokens generated",
                                        registry=r)
        self.decode_tok_s = Gauge("layersplit_decode_tokens_per_second",
                                  "decode speed of the last finished request", registry=r)
        self.queue = Gauge("layersplit_queue_depth", "requests waiting for the engine",
                           registry=r)
        self.running = Gauge("layersplit_running_requests", "requests in the running batch "
                             "(admitted or waiting for a KV slot)", registry=r)
        self.cache_hits = Counter("layersplit_prefix_cache_hits", "prefix-cache hits by tier",
                                  ["tier"], registry=r)
        self.cache_misses = Counter("layersplit_prefix_cache_misses", "prefix-cache misses",
                                    registry=r)
        self.cached_tokens = Counter("layersplit_prefix_cache_restored_tokens",
                                     "prompt tokens served from the prefix cache", registry=r)
        self.cache_bytes_written = Gauge("layersplit_prefix_cache_bytes_written",
                                         "bytes written to the disk tier", registry=r)
        self.cache_resident_hits = Counter("layersplit_prefix_cache_resident_hits",
                                           "RAM-tier hits served from KV blocks still in the "
                                           "device pool, with no copy", registry=r)
        self.acceptance = Histogram("layersplit_spec_acceptance_length",
                                    "mean tokens committed per speculative verify step, one "
                                    "observation per request",
                                    buckets=(1, 1.5, 2, 2.5, 3, 3.5, 4, 5, 6, 8, 12, 16),
                                    registry=r)
        self.spec_proposed = Counter("layersplit_spec_proposed_tokens", "draft tokens proposed, "
                                     "by position in the draft block", ["position"], registry=r)
        self.spec_accepted = Counter("layersplit_spec_accepted_tokens", "draft tokens the "
                                     "target kept, by position in the draft block",
                                     ["position"], registry=r)
        self.spec_verifies = Counter("layersplit_spec_verify_steps", "speculative verify steps",
                                     registry=r)
        self.spec_off_steps = Counter("layersplit_spec_off_steps", "decode steps of "
                                      "sequences that could speculate, run plainly by the "
                                      "speculation policy (spec_policy)", registry=r)
        self.spec_untapped_steps = Counter("layersplit_spec_untapped_steps", "of those, steps "
                                           "that sent the draft no feature rows (far from the "
                                           "policy's next round)", registry=r)
        self.spec_rounds_by_size = Counter("layersplit_spec_rounds", "verify steps, by the "
                                           "draft tokens they proposed (tree nodes or chain "
                                           "depth)", ["size"], registry=r)
        self.spec_size = Gauge("layersplit_spec_size", "draft tokens the speculation policy "
                               "chose last, by batch-size bucket (0: speculation off)",
                               ["batch"], registry=r)
        self.spec_probes = Gauge("layersplit_spec_policy_probes", "probes the speculation "
                                 "policy ran while speculation was off (since start)",
                                 registry=r)
        self.spec_skipped = Gauge("layersplit_spec_policy_skipped_probes", "probes the "
                                  "speculation policy did not run: priced from smaller "
                                  "batches' rounds, they would lose (since start)", registry=r)
        self.spec_switches = Gauge("layersplit_spec_policy_switches", "decisions of the "
                                   "speculation policy that changed the size or turned "
                                   "speculation on or off (since start)", registry=r)
        self.spec_draft_s = Counter("layersplit_spec_draft_seconds", "time spent waiting for "
                                    "draft proposals", registry=r)
        self.spec_verify_s = Counter("layersplit_spec_verify_seconds", "time spent in verify "
                                     "steps", registry=r)
        self.step_time = Histogram("layersplit_step_seconds", "one forward step through the "
                                   "shard chain, by kind", ["kind"], buckets=LATENCY_BUCKETS,
                                   registry=r)
        self.step_sequences = Histogram("layersplit_step_sequences", "sequences batched in one "
                                        "step", buckets=(1, 2, 4, 8, 16, 32, 64, 128),
                                        registry=r)
        self.shard_restarts = Counter("layersplit_shard_restarts",
                                      "restarts of the shard group after a failure", registry=r)
        self.up = Gauge("layersplit_ready", "1 when the engine serves requests", registry=r)
        self.model = Info("layersplit_model", "the served model, the dtype it computes in and "
                          "its shard count", registry=r)
        self.kv_usage = Gauge("layersplit_kv_cache_usage_ratio", "share of the shards' paged "
                              "KV pool's blocks held by sequences", registry=r)
        self.kv_host_usage = Gauge("layersplit_kv_host_usage_ratio", "share of the shards' "
                                   "host KV pool's blocks held by swapped-out sequences",
                                   registry=r)
        self.preemptions = Counter("layersplit_preemptions", "sequences preempted when the KV "
                                   "pool ran out, by how (swap: to host memory; reprefill: run "
                                   "again from their tokens)", ["kind"], registry=r)
        self._seen = (0, 0, None)  # (swapped_out, reprefills) last counted, of which batch

    def observe_batch(self, batcher) -> None:
        """The KV pools' use and the preemptions since the last call (`runtime.batching`'s
        `Batcher`; a new one after a restart of the shard group counts from 0)."""
        s, sched = batcher.stats, batcher.sched
        if sched.total_blocks:
            self.kv_usage.set(1 - sched.reclaimable_blocks / sched.total_blocks)
        host = batcher.host
        self.kv_host_usage.set(0.0 if host is None else 1 - host.free_blocks / host.num_blocks)
        swaps, reprefills, which = self._seen
        if which is not batcher:
            swaps = reprefills = 0
        self.preemptions.labels("swap").inc(s.swapped_out - swaps)
        self.preemptions.labels("reprefill").inc(s.reprefills - reprefills)
        self._seen = (s.swapped_out, s.reprefills, batcher)

    def observe_policy(self, policy) -> None:
        """The speculation policy's decisions (`runtime.spec_policy.SpecPolicy`; None: every
        step speculates)."""
        if policy is None:
            return
        for b, size in policy.stats.size.items():
            self.spec_size.labels(str(b)).set(size)
        self.spec_probes.set(policy.stats.probes)
        self.spec_skipped.set(policy.stats.skipped)
        self.spec_switches.set(policy.stats.switches)

    def observe_speculation(self, spec) -> None:
        """One request's `runtime.speculative.SpecStats`."""
        if spec.acceptance_length is not None:
            self.acceptance.observe(spec.acceptance_length)
        for j, (p, a) in enumerate(zip(spec.proposed_at, spec.accepted_at), start=1):
            self.spec_proposed.labels(str(j)).inc(p)
            self.spec_accepted.labels(str(j)).inc(a)
        self.spec_verifies.inc(spec.verifies)
        self.spec_off_steps.inc(spec.off_steps)
        self.spec_untapped_steps.inc(spec.untapped)
        for size, n in spec.sizes.items():
            self.spec_rounds_by_size.labels(str(size)).inc(n)
        self.spec_draft_s.inc(spec.draft_s)
        self.spec_verify_s.inc(spec.verify_s)
