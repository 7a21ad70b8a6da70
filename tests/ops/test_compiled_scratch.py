"""The split-K decode ops inside a torch.compile graph take their scratch per call, outside it from the arena.

Eager calls (and Tigon's own captured decode step) use pinned buffers of the workspace arena: a stable address to
replay, counters left at zero between calls. A graph compiled with CUDA graphs (mode="reduce-overhead") warms up
inside its graphs' memory pool and refuses a tensor allocated there that outlives the call, which a pinned buffer's
first allocation would be ("tensors in the cudagraph pool not tracked as outputs", HF's static cache + compile over
a quantized model). So the custom op, the node torch.compile puts in its graph, allocates its scratch for the call.
Checked here on the interpreter (which splits K in 2 by default): the compiled call touches no pinned buffer and
gives the eager call's result bit for bit; on a GPU, HF's generate with its static cache under
mode="reduce-overhead" over a quantized model."""

import pytest
import torch

from tests.ops.test_decode_attention import _inputs
from tests.ops.test_quant_linear import _on, _weight, _x
from tigon import ops
from tigon.ops import _rolling_buffer as _ws
from tigon.ops.config import DecodeLinearConfig


def _pinned_calls(device) -> int:
    return _ws.workspace(device).stats()["pinned_calls"]


def _eager_then_compiled(device, fn, *args):
    """fn's eager result, its compiled result (dynamo over the custom op, fullgraph), and the pinned-buffer calls
    each made."""
    start = _pinned_calls(device)
    eager = fn(*args)
    eager_calls = _pinned_calls(device) - start
    compiled_fn = torch.compile(fn, backend="eager", fullgraph=True)
    start = _pinned_calls(device)
    compiled = compiled_fn(*args)
    return eager, eager_calls, compiled, _pinned_calls(device) - start


@pytest.mark.parametrize("kind, G, zeros", [("int4", 32, True), ("fp8", 32, False)])
def test_quant_linear(device, kind, G, zeros):
    qw = _on(_weight(kind, G, zeros, False, 40, 256, torch.bfloat16), device)
    x = _x(1, 256, dtype=torch.bfloat16).to(device)
    cfg = ops.QuantLinearConfig(block_n=32, block_k=64, split_k=2)
    with torch.no_grad():
        eager, eager_calls, compiled, compiled_calls = _eager_then_compiled(
            device, lambda x: ops.quant_linear(x, qw, config=cfg), x)
    assert eager_calls == 2 and compiled_calls == 0  # partials and counters: the arena's eagerly, none compiled
    assert torch.equal(eager, compiled)


def test_decode_linear(device):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 96, generator=g).to(device, torch.bfloat16)
    w = [torch.randn(n, 96, generator=g).to(device, torch.bfloat16) * 0.1 for n in (40, 24)]
    cfg = DecodeLinearConfig(16, 32, split_k=3)
    eager, eager_calls, compiled, compiled_calls = _eager_then_compiled(
        device, lambda x: ops.decode_linear(x, w, config=cfg), x)
    assert eager_calls == 2 and compiled_calls == 0
    assert torch.equal(eager, compiled)


def test_decode_attention(device):
    q, k, v, sp, qp = _inputs(torch.bfloat16, 64, 70, "wrapped", device=device)
    cfg = ops.DecodeAttentionConfig(n_splits=3)
    eager, eager_calls, compiled, compiled_calls = _eager_then_compiled(
        device, lambda q: ops.decode_attention(q, k, v, sp, qp, config=cfg), q)
    assert eager_calls == 1 and compiled_calls == 0
    assert torch.equal(eager, compiled)


@pytest.mark.gpu
def test_gpu_hf_static_cache_reduce_overhead_over_a_quantized_model():
    """HF's generate over its static cache, which compiles the forward itself on CUDA (CUDA graphs: its
    compile_config's mode "reduce-overhead"), on a tigon-quantized model: it runs (the pinned scratch made it fail)
    and each step's logits are those of the same generate without the compile, within bf16 rounding (inductor
    fuses the norms and rotary in fp32: other roundings), fed the same tokens."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from tests.hf._tiny import tiny_model
    from tigon import quantize

    model = tiny_model("llama", attn_implementation="sdpa", max_position_embeddings=256).eval()
    model = quantize(model.to("cuda", torch.bfloat16), "int4", group_size=32)
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    ids = torch.randint(1, 131, (1, 40), generator=torch.Generator().manual_seed(0)).cuda()
    kw = dict(max_new_tokens=8, do_sample=False, cache_implementation="static", output_logits=True,
              return_dict_in_generate=True)
    with torch.no_grad():
        want = model.generate(ids, disable_compile=True, **kw)
        for _ in range(2):  # the warm-up call, then a replay
            got = model.generate(ids, **kw)
            assert got.sequences.shape == want.sequences.shape
            same = int((got.sequences[0, 40:] == want.sequences[0, 40:]).cumprod(0).sum())  # steps fed the same
            for a, b in zip(got.logits[:same + 1], want.logits[:same + 1]):
                assert (a.float() - b.float()).abs().max() <= 0.05 * b.float().abs().max()
            assert same >= 1  # the first token, from the same prompt
