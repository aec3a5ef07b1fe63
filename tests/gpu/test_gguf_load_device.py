"""A GGUF file's block types dequantized on the GPU at load (`GGUFFile._read_on`: the stored
bytes go to the device, torch does gguf's float32 operations there, one kernel each) give the
weights a CPU load gives, bit for bit, in float32 and bfloat16; the default model's too where
it is fetched."""

from __future__ import annotations

import pytest
import torch
from layersplit.shards.checkpoint import load_layer_range, open_checkpoint
from layersplit.shards.tiny import write_tiny_checkpoint, write_tiny_gguf

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _same_on_both(path, end: int, dtype: torch.dtype) -> None:
    ckpt = open_checkpoint(path)
    cpu = load_layer_range(ckpt, 0, end, dtype=dtype).state_dict()
    gpu = load_layer_range(ckpt, 0, end, dtype=dtype, device="cuda:0").state_dict()
    assert cpu.keys() == gpu.keys()
    for k, v in cpu.items():
        assert torch.equal(gpu[k].cpu().view(torch.uint8), v.view(torch.uint8)), k


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_device_load_is_the_cpu_load(tmp_path, qtype, dtype):
    folder = write_tiny_checkpoint(tmp_path / "m", "llama", num_layers=2)
    _same_on_both(write_tiny_gguf(folder, tmp_path / f"m-{qtype}.gguf", qtype), 2, dtype)


def test_default_model_device_load_is_the_cpu_load(default_model):
    _same_on_both(default_model, 30, torch.float32)
