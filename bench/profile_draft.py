"""Where a speculative round's time goes, in one process (no IPC): the draft's proposal and the
target's verify step, wall time and GPU time.

    python bench/profile_draft.py [--draft default] [--target default] [--kv 400]

Loads the draft as the draft process does (`load_proposer`: fused projections, the captured
step) and the whole target as one shard would (fused, CUDA graphs). Times, each a median over
`--steps`:
- the proposal, and its parts: the kept rows' move (`commit`), the captured step (wall, and GPU
  time by CUDA events), the tree's instantiation;
- the target's one-row decode step and its verify step of the draft's tree (and of a chain of
  the same rows, for the mask's cost), each with the sync a shard's result needs;
then prints the torch profiler's kernel table of the proposal.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from layersplit.draft.proposer import DFlashProposer, load_proposer
from layersplit.draft.tree_shape import instantiate, width
from layersplit.runtime.model_store import resolve_model
from layersplit.shards.checkpoint import load_layer_range, open_checkpoint
from layersplit.shards.executor import RangeExecutor
from layersplit.shards.fused import fuse_projections
from torch.profiler import ProfilerActivity, profile


def _ms(xs: list[float]) -> float:
    return round(statistics.median(xs) * 1e3, 3)


def _wall(fn, steps: int) -> list[float]:
    out = []
    for _ in range(steps):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def profile_proposal(p: DFlashProposer, pos: int, steps: int) -> dict[str, float]:
    dev = p.device
    p.features.normal_()
    p.logits(0, 5, pos - p.block_size, p.block_size - 1)  # context before pos in the cache
    shape = p.cfg.spec_tree
    nodes = len(shape) if shape else 0
    res: dict[str, float] = {}
    res["propose_ms"] = _ms(_wall(lambda: p.propose(0, 5, pos, p.block_size - 1, tree=nodes,
                                                    kept=[0, 1, 3]), steps))
    res["commit_ms"] = _ms(_wall(lambda: p.commit(0, pos, [0, 1, 3]), steps))
    cuda = dev.type == "cuda"
    start, end = (torch.cuda.Event(enable_timing=True) if cuda else None for _ in range(2))
    gpu, wall = [], []
    for _ in range(steps):
        t = time.perf_counter()
        if cuda:
            start.record()
        out = p.logits(0, 5, pos, p.block_size - 1)
        if cuda:
            end.record()
            end.synchronize()
            gpu.append(start.elapsed_time(end) / 1e3)
        wall.append(time.perf_counter() - t)
    res["step_wall_ms"] = _ms(wall)
    if cuda:
        res["step_gpu_ms"] = _ms(gpu)
    k = min(width(shape), out.shape[-1]) if shape else 1
    top = out.topk(k, dim=-1).indices.tolist()
    if shape:
        res["instantiate_ms"] = _ms(_wall(lambda: instantiate(shape, top, nodes,
                                                              p.block_size - 1), steps))
    if cuda:
        res.update(kernels("proposal", lambda: p.propose(0, 5, pos, p.block_size - 1,
                                                         tree=nodes), dev))
    return res


def kernels(name: str, fn, dev: torch.device, rows: int = 25) -> dict[str, float]:
    """GPU busy time and kernels of one call of `fn` (a mean over 10), and the kernel table."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            fn()
        torch.cuda.synchronize(dev)
    ka = prof.key_averages()
    print(f"--- {name}")
    print(ka.table(sort_by="self_device_time_total", row_limit=rows, max_name_column_width=90))
    return {f"{name}_gpu_busy_ms": round(sum(e.self_device_time_total for e in ka) / 1e4, 3),
            f"{name}_kernels": round(sum(e.count for e in ka if e.self_device_time_total > 0)
                                     / 10)}


def profile_verify(target: str, device: str, pos: int, parents: list[int] | None,
                   steps: int) -> dict[str, float]:
    ckpt = open_checkpoint(resolve_model(target))
    cfg = ckpt.config
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    model = load_layer_range(ckpt, 0, cfg.num_layers, dtype, device)
    if device.startswith("cuda"):
        fuse_projections(model)
    ex = RangeExecutor(model, pos + 128, device=device, static_decode=True)
    ex.run(torch.randint(0, 1000, (pos,)), 0)
    one = torch.tensor([5])
    res: dict[str, float] = {}

    def decode() -> None:
        int(ex.run(one, pos).argmax())

    n = 1 + (len(parents) if parents else 7)
    rows = torch.randint(0, 1000, (n,))
    chain = list(range(n - 1))

    def verify(tree: list[int] | None) -> None:
        ex.run(rows, pos, all_logits=True, verify=True, tree=tree).argmax(-1).tolist()

    for _ in range(5):
        decode(), verify(chain), verify(parents)
    res["decode_ms"] = _ms(_wall(decode, steps))
    res[f"verify_chain{n}_ms"] = _ms(_wall(lambda: verify(chain), steps))
    if parents:
        res[f"verify_tree{n}_ms"] = _ms(_wall(lambda: verify(parents), steps))
    if device.startswith("cuda"):
        res.update(kernels("decode", decode, torch.device(device), 40))
        res.update(kernels(f"verify{n}", lambda: verify(parents or chain), torch.device(device),
                           40))
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--draft", default="default")
    ap.add_argument("--target", default="default")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--kv", type=int, default=400, help="context length at the profiled step")
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    if args.draft == "default":
        args.draft = str(Path(__file__).resolve().parents[1] / "draft/weights/smollm2-135m-dflash")
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    p = load_proposer(args.draft, resolve_model(args.target), args.device, dtype, args.kv + 256)
    assert isinstance(p, DFlashProposer), "a DFlash draft"
    p.warm_up()
    res = profile_proposal(p, args.kv, args.steps)
    if getattr(p, "compiled", False):
        p._use_compiled(False)
        res.update({f"eager_{k}": v for k, v in profile_proposal(p, args.kv, args.steps).items()})
        p._use_compiled(True)
    shape = p.cfg.spec_tree
    parents = None
    if shape:
        out = p.logits(0, 5, args.kv, p.block_size - 1)
        top = out.topk(width(shape), dim=-1).indices.tolist()
        _, parents = instantiate(shape, top, len(shape), p.block_size - 1)
    del p
    res.update(profile_verify(args.target, args.device, args.kv, parents, args.steps))
    print(res)


if __name__ == "__main__":
    main()
