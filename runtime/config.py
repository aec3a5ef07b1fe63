"""Runtime configuration: one frozen dataclass, loaded from TOML and overridden by CLI flags.

Every key has a CLI flag of the same name (`max_context` -> `--max-context`). Unknown keys and
values of the wrong type are rejected with a message naming the key and the file.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


CACHE_RAM_DEFAULT_GB = 4.0  # `cache_ram_gb` when unset
HEARTBEAT_TIMEOUT_S = 5.0  # remote shards: silence after which one is declared lost


class ConfigError(ValueError):
    """A bad config file or flag; the message says which key and what to change."""


LAUNCHERS = ("local", "ray")
RAY_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
RAY_KEYS = ("ray_address", "ray_strategy", "ray_resources", "ray_nodes")


def _field(default: Any, help: str, **kw: Any) -> Any:
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: default, metadata={"help": help, **kw})
    return dataclasses.field(default=default, metadata={"help": help, **kw})


WARMUP = ("auto", "on", "off")  # `warmup`
SPEC_SAMPLING = ("auto", "off", "coupled", "rejection", "guesses")  # `spec_sampling`
SPEC_POLICY = ("auto", "measured", "on")  # `spec_policy`
# (docs/speculative.md)


CPU_PREFILL_CHUNK = 256  # prefill_chunk's default on CPU shards
GPU_PREFILL_CHUNK = 2048  # and where a shard is on a GPU
AUTO_CHUNK = "_auto_prefill_chunk"  # set on a config whose prefill_chunk was 0 (auto)


@dataclasses.dataclass(frozen=True)
class RuntimeConfig:
    model: str = _field("default", "HF folder or .gguf file; 'default' = SmolLM2-135M-Instruct; "
                                   "random:NAME = seeded random weights of configs/models/NAME")
    random_seed: int = _field(0, "seed of random:NAME weights")
    devices: tuple[str, ...] = _field(("cpu", "cpu"), "one device per shard: cpu, cuda:N")
    split: tuple[int, ...] | str | None = _field(None, "layers per shard, e.g. 15,15 (sums "
                                                       "to the model's layer count), or 'auto' "
                                                       "(balanced by weight bytes); default: "
                                                       "even")
    layers: tuple[str, ...] | None = _field(None, "explicit ranges per shard, e.g. 0:10,10:30")
    weights: tuple[float, ...] | None = _field(None, "relative share of layers per shard")
    dtype: str = _field("auto", "float32, bfloat16, float16; auto = float32 where every "
                                "shard is a CPU, else the checkpoint's half type (docs/models.md, "
                                "Dtypes)")
    weight_format: str = _field("auto", "GGUF weights: quantized = kept in their blocks on the "
                                        "device (linear layers, embedding, LM head), "
                                        "dequantize = to the run dtype at load; auto = "
                                        "dequantize while the quantized kernels are slower "
                                        "than the dequantized weights (docs/models.md)")
    max_context: int = _field(4096, "most tokens of one sequence (prompt + output); a limit "
                                    "per request, not a preallocation (the KV pool is shared)")
    prefill_chunk: int = _field(0, "tokens per prefill step (also the prefix-cache block); "
                                   f"0 = {GPU_PREFILL_CHUNK} when a shard is on a GPU, else "
                                   f"{CPU_PREFILL_CHUNK}")
    max_seqs: int = _field(8, "sequences decoded at once (they share the KV pool); "
                              "generate uses 1 unless set")
    kv_block: int = _field(16, "tokens per block of the paged KV pool")
    kv_blocks: int = _field(0, "blocks in each shard's KV pool (the same on every shard); "
                               "0 = from kv_cache_gb, or max_seqs x max_context tokens")
    kv_cache_gb: float = _field(0.0, "GiB of KV pool per shard (each shard's pool holds as many "
                                     "blocks as the most loaded shard fits); 0 = unset")
    kv_host_blocks: int | None = _field(None, "blocks in each shard's host-memory KV pool, where "
                                              "a preempted sequence's blocks wait (swap "
                                              "preemption); 0 = off (re-prefill); default: "
                                              "from kv_host_gb")
    kv_host_gb: float | None = _field(None, "GiB of host-memory KV pool per shard (pinned on "
                                            "GPUs); 0 = off; default: a quarter of the device "
                                            "pool's blocks, at most 4 GiB; not with "
                                            "kv_host_blocks or host_cache_gb")
    host_cache_gb: float | None = _field(None, "GiB of host memory per shard shared by the host "
                                               "KV pool (swapped-out sequences) and the prefix "
                                               "cache's RAM tier, under one eviction policy: "
                                               "swapped blocks stay, snapshots are evicted least "
                                               "recently used to make room; 0 = neither; "
                                               "replaces kv_host_gb, kv_host_blocks and "
                                               "cache_ram_gb (not with them); default: those "
                                               "two budgets side by side")
    micro_batches: int = _field(0, "groups of sequences in flight through the shard chain at "
                                   "once; 0 = auto (the number of shards); at most max_seqs "
                                   "and 4")
    transport: tuple[str, ...] = _field(("auto",), "per edge (or one for all): auto, "
                                                   "cuda-ipc, shm, zmq")
    prefix_cache: bool = _field(True, "reuse the KV of cached prompt prefixes")
    cache_ram_gb: float | None = _field(None, "host memory for KV snapshots (RAM tier), GiB, "
                                              "all shards together; default 4; not with "
                                              "host_cache_gb")
    kv_cache_dir: str | None = _field(None, "directory of the disk tier (survives restarts)")
    kv_cache_max_gb: float = _field(64.0, "size cap of the disk tier, GiB")
    keep_answers: int = _field(16, "keep a finished answer in the prefix cache (the "
                                   "conversation up to its end of turn, as the next turn's "
                                   "prompt starts) when at least this many of its tokens are "
                                   "not cached yet; 0 = never (docs/prefix-cache.md, answers)")
    keep_answers_delay_ms: float = _field(0.0, "a server keeps a finished answer once this "
                                               "long has passed with no request continuing "
                                               "it; a request that continues it sooner "
                                               "prefills it with its own new tokens and keeps "
                                               "it (no wait behind the keep); 0 = at once")
    draft: str = _field("auto", "speculative draft: a DFlash folder, any smaller model with the "
                                "target's tokenizer (classic), 'default' (the bundled draft of "
                                "the default model), 'none'; auto = the bundled draft when the "
                                "default model runs on GPUs")
    draft_device: str | None = _field(None, "device of the draft process (default: the first "
                                            "shard's; launcher ray: the first shard's or cpu, "
                                            "on the first shard's node)")
    spec_block: int | None = _field(None, "rows per verify step: the last token and up to "
                                          "spec_block - 1 draft tokens (default: the draft's "
                                          "block size; 5 for a classic draft)")
    spec_tree: int | None = _field(None, "draft tokens of a verify step's token tree, where the "
                                         "draft has a tree shape (default: its whole tree; 0: "
                                         "a chain of spec_block - 1)")
    spec_max_seqs: int = _field(1, "sequences of the batch that feed the draft and speculate at "
                                   "once (the draft keeps a context for each; the others "
                                   "decode plainly in the same steps)")
    spec_required: bool = _field(False, "fail requests when the draft fails (default: go on "
                                        "without speculation, logged)")
    spec_push: bool = _field(True, "the draft hands the proposals it prepares from a verdict "
                                   "to the first shard itself, which holds the next step for "
                                   "them (where the first and the last shard feed the draft); "
                                   "off: the coordinator asks for each and sends it on")
    spec_policy: str = _field("auto", "when a step speculates, and how many draft tokens: "
                                      "measured (each step chooses, from measured acceptance "
                                      "and the measured cost of a round and of a plain step, "
                                      "per batch size: the tree size or chain depth, or no "
                                      "speculation), on (every step speculates with the whole "
                                      "tree or chain: benchmarks, tests), auto (measured where "
                                      "a GPU runs the target or the draft, else on: CPU verify "
                                      "steps run row by row, for exactness, never for speed)")
    spec_sampling: str = _field("auto", "a DFlash draft's proposals for a sampled request: "
                                        "auto (coupled under a measured spec_policy; else off "
                                        "for a DFlash draft where a GPU runs the target or the "
                                        "draft, where sampled speculation measured slower "
                                        "than plain decoding; else coupled), "
                                        "off (sampled requests decode plainly), "
                                           "coupled (drawn from its distribution with the "
                                           "target's own noise; output = plain decoding's "
                                           "tokens), rejection (drawn and sent with their "
                                           "distribution q, kept with probability min(1, p/q): "
                                           "the target's distribution, not plain's very "
                                           "tokens), guesses (its top-k)")
    cuda_graphs: bool = _field(True, "capture each GPU shard's decode step in CUDA graphs")
    torch_compile: bool = _field(True, "fuse each GPU layer's decode step with torch.compile")
    draft_compile: bool = _field(True, "compile a GPU DFlash draft's step with torch.compile (a "
                                       "faster step; its import and trace add ~8 s to a start "
                                       "on an H100); `generate` runs it uncompiled unless set")
    deterministic: bool = _field(False, "batch- and verify-invariant decoding on GPUs: every "
                                        "decode step and every verify row runs alone through "
                                        "the one-row decode step, so a sequence's tokens depend "
                                        "neither on its batch nor on speculation (the cost: no "
                                        "batched decode steps, verify rows one at a time)")
    decode_ahead: bool = _field(True, "with one shard, send each decode step before the token "
                                      "it takes is back: the shard takes it on the device, "
                                      "which then never waits for the coordinator's round "
                                      "trip (a step past a stop token is computed and dropped)")
    graph_bucket: int = _field(256, "KV length granularity of captured decode graphs")
    capture_at_start: bool = _field(True, "capture every decode, verify and batched step graph "
                                    "a request may replay (each KV-length bucket up to "
                                    "max_context) while the shards start, so that no request "
                                    "waits for a capture or a compilation (GPU shards; "
                                    "false: each on first use)")
    warmup: str = _field("auto", "serve: before saying ready, run a request of each kind the "
                                 "server runs (prefill chunks, decode, speculative verify, "
                                 "sampled, batched, a restore from the disk cache), so that "
                                 "compilation and autotuning happen then, not in the first "
                                 "request: auto (when a shard or the draft is on a GPU: on "
                                 "CPUs nothing compiles), on, off (`runtime.warmup`)")
    spin_ms: float | None = _field(None, "ms a process busy-waits for the next message before "
                                         "sleeping (default: 20 with GPUs, 0 on CPU)")
    threads: int | None = _field(None, "torch threads per CPU shard (default: cores / shards)")
    shard_addresses: tuple[str, ...] = _field((), "per shard: '' to start it here, or the "
                                                  "tcp:// address of a `layersplit shard`")
    local_addresses: str = _field("ipc", "how local shards listen: ipc (unix sockets) or tcp "
                                         "(loopback)")
    fork_cpu_processes: bool = _field(True, "start CPU shard and draft processes forked from "
                                            "one that imported torch once (~2.5 s of CPU "
                                            "less each; false: a fresh interpreter each)")
    secret_file: str | None = _field(None, "file holding the shared secret for remote shards "
                                           "(else $LAYERSPLIT_SECRET)")
    launcher: str = _field("local", "how shards are started: local (processes here) or ray "
                                    "(actors placed on a Ray cluster; pip install "
                                    "'layersplit[ray]')")
    ray_address: str = _field("auto", "launcher ray: the cluster to join: auto (the one "
                                      "$RAY_ADDRESS or `ray start` on this machine names), "
                                      "HOST:PORT, or local (start a one-node cluster here)")
    ray_strategy: str = _field("PACK", "launcher ray: placement-group strategy: PACK, SPREAD, "
                                       "STRICT_PACK or STRICT_SPREAD")
    ray_resources: tuple[str, ...] = _field((), "launcher ray: per shard, '' or a custom "
                                                "resource its node must have (it picks the "
                                                "node, e.g. host_a,host_b,host_b)")
    ray_nodes: tuple[str, ...] = _field((), "launcher ray: per shard, '' or the Ray node id "
                                            "to place it on")
    host: str = _field("127.0.0.1", "serve: address to bind (loopback unless told otherwise)")
    port: int = _field(8000, "serve: TCP port")
    api_key: str | None = _field(None, "serve: require 'Authorization: Bearer KEY' on /v1/*")
    served_model_name: str | None = _field(None, "serve: the model id clients use "
                                                  "(default: from the model path)")
    restart_on_failure: bool = _field(True, "serve: restart the shard group after a shard "
                                            "failure (else exit)")
    grace_s: float = _field(30.0, "serve: seconds in-flight requests get on SIGTERM")
    chat_template: str | None = _field(None, "a Jinja chat template file that replaces the "
                                             "checkpoint's (e.g. configs/templates/"
                                             "chatml-tools.jinja: ChatML with Hermes tool calls)")
    max_logprobs: int = _field(20, "serve: most top alternatives a request may ask per token "
                                   "(top_logprobs, completions' logprobs)")
    max_body_mb: float = _field(16.0, "serve: largest request body in MiB (413 beyond it, "
                                      "before it is read)")
    startup_timeout: float = _field(600.0, "seconds to wait for shards to load and report")
    step_timeout: float = _field(600.0, "seconds a step may take before the shard is declared "
                                        "hung while no step of its kind has come back yet "
                                        "(warm-up), and for cache operations")
    step_deadline_min: float = _field(10.0, "a step is declared hung (the run is torn down) "
                                            "once it has taken this long and 20 x what steps "
                                            "of its kind took per row so far")
    heartbeat_timeout: float = _field(HEARTBEAT_TIMEOUT_S, "seconds a remote shard may leave "
                                                           "zmq heartbeats unanswered before "
                                                           "it is declared lost (local shards "
                                                           "are watched as processes); 0: off")

    def __post_init__(self) -> None:
        if self.max_context < 2:
            raise ConfigError(f"max_context={self.max_context}: must be at least 2")
        if self.prefill_chunk < 0:
            raise ConfigError(f"prefill_chunk={self.prefill_chunk}: must be at least 1 (0: "
                              "auto)")
        if self.prefill_chunk == 0:  # on a GPU a 32K prompt in 2048-token chunks took 1.076 x
            # one piece (H100, 2026-11-26, bench/RESULTS.md L2, with cuDNN's attention past 4K
            # keys, the default then); smaller chunks cost host time
            gpu = any(str(d).startswith("cuda") for d in self.devices)
            object.__setattr__(self, "prefill_chunk",
                               GPU_PREFILL_CHUNK if gpu else CPU_PREFILL_CHUNK)
            # (not a field: `replace` sees it and decides again for the new devices)
            object.__setattr__(self, AUTO_CHUNK, True)
        if self.spec_max_seqs < 0:
            raise ConfigError(f"spec_max_seqs={self.spec_max_seqs}: must be at least 0")
        if self.warmup not in WARMUP:
            raise ConfigError(f"warmup={self.warmup!r}: must be one of {', '.join(WARMUP)}")
        if self.keep_answers < 0:
            raise ConfigError(f"keep_answers={self.keep_answers}: must be at least 0 (0: never)")
        if not 0 <= self.keep_answers_delay_ms <= 60_000:
            raise ConfigError(f"keep_answers_delay_ms={self.keep_answers_delay_ms}: must be "
                              f"from 0 (at once) to 60000 (a minute)")
        if self.spec_policy not in SPEC_POLICY:
            raise ConfigError(f"spec_policy={self.spec_policy!r}: must be one of "
                              f"{', '.join(SPEC_POLICY)}")
        if self.spec_sampling not in SPEC_SAMPLING:
            raise ConfigError(f"spec_sampling={self.spec_sampling!r}: must be one of "
                              f"{', '.join(SPEC_SAMPLING)}")
        if self.chat_template is not None and not Path(self.chat_template).is_file():
            raise ConfigError(f"chat_template={self.chat_template}: no such file")
        if not self.max_body_mb > 0:
            raise ConfigError(f"max_body_mb={self.max_body_mb}: must be more than 0")
        if self.max_logprobs < 0:
            raise ConfigError(f"max_logprobs={self.max_logprobs}: must be at least 0")
        if not 1 <= self.kv_block <= 4096:
            raise ConfigError(f"kv_block={self.kv_block}: use 1..4096 tokens")
        if self.kv_blocks < 0 or self.kv_cache_gb < 0:
            raise ConfigError(f"kv_blocks={self.kv_blocks}, kv_cache_gb={self.kv_cache_gb}: "
                              "must be >= 0 (0 = unset)")
        if self.kv_blocks and self.kv_cache_gb:
            raise ConfigError("set kv_blocks or kv_cache_gb, not both")
        if self.kv_host_blocks is not None and self.kv_host_blocks < 0:
            raise ConfigError(f"kv_host_blocks={self.kv_host_blocks}: must be >= 0 (0 = off)")
        if self.kv_host_gb is not None and not 0 <= self.kv_host_gb < float("inf"):
            raise ConfigError(f"kv_host_gb={self.kv_host_gb}: must be a finite number >= 0 "
                              "(0 = off)")
        if self.kv_host_blocks is not None and self.kv_host_gb is not None:
            raise ConfigError("set kv_host_blocks or kv_host_gb, not both")
        self._check_host_memory()
        if not 1 <= self.max_seqs <= 512:
            raise ConfigError(f"max_seqs={self.max_seqs}: use 1..512")
        if not 0 <= self.micro_batches <= 4:
            raise ConfigError(f"micro_batches={self.micro_batches}: use 0 (auto) to 4")
        if self.local_addresses not in ("ipc", "tcp"):
            raise ConfigError(f"local_addresses={self.local_addresses!r}: use 'ipc' or 'tcp'")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ConfigError(f"dtype={self.dtype!r}: use auto, float32, bfloat16 or float16")
        if self.weight_format not in ("auto", "dequantize", "quantized"):
            raise ConfigError(f"weight_format={self.weight_format!r}: use auto, dequantize or "
                              "quantized")
        if self.threads is not None and self.threads < 1:
            raise ConfigError(f"threads={self.threads}: must be at least 1")
        if not self.devices:
            raise ConfigError("devices is empty: list one device per shard, e.g. cpu,cpu")
        if self.spec_block is not None and self.spec_block < 2:
            raise ConfigError(f"spec_block={self.spec_block}: must be at least 2 (the last "
                              "token and one draft token)")
        if self.spec_tree is not None and self.spec_tree < 0:
            raise ConfigError(f"spec_tree={self.spec_tree}: must be at least 0 (0: no tree)")
        if not self.draft:
            raise ConfigError("draft is empty: give a path, 'default', 'auto' or 'none'")
        for key in ("step_timeout", "startup_timeout", "step_deadline_min"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"{key}={getattr(self, key)}: must be more than 0 seconds")
        if self.heartbeat_timeout < 0:
            raise ConfigError(f"heartbeat_timeout={self.heartbeat_timeout}: must be 0 (off) "
                              "or more seconds")
        self._check_launcher()

    def _check_host_memory(self) -> None:
        for key in ("cache_ram_gb", "host_cache_gb"):
            value = getattr(self, key)
            if value is not None and not 0 <= value < float("inf"):
                raise ConfigError(f"{key}={value}: must be a finite number >= 0")
        if self.host_cache_gb is None:
            return
        given = [k for k in ("kv_host_gb", "kv_host_blocks", "cache_ram_gb")
                 if getattr(self, k) is not None]
        if given:
            raise ConfigError(f"host_cache_gb and {' and '.join(given)}: host_cache_gb is the "
                              "one host-memory budget of both the host KV pool and the RAM "
                              f"tier; set host_cache_gb alone, or {', '.join(given)} without it")

    @property
    def ram_tier_gb(self) -> float | None:
        """The RAM tier's own cap (GiB, all shards), or None under host_cache_gb (the shared
        host pool caps it, `runtime.host_pool`)."""
        if self.host_cache_gb is not None:
            return None
        return CACHE_RAM_DEFAULT_GB if self.cache_ram_gb is None else self.cache_ram_gb

    def _check_launcher(self) -> None:
        if self.launcher not in LAUNCHERS:
            raise ConfigError(f"launcher={self.launcher!r}: use {' or '.join(LAUNCHERS)}")
        if self.launcher != "ray":
            given = [k for k in RAY_KEYS if getattr(self, k) != FIELDS[k].default]
            if given:
                raise ConfigError(f"{given[0]} applies to launcher = 'ray' only (the launcher "
                                  f"is {self.launcher!r})")
            return
        if self.shard_addresses:
            raise ConfigError("shard_addresses and launcher = 'ray' do not mix: Ray places and "
                              "starts every shard (leave shard_addresses empty)")
        if self.ray_strategy not in RAY_STRATEGIES:
            raise ConfigError(f"ray_strategy={self.ray_strategy!r}: use one of "
                              f"{', '.join(RAY_STRATEGIES)}")
        for key in ("ray_resources", "ray_nodes"):
            given = getattr(self, key)
            if given and len(given) != len(self.devices):
                raise ConfigError(f"{key} has {len(given)} entries for {len(self.devices)} "
                                  "devices: give one per shard ('' for none)")
        if not self.ray_address:
            raise ConfigError("ray_address is empty: give auto, HOST:PORT or local")

    def replace(self, **changes: Any) -> RuntimeConfig:
        """This config with `changes`; an automatic `prefill_chunk` (0) stays automatic, decided
        again for the new config's devices (dataclasses.replace would copy the chunk it chose
        for the old ones)."""
        if getattr(self, AUTO_CHUNK, False):
            changes.setdefault("prefill_chunk", 0)
        return dataclasses.replace(self, **changes)


FIELDS = {f.name: f for f in dataclasses.fields(RuntimeConfig)}
_HINTS = typing.get_type_hints(RuntimeConfig)


def _base_types(hint: Any) -> tuple[Any, bool]:
    """(inner type, optional) of a field annotation."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return args[0], True
    return hint, False


def _coerce(key: str, value: Any, source: str) -> Any:
    if key == "split" and value in ("auto", ["auto"], ("auto",)):
        return "auto"  # balanced by weight bytes (`runtime.placement.bytes_split`)
    hint, optional = _base_types(_HINTS[key])
    if value is None:
        if optional:
            return None
        raise ConfigError(f"{source}: {key} must not be empty")
    origin = typing.get_origin(hint)
    if origin is tuple:
        elem = typing.get_args(hint)[0]
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",")] if value.strip() else []
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{source}: {key} must be a list, got {type(value).__name__}")
        return tuple(_scalar(key, v, elem, source) for v in value)
    return _scalar(key, value, hint, source)


def _scalar(key: str, value: Any, typ: Any, source: str) -> Any:
    try:
        if typ is bool:
            if isinstance(value, bool):
                return value
            if str(value).lower() in ("1", "true", "yes", "on"):
                return True
            if str(value).lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(value)
        if typ is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError(value)
            return int(value)
        if typ is float:
            if isinstance(value, bool):
                raise ValueError(value)
            return float(value)
        if typ is str:
            if not isinstance(value, (str, int, float)) or isinstance(value, bool):
                raise ValueError(value)
            return str(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{source}: {key}={value!r} is not a valid {typ.__name__}") from None
    raise ConfigError(f"{source}: {key} has an unsupported type")


def from_mapping(values: Mapping[str, Any], source: str,
                 base: RuntimeConfig | None = None) -> RuntimeConfig:
    unknown = sorted(set(values) - set(FIELDS))
    if unknown:
        raise ConfigError(
            f"{source}: unknown key{'s' if len(unknown) > 1 else ''} {', '.join(unknown)} "
            f"(known: {', '.join(FIELDS)})"
        )
    changes = {k: _coerce(k, v, source) for k, v in values.items()}
    try:
        return (base or RuntimeConfig()).replace(**changes)
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None


def load_toml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    try:
        with open(p, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{p}: config file not found") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{p}: not valid TOML ({e})") from None
    # sections are for readability only: [placement] devices = ... is the key `devices`
    flat: dict[str, Any] = {}
    for k, v in data.items():
        if isinstance(v, dict):
            for k2, v2 in v.items():
                if k2 in flat:
                    raise ConfigError(f"{p}: key {k2} appears twice")
                flat[k2] = v2
        else:
            if k in flat:
                raise ConfigError(f"{p}: key {k} appears twice")
            flat[k] = v
    return flat


def add_flags(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    """One flag per config key (values parsed and validated by `from_mapping`)."""
    group = parser.add_argument_group("runtime configuration (each also a config-file key)")
    group.add_argument("--config", help="TOML config file; flags override its keys")
    for name, f in FIELDS.items():
        if name in skip:
            continue
        group.add_argument(f"--{name.replace('_', '-')}", dest=f"cfg_{name}", default=None,
                           help=f.metadata.get("help"))


def explicit_keys(args: argparse.Namespace) -> set[str]:
    """The config keys the command line or its config file set."""
    keys = {k[4:] for k, v in vars(args).items() if k.startswith("cfg_") and v is not None}
    if getattr(args, "config", None):
        keys |= set(load_toml(args.config))
    return keys


def from_args(args: argparse.Namespace) -> RuntimeConfig:
    cfg = RuntimeConfig()
    if getattr(args, "config", None):
        cfg = from_mapping(load_toml(args.config), str(args.config))
    flags = {k[4:]: v for k, v in vars(args).items() if k.startswith("cfg_") and v is not None}
    return from_mapping(flags, "command line", base=cfg) if flags else cfg
