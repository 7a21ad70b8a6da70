"""The per-call cos/sin table of the rotary module (tigon.decode.rotary_table) and its use in tigon.generate."""

import importlib
import inspect
import re

import pytest
import torch

from tests.hf._tiny import tiny_model
from tigon.decode import DecodeSettings
from tigon.decode import loop as gen
from tigon.decode.rotary_table import _FORWARD_FORMS, _layer_types, cached_rotary

GEMMA3 = dict(layer_types=["sliding_attention", "full_attention"])  # two inv_freq: a table each
CASES = [("llama", {}), ("qwen3", {}), ("gemma3_text", GEMMA3), ("llama", dict(partial_rotary_factor=0.5)),
         ("llama", dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 16}))]
IDS = ["llama", "qwen3", "gemma3", "llama-partial", "llama3-scaling"]
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _model(model_type, **overrides):
    model = tiny_model(model_type, attn_implementation="sdpa", **overrides).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def _ids(b, t, seed=1):
    return torch.randint(0, 131, (b, t), generator=torch.Generator().manual_seed(seed))


def _kinds(rot):
    return list(rot.rope_type) if isinstance(rot.rope_type, dict) else [None]


def _call(fn, x, pid, kind):
    return fn(x, pid) if kind is None else fn(x, pid, kind)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("model_type,overrides", CASES, ids=IDS)
def test_table_rows_equal_the_module_bit_for_bit(model_type, overrides, dtype, device):
    model = _model(model_type, **overrides).to(device=device, dtype=dtype)
    rot = model.model.rotary_emb
    original = type(rot).forward.__get__(rot)
    x = torch.zeros(1, dtype=dtype, device=device)
    g = torch.Generator().manual_seed(0)
    length = 300
    with cached_rotary(model, length) as tables:
        assert tables == len(_kinds(rot)) and "forward" in rot.__dict__
        for kind in _kinds(rot):
            for shape in [(1, 1), (3, 1), (2, 7), (1, length)]:
                pid = torch.randint(0, length, shape, generator=g).to(device)
                got, want = _call(rot, x, pid, kind), _call(original, x, pid, kind)
                for a, b in zip(got, want):
                    assert a.dtype == b.dtype and a.shape == b.shape == (*shape, b.shape[-1])
                    assert torch.equal(a, b)
            # Another dtype, or positions that are not [B, T] integers: the module's own forward.
            pid = torch.arange(5, device=device)[None]
            for args in [(x.double(), pid), (x, pid.float())]:
                for a, b in zip(_call(rot, *args, kind), _call(original, *args, kind)):
                    assert a.dtype == b.dtype and torch.equal(a, b)
    assert "forward" not in rot.__dict__


def test_one_gather_and_positions_past_the_table():
    model = _model("llama")
    rot = model.model.rotary_emb
    with cached_rotary(model, 8):
        x, pid = torch.zeros(1), torch.tensor([[3], [7]])
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            cos, sin = rot(x, pid)
        ops = [e.name for e in prof.events() if e.cpu_parent is None]
        # One gather for cos and sin; the rest are views.
        assert ops.count("aten::index_select") == 1 and set(ops) == {"aten::index_select", "aten::reshape",
                                                                      "aten::select", "aten::view"}
        assert cos.is_contiguous() and sin.is_contiguous()
        with pytest.raises(RuntimeError, match="out of"):  # index_select checks: never a read outside the table
            rot(x, torch.tensor([[8]]))


@pytest.mark.parametrize("model_type,overrides", CASES[:3], ids=IDS[:3])
def test_generate_tokens_with_and_without_the_table(model_type, overrides, monkeypatch):
    model = _model(model_type, **overrides)
    rot = model.model.rotary_emb
    ids = _ids(2, 6)
    calls = []
    forward = type(rot).forward
    monkeypatch.setattr(type(rot), "forward", lambda self, *a, **k: calls.append(1) or forward(self, *a, **k))
    ref = model.generate(ids, max_new_tokens=4, do_sample=False)
    calls.clear()
    got, stats = gen.generate(model, ids, max_new_tokens=4, return_stats=True)
    assert stats["rotary_tables"] == len(_kinds(rot)) and len(calls) == len(_kinds(rot))  # the table build only
    calls.clear()
    off, stats = gen.generate(model, ids, max_new_tokens=4, return_stats=True,
                              settings=DecodeSettings(rotary_table=False))
    assert stats["rotary_tables"] == 0 and len(calls) == 4 * len(_kinds(rot))  # prefill + 3 decode steps
    assert torch.equal(got, off) and torch.equal(got, ref)
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_generate_left_padding_and_hf_attention():
    model = _model("llama")
    ids = _ids(2, 7)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    got, stats = gen.generate(model, ids, attention_mask=mask, max_new_tokens=6, attention="hf", return_stats=True)
    assert stats["rotary_tables"] == 1 and torch.equal(got, ref)


def test_restored_after_an_exception():
    model = _model("llama")
    rot = model.model.rotary_emb
    before = dict(vars(rot))
    with pytest.raises(RuntimeError, match="boom"):
        with cached_rotary(model, 16):
            raise RuntimeError("boom")
    assert vars(rot) == before

    steps = []

    def fail_at_step_3(module, args, output):
        steps.append(1)
        if len(steps) == 3:
            raise RuntimeError("step 3")

    handle = model.lm_head.register_forward_hook(fail_at_step_3)
    with pytest.raises(RuntimeError, match="step 3"):
        gen.generate(model, _ids(1, 5), max_new_tokens=6)
    handle.remove()
    assert vars(rot) == before and model.config._attn_implementation == "sdpa"
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_left_alone():
    # A dynamic rope type: inv_freq follows the sequence length, so no table; generate still equals HF.
    model = _model("llama", rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    rot = model.model.rotary_emb
    assert rot.rope_type == "dynamic" and _layer_types(rot) is None
    ids = _ids(1, 6)
    got, stats = gen.generate(model, ids, max_new_tokens=70, attention="hf", return_stats=True)  # past 64
    assert stats["rotary_tables"] == 0 and torch.equal(got, model.generate(ids, max_new_tokens=70, do_sample=False))
    with cached_rotary(model, 16) as tables:
        assert tables == 0 and "forward" not in rot.__dict__
    # longrope, an unknown class, an instance-level forward of someone else's, a missing inv_freq.
    model = _model("llama")
    rot = model.model.rotary_emb
    rot.rope_type = "longrope"
    assert _layer_types(rot) is None
    rot.rope_type = "default"
    assert _layer_types(rot) == [None]
    rot.forward = rot.forward
    assert _layer_types(rot) is None
    del rot.forward
    rot.__class__ = type("CustomRotaryEmbedding", (type(rot),), {})
    assert _layer_types(rot) is None
    rot.__class__ = type("LlamaRotaryEmbedding", (type(rot),), {})  # the name alone, not transformers' class
    assert _layer_types(rot) is None
    gemma = _model("gemma3_text", **GEMMA3).model.rotary_emb
    assert _layer_types(gemma) == ["full_attention", "sliding_attention"]
    del gemma.full_attention_inv_freq
    assert _layer_types(gemma) is None


def _source(cls):
    src = inspect.getsource(inspect.unwrap(cls.forward))
    return re.sub(r"\s+", " ", re.sub(r"#.*", "", src)).strip()


def test_listed_classes_compute_the_elementwise_forward():
    """Each listed class's forward is, to the letter, one of the forms of transformers 5.17 read for this module:
    Llama's and Qwen3's (the casts in another order), Gemma-3's (per layer type), and Olmo-2/3's (fp32 out)."""
    forms = {}
    for model_type, name in [("llama", "Llama"), ("qwen3", "Qwen3"), ("gemma3", "Gemma3"), ("olmo2", "Olmo2"),
                             ("olmo3", "Olmo3")]:
        modeling = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
        forms[_source(getattr(modeling, f"{name}RotaryEmbedding"))] = name
    modules = {"Qwen2Moe": "qwen2_moe", "Qwen3Moe": "qwen3_moe", "SeedOss": "seed_oss",
               "HunYuanDenseV1": "hunyuan_v1_dense"}
    for name, per_type in _FORWARD_FORMS.items():
        prefix = name.removesuffix("RotaryEmbedding")
        model_type = modules.get(prefix, prefix.lower())
        modeling = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
        src = _source(getattr(modeling, name))
        assert src in forms, name
        assert ("layer_type" in src.split(":")[0]) == per_type, name


def test_a_store_reuses_the_tables_until_the_frequencies_change():
    # tigon.generate's store (tigon.decode.kept): the modules found once, each module's tables reused while long
    # enough and built from the same inv_freq (storage and in-place version) and attributes.
    model = _model("llama")
    rotary = model.model.rotary_emb
    store, seen = {}, []
    positions = torch.arange(5)[None]
    for length, change in ((12, None), (8, None), (20, None), (20, "inplace"), (20, "scaling")):
        if change == "inplace":
            rotary.inv_freq.mul_(1.5)
        elif change == "scaling":
            rotary.attention_scaling = 0.5
        with cached_rotary(model, length, store=store) as count:
            assert count == 1
            seen.append(store["tables"][id(rotary)][2][None])
            got = rotary(torch.empty(0), positions)
        assert "forward" not in rotary.__dict__  # the class forward is back after the block
        want = rotary(torch.empty(0), positions)
        assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert store["modules"] == [rotary]
    # 12 built, 8 reuses it, 20 builds a longer one, an in-place inv_freq change and a new scaling rebuild
    assert seen[1] is seen[0] and seen[2] is not seen[1] and seen[3] is not seen[2] and seen[4] is not seen[3]
