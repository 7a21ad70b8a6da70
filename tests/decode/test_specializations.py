"""A new prompt length compiles no Triton kernel again.

Triton compiles one binary per specialization of a kernel's arguments: each int is specialized on being 1 or a
multiple of 16, each pointer on 16-byte alignment. A prefill's row count is its prompt length, and each generate
call sizes its ring from the prompt and max_new_tokens, so a kernel that specializes on either compiles again at
the first prompt whose length (or ring) falls in another class: ~0.2 s a kernel on the H200, which put 0.5-0.9 s
on the first new-length TTFT (docs/generation.md, "A new prompt length costs a cuDNN plan").

On the CPU the kernels run in Triton's interpreter, which does not specialize; the recorder below computes, for
every launch, the specialization the CUDA compiler would key on (Triton's own binder, for an sm_90 target) and
the test checks that prompts of other lengths add none. On a GPU it counts the compiled binaries instead.
"""

import collections

import pytest
import torch

import tigon
from tests.hf._tiny import tiny_model

# 48 is a multiple of 16, 47 and 45 odd, 46 even: every class of the rows, the tokens and the ring capacity
# (prompt + 1 or + 3) that the specializations distinguish.
WARM, NEW = 48, (47, 46, 45)


def _model(device):
    model = tiny_model("llama", attn_implementation="sdpa", max_position_embeddings=128).eval().to(device)
    model.generation_config.eos_token_id = None
    tigon.patch(model)
    return model


def _generate(model, p, new_tokens):
    ids = torch.randint(0, 131, (1, p), generator=torch.Generator().manual_seed(p)).to(model.device)
    tigon.generate(model, ids, max_new_tokens=new_tokens, cuda_graph=False)


@pytest.fixture
def cuda_specializations(monkeypatch):
    """Records (kernel name, specialization) of every interpreted Triton launch, as the CUDA compiler keys it."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction, create_function_from_signature

    backend = make_backend(GPUTarget("cuda", 90, 32))
    binders, seen = {}, []
    run = InterpretedFunction.run

    def recording(self, *args, grid=None, **kwargs):
        if id(self) not in binders:
            kept = ("do_not_specialize", "do_not_specialize_on_alignment")
            jit = JITFunction(self.fn, **{k: v for k, v in self.kwargs.items() if k in kept})
            binders[id(self)] = jit, create_function_from_signature(jit.signature, jit.params, backend)
        jit, binder = binders[id(self)]
        _, specialization, _ = binder(*args, **{k: v for k, v in kwargs.items() if k in jit.arg_names})
        seen.append((self.fn.__name__, tuple(map(str, specialization))))
        return run(self, *args, grid=grid, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", recording)
    return seen


def test_new_prompt_lengths_add_no_specialization(cuda_specializations):
    if torch.cuda.is_available():
        pytest.skip("the interpreter's launch recorder; on a GPU test_gpu_new_prompt_lengths_compile_nothing counts "
                    "the compiled binaries")
    model = _model("cpu")
    new_tokens = 3  # the prefill, then two decode steps over the new ring
    _generate(model, WARM, new_tokens)
    warm = set(cuda_specializations)
    assert {name for name, _ in warm} >= {"_rms_norm_fwd_kernel", "_rope_kv_write_kernel", "_glu_fwd_kernel"}
    for p in NEW:
        cuda_specializations.clear()
        _generate(model, p, new_tokens)
        added = collections.Counter(name for name, spec in set(cuda_specializations) - warm)
        assert not added, f"prompt {p}: new specializations of {dict(added)}"


def _compiled_binaries():
    """Compiled binaries per loaded Tigon kernel (Triton 3.x's JITFunction.device_caches), or None."""
    import sys

    from triton.runtime.jit import JITFunction

    counts, found = collections.Counter(), False
    for name, module in list(sys.modules.items()):
        if not name.startswith("tigon.") or module is None:
            continue
        for value in list(vars(module).values()):
            while hasattr(value, "fn") and not isinstance(value, JITFunction):
                value = value.fn
            caches = getattr(value, "device_caches", None) if isinstance(value, JITFunction) else None
            if caches is None:
                continue
            found = True
            for entry in caches.values():
                if not isinstance(entry, tuple) or not isinstance(entry[0], dict):
                    return None
                counts[f"{value.fn.__module__}.{value.fn.__name__}"] += len(entry[0])
    return counts if found else None


@pytest.mark.gpu
def test_gpu_new_prompt_lengths_compile_nothing():
    model = _model("cuda").to(torch.bfloat16)
    _generate(model, WARM, 3)
    before = _compiled_binaries()
    if before is None:
        pytest.skip("this Triton keeps its compiled kernels in another structure than JITFunction.device_caches")
    for p in NEW:
        _generate(model, p, 3)
        added = _compiled_binaries() - before
        assert not added, f"prompt {p}: new binaries of {dict(added)}"
