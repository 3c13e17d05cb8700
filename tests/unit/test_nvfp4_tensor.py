"""The packed NVFP4 weight (trainer/nvfp4_tensor.py) against what `sparkrl dequantize` writes: the tiny
Qwen3-MoE and the tiny Muse, quantized with `sparkrl quantize`, read packed row by row the way the trainer
reads them (sharded_load.CheckpointRows), fused expert banks included. No fakes; no process group (the
FSDP2 side is tests/integration/test_trainer_nvfp4_base.py)."""

import pytest
import torch

from rl.quantize import quantize
from rl.tiny import make_tiny
from trainer.checkpoint_io import dequantize_checkpoint
from trainer.nvfp4_tensor import NVFP4Weight, dequantize
from trainer.sharded_load import CheckpointRows, build_empty_model, checkpoint_name
from trainer.testing import checkpoint_tensors


def _fused(twin, name):
    """The model parameter `name` from the dequantized twin's per-expert tensors (transformers' fusion)."""
    prefix, _, param = name.rpartition(".")
    n = 1 + max(int(k.split(".")[len(prefix.split("."))]) for k in twin if k.startswith(prefix + "."))
    if param == "down_proj":
        return torch.stack([twin[f"{prefix}.{e}.down_proj.weight"] for e in range(n)])
    return torch.stack(
        [torch.cat([twin[f"{prefix}.{e}.{p}.weight"] for p in ("gate_proj", "up_proj")]) for e in range(n)]
    )


@pytest.fixture(scope="module", params=["qwen3_moe", "muse"])
def checkpoints(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    q = quantize(make_tiny(request.param), root / "nvfp4")
    return request.param, q, dequantize_checkpoint(q, root / "bf16")


def test_packed_weights_dequantize_to_the_twin_bit_for_bit(checkpoints):
    arch, q, dq = checkpoints
    twin = checkpoint_tensors(dq)
    model = build_empty_model(str(q), torch.float32)
    packed = {}
    with CheckpointRows(q) as ckpt:
        for name, p in model.named_parameters():
            source = checkpoint_name(name)
            if ckpt.is_packed(source):
                assert ckpt.packed_shape(source) == tuple(p.shape), source
                packed[source] = (p.shape, ckpt.packed_rows(source, 0, p.shape[0]))
            else:  # what the checkpoint keeps unquantized: norms, routers, embeddings, lm_head, g_proj
                assert not name.endswith(("q_proj.weight", "down_proj", "gate_up_proj")), name
    kinds = {s.rsplit(".", 1)[-1] if "experts" in s else s.rsplit(".", 2)[-2] for s in packed}
    want_kinds = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj"}
    if arch == "muse":
        want_kinds |= {"pooler", "unpooler"}
    assert want_kinds <= kinds, kinds
    for source, (shape, triple) in packed.items():
        w = NVFP4Weight(triple["packed"], triple["scale"], triple["global_scale"], shape, torch.float32)
        want = _fused(twin, source) if source.endswith(("gate_up_proj", "down_proj")) else twin[source]
        got = w.dequantize(torch.bfloat16)
        assert got.dtype == want.dtype == torch.bfloat16 and torch.equal(got, want), source
        assert torch.equal(w.dequantize(), want.float()), source  # the compute dtype: the twin's, cast
        if w.is_bank:  # one global scale an expert: dequantizing the bank = dequantizing each expert
            for e in (0, shape[0] - 1):
                one = dequantize(w.packed[e], w.scale[e], w.global_scale[e : e + 1], torch.bfloat16)
                assert torch.equal(one, want[e])


def test_the_packed_weight_shards_on_rows_like_a_tensor(checkpoints):
    """The ops FSDP2's sharding runs on a parameter (chunk, new_zeros, narrow, copy_, view(-1), empty_like,
    detach) keep the packed triple aligned with the rows: a rank's shard dequantizes to its rows."""
    _, q, _ = checkpoints
    model = build_empty_model(str(q), torch.float32)
    with CheckpointRows(q) as ckpt:
        names = [checkpoint_name(n) for n, _ in model.named_parameters()]
        bank = next(n for n in names if n.endswith("gate_up_proj"))
        linear = next(n for n in names if n.endswith("q_proj.weight"))
        for source in (bank, linear):
            shape = ckpt.packed_shape(source)
            t = ckpt.packed_rows(source, 0, shape[0])
            w = NVFP4Weight(t["packed"], t["scale"], t["global_scale"], shape, torch.float32)
            full = w.dequantize()
            chunks = torch.chunk(w, 2, dim=0)
            assert [c.shape[0] for c in chunks] == [shape[0] // 2] * 2
            for i, c in enumerate(chunks):
                assert isinstance(c, NVFP4Weight)
                assert torch.equal(c.dequantize(), full[i * shape[0] // 2 : (i + 1) * shape[0] // 2])
            padded = w.new_zeros((shape[0] // 2, *shape[1:]))
            padded.narrow(0, 0, shape[0] // 2).copy_(chunks[1])
            assert torch.equal(padded.dequantize(), chunks[1].dequantize())
            assert padded.view(-1).shape == (padded.numel(),)
            empty = torch.empty_like(padded, device="cpu")
            assert isinstance(empty, NVFP4Weight) and empty.shape == padded.shape
            assert empty.packed.data_ptr() != padded.packed.data_ptr()
            assert padded.detach().packed.data_ptr() == padded.packed.data_ptr()
            b = w.nbytes_packed()
            assert b == w.numel() // 2 + w.numel() // 16 + 4 * t["global_scale"].numel()
            with pytest.raises(NotImplementedError, match="NVFP4Weight"):
                w + 1.0
            with pytest.raises(NotImplementedError, match="dim 1"):
                torch.chunk(w, 2, dim=1)


def test_fsdp_all_gather_extension_dequantizes_the_gathered_layer(checkpoints):
    """fsdp_pre_all_gather's inputs, concatenated on dim 0 as FSDP's all-gather does over ranks, give to
    fsdp_post_all_gather the whole weight in the compute dtype; the second call refills `out`."""
    _, q, _ = checkpoints
    with CheckpointRows(q) as ckpt:
        model = build_empty_model(str(q), torch.float32)
        names = [checkpoint_name(n) for n, _ in model.named_parameters()]
        for source in (next(n for n in names if n.endswith("down_proj")), names[1]):
            if not ckpt.is_packed(source):
                source = next(n for n in names if n.endswith("o_proj.weight"))
            shape = ckpt.packed_shape(source)
            t = ckpt.packed_rows(source, 0, shape[0])
            w = NVFP4Weight(t["packed"], t["scale"], t["global_scale"], shape, torch.float32)
            shards = torch.chunk(w, 2, dim=0)
            gathered = [s.fsdp_pre_all_gather(None, shape, None, None, None) for s in shards]
            inputs = [torch.cat(parts) for parts in zip(*[g[0] for g in gathered])]
            # one input (FSDP2's one-rank path copies only the first): each row's bytes side by side
            assert len(inputs) == 1 and inputs[0].dtype == torch.uint8 and inputs[0].shape[0] == shape[0]
            weight, inner = shards[0].fsdp_post_all_gather(inputs, gathered[0][1], torch.bfloat16)
            assert weight.dtype == torch.bfloat16 and torch.equal(weight, w.dequantize(torch.bfloat16))
            assert inner[0] is weight
            out = torch.zeros_like(weight)
            assert shards[0].fsdp_post_all_gather(inputs, gathered[0][1], torch.bfloat16, out=out) is None
            assert torch.equal(out, weight)
