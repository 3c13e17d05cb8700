"""The Triton NVFP4 dequantization kernel (trainer/nvfp4_kernel.py) against compressed-tensors' path, bit for
bit, run by Triton's interpreter on CPU tensors (the same kernel source the GPU compiles; the interpreter is
chosen when Triton is imported, so the checks run in a process of their own with TRITON_INTERPRET=1).
Every packed byte value, every finite FP8 block scale, per-expert global scales, BF16 and FP32 outputs, and
the strided slice of FSDP's gathered bytes that `fsdp_post_all_gather` dequantizes into its `out`."""

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

SCRIPT = textwrap.dedent(
    """
    import torch
    from trainer import nvfp4_kernel, nvfp4_tensor
    from trainer.nvfp4_tensor import NVFP4Weight, dequantize

    def bits(t):
        return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)

    def reference(packed, scale, g, dtype):
        nvfp4_tensor.use_implementation("torch")
        try:
            return dequantize(packed, scale, g, dtype)
        finally:
            nvfp4_tensor.use_implementation("triton")

    def check(packed, scale, g, dtype, label):
        assert nvfp4_kernel.available(packed, dtype), label
        got = dequantize(packed, scale, g, dtype)
        want = reference(packed, scale, g, dtype)
        assert got.dtype == want.dtype == dtype and got.shape == want.shape, label
        assert torch.equal(bits(got), bits(want)), (label, int((bits(got) != bits(want)).sum()))

    gen = torch.Generator().manual_seed(0)
    # every byte: 256 rows of one repeated byte value; every finite e4m3 scale: a scale per block
    scale_bytes = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)
    packed = torch.arange(256, dtype=torch.uint8).repeat_interleave(8 * 4).reshape(256, 32)  # [256, in/2]
    scale = scale_bytes[torch.randint(0, len(scale_bytes), (256, 4), generator=gen)].view(torch.float8_e4m3fn)
    for dtype in (torch.bfloat16, torch.float32):
        check(packed, scale, torch.tensor([0.37]), dtype, f"linear {dtype}")

    E, O, C = 5, 24, 96
    packed = torch.randint(0, 256, (E, O, C // 2), dtype=torch.uint8, generator=gen)
    scale = scale_bytes[torch.randint(0, len(scale_bytes), (E, O, C // 16), generator=gen)]
    scale = scale.view(torch.float8_e4m3fn)
    g = torch.rand(E, generator=gen) * 3000 + 1e-3
    for dtype in (torch.bfloat16, torch.float32):
        check(packed, scale, g, dtype, f"bank {dtype}")

    # FSDP's path: two shards' gathered rows (packed, scales and global scales side by side, so the packed
    # bytes are a strided slice), dequantized fresh and then refilled into `out`
    w = NVFP4Weight(packed, scale, g, (E, O, C), torch.bfloat16)
    shards = torch.chunk(w, 2, dim=0)
    pre = [s.fsdp_pre_all_gather(None, w.shape, None, None, None) for s in shards]
    inputs = [torch.cat(parts) for parts in zip(*[p[0] for p in pre])]
    weight, _ = shards[0].fsdp_post_all_gather(inputs, pre[0][1], torch.bfloat16)
    want = reference(packed, scale, g, torch.bfloat16)
    assert torch.equal(bits(weight), bits(want))
    out = torch.zeros_like(weight)
    assert shards[0].fsdp_post_all_gather(inputs, pre[0][1], torch.bfloat16, out=out) is None
    assert torch.equal(bits(out), bits(want))
    print("KERNEL OK")
    """
)


def test_the_kernel_gives_the_reference_bits():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, cwd=root, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0 and "KERNEL OK" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-4000:]


def test_without_a_gpu_or_the_interpreter_the_reference_path_serves():
    """On CPU tensors (no interpreter in this process) the kernel declines and dequantize() is the
    reference, so CPU training never depends on Triton."""
    import torch

    from trainer import nvfp4_kernel

    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.fail("this process runs Triton's interpreter: the check needs a plain process")
    packed = torch.zeros((4, 8), dtype=torch.uint8)
    assert not nvfp4_kernel.available(packed, torch.bfloat16)
