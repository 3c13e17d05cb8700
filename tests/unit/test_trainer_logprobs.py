"""The LM head in token chunks (trainer/logprobs.py) against the full-logits computation it replaces (the
head on every window row at once, fp32 log_softmax and gather, entropy from the same logits): the same
log-probs, entropy and gradients, on the tiny Qwen3-MoE with LoRA and on a 32k-vocabulary head, where the
peak memory of forward + backward is measured (every tensor storage the ops allocate, alive until freed)."""

import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from rl.core import algo
from rl.tiny import make_tiny
from trainer.config import LoraConfig
from trainer.logprobs import NO_LOGITS, FinalHidden, head_logprobs
from trainer.lora import apply_lora


class PeakBytes(TorchDispatchMode):
    """Peak bytes of the tensor storages created inside the mode (op outputs; a storage counts from its
    creation until Python frees it: storages keep one Python object for their lifetime)."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self._refs = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                storage = t.untyped_storage()
                key = id(storage)
                if key in self._refs and self._refs[key]() is storage:
                    continue
                n = storage.nbytes()
                self.live += n
                self.peak = max(self.peak, self.live)
                self._refs[key] = weakref.ref(storage, lambda _, n=n: self._freed(n))
        return out

    def _freed(self, n):
        self.live -= n


def full_logits(head, hidden, targets, with_entropy=True):
    """What the trainer computed before: the whole [tokens, vocab] logits in fp32 at once."""
    logits = head(hidden).float()
    logp = torch.log_softmax(logits, dim=-1).gather(-1, targets[..., None]).squeeze(-1)
    entropy = algo.token_entropy(logits.detach()) if with_entropy else None
    return logp, entropy


@pytest.fixture(scope="module")
def policy():
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(make_tiny("qwen3_moe"), dtype=torch.float32)
    model = apply_lora(base, LoraConfig(rank=4, alpha=8.0), seed=0, init_lora_weights=False)
    return base, model


@pytest.mark.parametrize("chunk", [0, 1, 7, 64])
def test_chunked_head_equals_full_logits_on_the_tiny_moe(policy, chunk):
    base, model = policy
    g = torch.Generator().manual_seed(chunk)
    vocab = base.config.vocab_size
    ids = torch.randint(5, vocab, (3, 17), generator=g)
    mask = torch.ones_like(ids)
    mask[2, :4] = 0  # left padding
    window = 11
    targets = torch.randint(5, vocab, (3, window), generator=g)
    params = [p for p in model.parameters() if p.requires_grad]

    out = model(input_ids=ids, attention_mask=mask, logits_to_keep=window, use_cache=False)
    want, want_ent = full_logits(lambda x: x, out.logits, targets)
    want_grads = torch.autograd.grad(want.sum(), params)

    held = FinalHidden(base.model)
    with held.taken():
        model(input_ids=ids, attention_mask=mask, logits_to_keep=NO_LOGITS, use_cache=False)
        hidden = held.value[:, -window:]
    assert held.value is None
    got, got_ent = head_logprobs(base.lm_head, hidden, targets, chunk, with_entropy=True)
    got_grads = torch.autograd.grad(got.sum(), params)

    assert got.shape == want.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    torch.testing.assert_close(got_ent, want_ent, rtol=0, atol=1e-6)
    # Gradients: the same terms, summed in another order (per chunk, then the chunks): fp32 rounding apart.
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    with torch.no_grad():  # log-probs for the old policy: no checkpointing, same values
        nograd, _ = head_logprobs(base.lm_head, hidden, targets, chunk, with_entropy=False)
    torch.testing.assert_close(nograd, want.detach(), rtol=0, atol=1e-6)


def _head_32k(tokens: int):
    """A 32k-vocabulary head (width 64), hidden states with grad, and targets: the memory tests' case."""
    torch.manual_seed(0)
    width, vocab = 64, 32768
    head = torch.nn.Linear(width, vocab, bias=False).requires_grad_(False)
    hidden = torch.randn(1, tokens, width, requires_grad=True)
    return head, hidden, torch.randint(0, vocab, (1, tokens)), vocab


def test_chunked_head_peak_memory_is_a_fraction_of_the_full_logits_at_32k_vocab():
    tokens, chunk = 2048, 256
    head, hidden, targets, vocab = _head_32k(tokens)

    def run(fn):
        hidden.grad = None
        with PeakBytes() as mem:
            logp, entropy = fn(head, hidden, targets)
            (logp.sum() + 0.0 * entropy.sum()).backward()
        return mem.peak, logp.detach(), entropy, hidden.grad.clone()

    full_peak, full_lp, full_ent, full_grad = run(full_logits)
    chunk_peak, lp, ent, grad = run(lambda h, x, t: head_logprobs(h, x, t, chunk, with_entropy=True))
    logits_bytes = tokens * vocab * 4
    assert full_peak >= 2 * logits_bytes  # logits and log_softmax at least (measured, not assumed)
    # A chunk's few [chunk, vocab] fp32 temporaries (logits, log_softmax, softmax), whatever the tokens:
    # 110 MB against 814 MB for the full logits here.
    assert chunk_peak < 4 * chunk * vocab * 4, (chunk_peak, full_peak)
    assert chunk_peak < full_peak / 5, (chunk_peak, full_peak)
    torch.testing.assert_close(lp, full_lp, rtol=0, atol=1e-6)
    torch.testing.assert_close(ent, full_ent, rtol=0, atol=1e-6)
    torch.testing.assert_close(grad, full_grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("temperature,top_p", [(0.6, 1.0), (1.3, 0.8), (1.0, 0.35)])
def test_logprobs_are_of_the_distribution_vllm_samples_from(temperature, top_p):
    """The reference is vLLM's own sampler code (the processed log-probs a rollout returns: logits in fp32
    over temperature, its top-p mask, log_softmax); targets are drawn from that distribution."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    torch.manual_seed(0)
    tokens, width, vocab = 96, 32, 500
    head = torch.nn.Linear(width, vocab, bias=False).requires_grad_(False)
    head.weight.mul_(10)  # peaked rows: the nucleus at top_p 0.35-0.8 holds tens of tokens, not hundreds
    hidden = torch.randn(1, tokens, width, requires_grad=True)

    with torch.no_grad():
        logits = head(hidden[0]).float() / temperature
        p = torch.full((tokens,), top_p) if top_p < 1 else None
        ref = apply_top_k_top_p_pytorch(logits, None, p).log_softmax(-1)
        targets = torch.multinomial(ref.exp(), 1, generator=torch.Generator().manual_seed(1)).T  # [1, tokens]
    kept = torch.isfinite(ref).sum(-1).float()
    if top_p < 1:
        assert kept.mean() < vocab / 4  # the nucleus truncates: the test could tell it from the full softmax

    got, entropy = head_logprobs(
        head, hidden, targets, 7, with_entropy=True, temperature=temperature, top_p=top_p
    )
    want = ref.gather(-1, targets.T).T
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    torch.testing.assert_close(entropy[0], torch.special.entr(ref.exp()).sum(-1), rtol=0, atol=1e-5)
    untempered, _ = head_logprobs(head, hidden.detach(), targets, 7, with_entropy=False)
    assert (untempered - want).abs().max() > 0.05  # what the trainer scored without the sampler's settings

    # Gradients: those of the log-softmax over vLLM's nucleus (none reaches a logit outside it).
    (grad,) = torch.autograd.grad(got.sum(), hidden)
    nucleus = (head(hidden[0]).float() / temperature).masked_fill(ref.isinf(), -torch.inf).log_softmax(-1)
    (want_grad,) = torch.autograd.grad(nucleus.gather(-1, targets.T).sum(), hidden)
    torch.testing.assert_close(grad, want_grad, rtol=1e-4, atol=1e-5)


def test_a_target_just_outside_the_trainers_nucleus_keeps_a_finite_logprob():
    """A sampled token on the nucleus' edge in the engine's arithmetic may fall just past it in the trainer's:
    its log-prob is taken over the nucleus with it, never -inf (a ratio of 0 or an infinite k3)."""
    logits = torch.tensor([[4.0, 3.0, 0.0, -1.0]])
    head = torch.nn.Identity()
    top_p = 0.5  # the nucleus is token 0 alone (p = 0.71)
    (inside,), _ = head_logprobs(head, logits, torch.tensor([0]), 0, False, top_p=top_p)
    (edge,), _ = head_logprobs(head, logits, torch.tensor([1]), 0, False, top_p=top_p)
    assert inside == 0.0  # the whole nucleus
    assert torch.isfinite(edge) and -1.5 < edge < -1.0  # log(e^3 / (e^4 + e^3))


def test_the_nucleus_adds_the_planners_12_bytes_a_logit_at_peak():
    """rl/plan.py counts a top-p nucleus as 12 bytes a logit of a chunk over the plain head's peak."""
    from rl.plan import _logits_bytes

    chunk = 256
    head, hidden, targets, vocab = _head_32k(1024)

    def peak(top_p):
        hidden.grad = None
        with PeakBytes() as mem:
            logp, _ = head_logprobs(head, hidden, targets, chunk, with_entropy=True, top_p=top_p)
            logp.sum().backward()
        return mem.peak

    extra = peak(0.9) - peak(1.0)
    planned = _logits_bytes(chunk, vocab, 4, nucleus=True) - _logits_bytes(chunk, vocab, 4)
    assert 0.9 * planned <= extra <= 1.05 * planned, (extra, planned)


def test_float32_head_keeps_the_matmul_unrounded_with_the_model_dtype_backward():
    """model.head_dtype float32: the logits of a bf16 head are the fp32 product of its bf16 operands (not
    rounded to bf16: at logits near 30 a bf16 step is 0.125), and the gradient to the hidden states is the
    bf16 head's (the fp32 gradient rounded to bf16, times the bf16 weight)."""
    from trainer.logprobs import head_logits

    g = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(64, 300, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        head.weight.copy_(torch.randn(300, 64, generator=g) * 0.6)
    hidden = torch.randn(40, 64, generator=g).to(torch.bfloat16).requires_grad_(True)

    exact = hidden.detach().double() @ head.weight.detach().double().t()
    assert exact.abs().max() > 16  # logits where a bf16 step is 0.125 or more
    unrounded = head_logits(head, hidden, float32=True)
    rounded = head_logits(head, hidden, float32=False)
    assert unrounded.dtype == rounded.dtype == torch.float32
    torch.testing.assert_close(unrounded.double(), exact, rtol=0, atol=1e-4)
    assert (rounded.double() - exact).abs().max() > 1e-2  # what the rounding costs, which float32 avoids

    upstream = torch.randn(unrounded.shape, generator=g)
    (grad,) = torch.autograd.grad(unrounded, hidden, upstream)
    assert grad.dtype == torch.bfloat16
    torch.testing.assert_close(grad, upstream.to(torch.bfloat16) @ head.weight.detach(), rtol=0, atol=0)
    (rounded_grad,) = torch.autograd.grad(rounded, hidden, upstream)
    torch.testing.assert_close(grad, rounded_grad, rtol=0, atol=0)

    with pytest.raises(TypeError, match="model.head_dtype=model"):
        head_logits(torch.nn.Embedding(300, 64).to(torch.bfloat16), hidden, float32=True)
