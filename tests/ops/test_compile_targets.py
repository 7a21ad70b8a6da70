"""Every Triton kernel of tigon.ops compiles, to a cubin, for each architecture Tigon supports: sm_80 (A100),
sm_86 (A10, RTX 3090), sm_89 (L4, L40S, RTX 4090) and sm_90 (H100, H200), without a GPU.

A subprocess without TRITON_INTERPRET (the kernels are then Triton's compiled JITFunctions) runs the launchers on
CPU tensors with `JITFunction.run` replaced by a recorder, so each launch's arguments are the launcher's own.
The constexprs a launcher picks from the device (tiles, warps, PDL) are then set as on a GPU of the target, from
the launchers' own rules (called with a stand-in CUDA device), and each launch goes through Triton's own binder
and `triton.compile` for an explicit `GPUTarget`, ptxas included (it ships with Triton's wheel). A kernel must
also fit the target's shared memory per block, which a launch would otherwise refuse.

The default set compiles every kernel at the dispatch's usual launches for all four targets; TIGON_COMPILE_MATRIX
=full adds the other variants (dtypes, flags, the measured H200 picks) for all four (docs/testing.md)."""

import importlib
import json
import os
import subprocess
import sys
import time
import types

import pytest
import torch

TARGETS = (80, 86, 89, 90)
# Shared memory a block may opt into (cudaDevAttrMaxSharedMemoryPerBlockOptin), per compute capability.
SMEM_OPTIN = {80: 166912, 86: 101376, 89: 101376, 90: 232448}
_CUDA = types.SimpleNamespace(type="cuda", index=0)  # what the launchers' device rules read


def _launches(call):
    """[(kernel, args, kwargs)] of the Triton launches `call()` makes, none of them run."""
    from triton.runtime.jit import JITFunction

    got = []
    run = JITFunction.run
    JITFunction.run = lambda self, *args, grid, warmup, **kwargs: got.append((self, args, kwargs))
    try:
        with torch.no_grad():
            call()
    finally:
        JITFunction.run = run
    return got


def _cases(full: bool, cc: int = 90):
    """(name, call, gpu) triples: `call()` makes the launches on CPU tensors (quant_linear's as the dispatch picks them
    on a GPU of compute capability cc); `gpu(kernel name, kwargs, cc)` gives the constexprs and options that differ
    on a GPU of compute capability cc, as the dispatch picks them."""
    from tigon import ops
    from tigon.ops.config import DecodeAttentionConfig, DecodeLinearConfig
    from tigon.ops.losses import _engine

    # the modules, not the functions of the same names that tigon.ops exports
    cross_entropy, decode_attention, decode_linear, decode_linear_picks, moe, swiglu = (importlib.import_module(
        f"tigon.ops.{m}") for m in ("cross_entropy", "decode_attention", "decode_linear", "decode_linear_picks", "moe",
                                    "swiglu"))

    bf16, dtypes = torch.bfloat16, (torch.bfloat16, torch.float16, torch.float32) if full else (torch.bfloat16,)
    cases = []

    def add(name, call, gpu=lambda kernel, kw, cc: {}):
        cases.append((name, call, gpu))

    def rand(*shape, dtype=bf16):
        return torch.randn(*shape).to(dtype)

    # rms_norm: one row a program (H 4096, a decode step's rows: PDL from sm_90) and tiles of short rows (H 128)
    for dt in dtypes:
        for casting in ("llama", "gemma", "none") if full else ("llama",):
            def norm(dt=dt, casting=casting):
                x = rand(4, 4096, dtype=dt).requires_grad_()
                w = rand(4096, dtype=dt).requires_grad_()
                with torch.enable_grad():
                    ops.rms_norm(x, w, casting_mode=casting).sum().backward()
                x, r = rand(64, 128, dtype=dt).requires_grad_(), rand(64, 128, dtype=dt).requires_grad_()
                w = rand(128, dtype=dt).requires_grad_()
                with torch.enable_grad():
                    sum(t.float().sum() for t in ops.add_rms_norm(x, r, w, casting_mode=casting)).backward()
            add(f"rms_norm-{dt}-{casting}", norm)

    for dt in dtypes:
        def layer(dt=dt):
            x = rand(8, 4096, dtype=dt).requires_grad_()
            w, b = rand(4096, dtype=dt).requires_grad_(), rand(4096, dtype=dt).requires_grad_()
            with torch.enable_grad():
                ops.layer_norm(x, w, b).sum().backward()
        add(f"layer_norm-{dt}", layer)

    for dt in dtypes:
        for rd in (128, 64) if full else (128,):  # rd < D: a partial rotary (HAS_PASS)
            def rope(dt=dt, rd=rd):
                q, k = rand(1, 32, 4, 128, dtype=dt).requires_grad_(), rand(1, 8, 4, 128, dtype=dt).requires_grad_()
                cos, sin = rand(1, 4, rd), rand(1, 4, rd)
                with torch.enable_grad():
                    sum(t.float().sum() for t in ops.apply_rope(q, k, cos, sin)).backward()
            add(f"rope-{dt}-rd{rd}", rope)

    for dt in dtypes:
        def qk(dt=dt):
            q, k = rand(1, 4, 32, 128, dtype=dt).requires_grad_(), rand(1, 4, 8, 128, dtype=dt).requires_grad_()
            wq, wk = rand(128, dtype=dt).requires_grad_(), rand(128, dtype=dt).requires_grad_()
            with torch.enable_grad():
                sum(t.float().sum() for t in ops.qk_norm_rope(q, k, wq, wk, rand(1, 4, 128), rand(1, 4, 128))
                    ).backward()
        add(f"qk_norm_rope-{dt}", qk)

    def glu_tiles(kernel, kw, cc, elem_bytes, rows, cols):
        block_m, block_n, warps = swiglu._tiles(_CUDA, elem_bytes, rows, cols)
        return dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps)

    for dt in dtypes:
        for act in ("swiglu", "geglu") if full else ("swiglu",):
            def glu(dt=dt, act=act):
                g, u = rand(16, 14336, dtype=dt).requires_grad_(), rand(16, 14336, dtype=dt).requires_grad_()
                with torch.enable_grad():
                    getattr(ops, act)(g, u).float().sum().backward()
            add(f"{act}-{dt}", glu, lambda kernel, kw, cc, dt=dt: glu_tiles(
                kernel, kw, cc, torch.empty(0, dtype=dt).element_size(), 1, 16 * 14336))

    def ce_gpu(kernel, kw, cc):
        if kernel == "_scale_grad_kernel":
            return dict(BLOCK=4096, num_warps=8)
        block, warps = cross_entropy.block_config(32000, _CUDA)
        return dict(BLOCK_V=block, num_warps=warps)

    for dt in dtypes:
        flag_sets = [{}, dict(label_smoothing=0.1, z_loss_scale=1e-4, softcap=30.0)] if full else [{}]
        for i, flags in enumerate(flag_sets):
            def ce(dt=dt, flags=flags):
                x = rand(4, 32000, dtype=dt).requires_grad_()
                with torch.enable_grad():
                    (ops.cross_entropy(x, torch.randint(0, 32000, (4,)), **flags) * 2).backward()
            add(f"cross_entropy-{dt}-{i}", ce, ce_gpu)

    def loss_gpu(kernel, kw, cc, itemsize):
        kind = {"_stats_kernel": "stats", "_grad_kernel": "grad", "_jsd_kernel": "jsd"}[kernel]
        block, vec, warps = _engine.row_launch(kind, 32000, itemsize, _CUDA, _engine.DEFAULT)
        out = dict(BLOCK_V=block, VEC=vec, num_warps=warps) if kernel != "_grad_kernel" else dict(
            BLOCK_V=block, num_warps=warps)
        return dict(out, FAST_LOG=True) if kernel == "_jsd_kernel" else out

    for dt in dtypes:
        size = torch.empty(0, dtype=dt).element_size()

        def grpo(dt=dt):
            h, w = rand(4, 64, dtype=dt).requires_grad_(), rand(32000, 64, dtype=dt).requires_grad_()
            ids, adv = torch.randint(0, 32000, (2, 2)), torch.randn(2)
            with torch.enable_grad():
                ops.fused_linear_grpo(h.view(2, 2, 64), w, ids, torch.ones(2, 2), adv)[0].backward()
        add(f"grpo-{dt}", grpo, lambda kernel, kw, cc, size=size: loss_gpu(kernel, kw, cc, size))
        for beta in (0.0, 0.5, 1.0) if full else (0.5,):
            def jsd(dt=dt, beta=beta):
                hs, ws = rand(4, 64, dtype=dt).requires_grad_(), rand(32000, 64, dtype=dt).requires_grad_()
                ht, wt = rand(4, 64, dtype=dt), rand(32000, 64, dtype=dt)
                with torch.enable_grad():
                    ops.fused_linear_jsd(hs, ws, ht, wt, torch.randint(0, 32000, (4,)), beta=beta)[0].backward()
            add(f"jsd-{dt}-beta{beta}", jsd, lambda kernel, kw, cc, size=size: loss_gpu(kernel, kw, cc, size))

    def moe_gpu(kernel, kw, cc):
        block, warps = moe._geometry(_CUDA, 4096)
        return dict(BLOCK_H=block, num_warps=warps)

    for dt in dtypes:
        def moe_call(dt=dt):
            y = rand(8, 4096, dtype=dt).requires_grad_()
            w = torch.rand(4, 2).requires_grad_()
            pos = torch.randperm(8).view(4, 2)
            with torch.enable_grad():
                ops.moe_combine(y, w, pos).float().sum().backward()
            ops.moe_permute(rand(4, 4096, dtype=dt), pos)
        add(f"moe-{dt}", moe_call, moe_gpu)

    for dt in dtypes:
        for master in (False, True) if full and dt != torch.float32 else (False,):
            def adamw(dt=dt, master=master):
                p = [rand(4096, dtype=dt), rand(300, dtype=dt)]
                g = [rand(4096, dtype=dt), rand(300, dtype=dt)]
                m, v = [torch.zeros_like(t, dtype=torch.float32) for t in p], [torch.zeros_like(
                    t, dtype=torch.float32) for t in p]
                kw = dict(master_params=[t.float() for t in p]) if master else {}
                ops.adamw_step_(p, g, m, v, lr=1e-3, step=1, max_grad_norm=1.0, **kw)
            add(f"adamw-{dt}-master{int(master)}", adamw)

    for dt in dtypes:
        for clip, maximize in ((True, False), (False, True)) if full else ((True, False),):
            def adamw8bit(dt=dt, clip=clip, maximize=maximize):
                p, g = rand(4096 + 37, dtype=dt), rand(4096 + 37, dtype=dt)
                kw = dict(max_grad_norm=1.0, norm=torch.ones(1)) if clip else {}
                ops.adamw8bit_step_(p, g, *ops.new_moments(p), lr=1e-3, step=1, maximize=maximize, **kw)
            add(f"adamw8bit-{dt}-clip{int(clip)}-max{int(maximize)}", adamw8bit)

    # decode kernels: every launch a Llama-3-8B decode step makes, at batch 1 (the rule's launches as the dispatch
    # fits them to the target's shared memory, PDL from sm_90)
    def dl_config(K, n_out, glu, norm, esize, cc, pick=None):
        cfg = DecodeLinearConfig(*pick) if pick else decode_linear._rule_config(K, n_out, glu, norm, 132)
        return decode_linear._fit_smem(cfg, esize, glu, norm, SMEM_OPTIN[cc])

    def dl_gpu(kernel, kw, cc, K, n_out, glu, norm, esize, pick=None):
        cfg = dl_config(K, n_out, glu, norm, esize, cc, pick)
        split = 1 if glu else decode_linear._split_of(K, cfg.block_k, cfg.split_k)[1]
        stats_k = min(1 << (K - 1).bit_length(), max(cfg.block_k, (cfg.stats_elems or decode_linear.STATS_ELEMS)
                                                     // kw["STATS_M"]))
        k_split = decode_linear._split_of(K, cfg.block_k, cfg.split_k)[0]
        return dict(UPCAST=False, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=split, STATS_K=stats_k,
                    EVEN_K=K % cfg.block_k == 0 and k_split * split == K, num_warps=cfg.num_warps,
                    num_stages=cfg.num_stages)

    layer = [("qkv", 4096, (4096, 1024, 1024), True, None, False), ("o", 4096, (4096,), False, None, True),
             ("gate_up", 4096, (14336, 14336), True, "silu", False), ("down", 14336, (4096,), False, None, True)]
    for dt in dtypes:
        esize = torch.empty(0, dtype=dt).element_size()
        for m in (1, 8) if full else (1,):
            for name, K, ns, norm, act, res in layer:
                def dl(dt=dt, m=m, K=K, ns=ns, norm=norm, act=act, res=res):
                    x = rand(m, K, dtype=dt)
                    ws = [torch.empty(n, K, dtype=dt) for n in ns]
                    ops.decode_linear(x, ws, norm_weight=rand(K, dtype=dt) if norm else None, activation=act,
                                      residual=rand(m, ns[0] if act else sum(ns), dtype=dt) if res else None)
                n_out = ns[0] if act else sum(ns)
                add(f"decode_linear-{name}-{dt}-m{m}", dl,
                    lambda kernel, kw, cc, K=K, n_out=n_out, act=act, norm=norm, esize=esize: dl_gpu(
                        kernel, kw, cc, K, n_out, bool(act), norm, esize))
    if full:  # the measured H200 picks, which only an H200 (sm_90) takes
        for (K, N, bucket, kind), pick in decode_linear_picks.MEASURED_PICKS["NVIDIA H200"].items():
            norm, res = "norm" in kind, "residual" in kind
            def dl_pick(K=K, N=N, bucket=bucket, norm=norm, res=res, pick=pick):
                x = rand(bucket, K)
                ops.decode_linear(x, [torch.empty(N, K, dtype=bf16)], norm_weight=rand(K) if norm else None,
                                  residual=rand(bucket, N) if res else None, config=DecodeLinearConfig(*pick))
            add(f"decode_linear-pick-{K}x{N}-m{bucket}-{kind}", dl_pick,
                lambda kernel, kw, cc, K=K, N=N, norm=norm, pick=pick: dict(
                    dl_gpu(kernel, kw, cc, K, N, False, norm, 2, pick), only=(90,)))

    def da_gpu(kernel, kw, cc, dt, warps):
        if kernel == "_decode_attention_merge_kernel":
            return {}
        return dict(UPCAST=False, DOT_PRECISION=decode_attention._dot_precision(dt, False),
                    BLOCK_N=decode_attention._block_n(_CUDA, kw["BLOCK_D"], DecodeAttentionConfig()),
                    num_warps=warps)

    for dt in dtypes:
        for window, softcap in ((None, None), (256, 50.0)) if full else ((None, None),):
            for warps in (2, 4):
                for splits in (1, 4):
                    def da(dt=dt, window=window, softcap=softcap, splits=splits):
                        C = 1024
                        q = rand(1, 32, 1, 128, dtype=dt)
                        kc, vc = rand(1, 8, C, 128, dtype=dt), rand(1, 8, C, 128, dtype=dt)
                        ops.decode_attention(q, kc, vc, torch.arange(C), torch.tensor([C - 1]), sliding_window=window,
                                             softcap=softcap, advance_q_pos=True,
                                             config=DecodeAttentionConfig(n_splits=splits, num_warps=4))
                    add(f"decode_attention-{dt}-w{window}-s{splits}-warps{warps}", da,
                        lambda kernel, kw, cc, dt=dt, warps=warps: da_gpu(kernel, kw, cc, dt, warps))

    for dt in dtypes:
        def kv(dt=dt):
            B, T, Hq, Hkv, D, C = 1, 1, 32, 8, 128, 64
            key, value = rand(B, Hkv, T, D, dtype=dt), rand(B, Hkv, T, D, dtype=dt)
            cos, sin = rand(B, T, D), rand(B, T, D)
            kc, vc = torch.zeros(B, Hkv, C, D, dtype=dt), torch.zeros(B, Hkv, C, D, dtype=dt)
            q = rand(B, Hq, T, D, dtype=dt)
            ops.rope_kv_write(key, value, cos, sin, kc, vc, torch.tensor([3]), query=q)
            ops.rope_kv_append(key, value, cos, sin, kc, vc, torch.full((C,), -1),
                               torch.tensor([3]), query=q)
        add(f"kv_write-{dt}", kv)
    # quant_linear: both kernels, every kind; recorded with the GPU launch plan (sm_count 132) and, for the
    # fp8 cases below sm_89, the bytes-decoding path (Triton has no e4m3 there)
    ql = importlib.import_module("tigon.ops.quant_linear")
    from tigon.ops.quant_code_mma import k_width
    from tigon.ops.quantized_weight import QuantizedWeight

    def ql_gpu(kernel, kw, cc, only=TARGETS):
        if kernel == "_glu_fwd_kernel":  # the prefill path's GLU epilogue (ops.swiglu's forward) on the GPU's tiles
            return glu_tiles(kernel, kw, cc, 2, 512, 256)  # the [rows, 256] halves of the [rows, 512] output
        if kernel == "_quant_code_mma_kernel":
            return dict(NATIVE=True, KWIDTH=k_width(divmod(cc, 10), kw["BLOCK_N"], kw["num_warps"]), only=only)
        return dict(ASM=True, only=only, **({"UPCAST": False} if kernel == "_quant_mm_kernel" else {}))

    # prefill: rows >= 256 dequantize the weight (_dequant_kernel) then run cuBLAS; dequant_min_rows=0 keeps the
    # tensor-core GEMM, so both launches are compiled
    for kind, group, act, rows, native, dq in (
            ("int4", 128, None, 1, True, -1), ("int4", 32, "silu", 8, True, -1), ("int4", 128, "silu", 512, True, 0),
            ("int4", 128, "silu", 512, True, -1), ("nf4", 64, None, 1, True, -1), ("nf4", 64, "silu", 40, True, -1),
            ("nf4", 64, None, 300, True, -1), ("fp8", 128, "silu", 1, True, -1), ("fp8", 0, None, 8, True, -1),
            ("fp8", 128, None, 300, True, -1), ("fp8", 128, None, 1, False, -1), ("fp8", 0, "silu", 40, False, -1),
            ("fp8", 0, None, 300, False, -1), ("int4", 128, "silu", 8, True, -2), ("int4", 64, None, 8, True, -2),
            ("int4", 128, None, 1, True, -3), ("int4", 32, "silu", 8, True, -3), ("int4", 128, "silu", 512, True, -3),
            ("int4", 64, None, 1, True, -4), ("int4", 128, "silu", 512, True, -4), ("int4", 128, "silu", 1, True, -5)):
        # dq -2: the default launch with prefetch=1 (the tensor-core kernel's scales loaded a step ahead); -3: the
        # code-MMA kernel (code_mma=1: the GEMV, and at 512 rows the GEMM); -4: the same with act order and zeros; -5:
        # its tile below a warpgroup's (mma.sync on sm_90 too)
        def quant(kind=kind, group=group, act=act, rows=rows, native=native, dq=dq):
            N, K = 512, 1024
            if kind == "fp8":
                shape = (N,) if group == 0 else (N // group, K // group)
                data = torch.zeros(N, K, dtype=torch.float8_e4m3fn)
            else:
                shape, data = (N, K // group), torch.zeros(N, K // 2, dtype=torch.uint8)
            act_order = dict(zeros=torch.ones(shape, dtype=bf16), perm=torch.randperm(K)) if dq == -4 else {}
            qw = QuantizedWeight(kind, data, torch.ones(shape, dtype=bf16), act_order.pop("zeros", None), group,
                                 (N, K), bf16, **act_order)
            plan, native_of, sms, capability = ql._plan, ql._fp8_native, ql._launch.sm_count, ql._launch.capability
            ql._plan = lambda *a: plan.__wrapped__(*a[:6], torch.device("cuda", 0), *a[7:])
            ql._fp8_native, ql._launch.sm_count = (lambda device: native), (lambda index: 132)
            ql._launch.capability = lambda device: divmod(cc, 10)  # the kernel the rule picks there (`_mma_by_rule`)
            try:
                config = ql.QuantLinearConfig(dequant_min_rows=dq) if dq >= 0 else None
                config = {-2: ql.QuantLinearConfig(prefetch=1), -3: ql.QuantLinearConfig(code_mma=1),
                          -4: ql.QuantLinearConfig(code_mma=1),
                          -5: ql.QuantLinearConfig(code_mma=1, block_n=32, num_warps=2)}.get(dq, config)
                ops.quant_linear(rand(rows, K), qw, activation=act, config=config)
            finally:
                ql._plan, ql._fp8_native, ql._launch.sm_count, ql._launch.capability = plan, native_of, sms, capability
        add(f"quant_linear-{kind}-g{group}-{act}-m{rows}-{'native' if native else 'bytes'}{'-mm' if dq == 0 else ''}"
            f"{'-ahead' if dq == -2 else ''}{'-mma' if dq <= -3 else ''}{'-act-order' if dq == -4 else ''}"
            f"{'-mma-sync' if dq == -5 else ''}",
            # act order: one mma.sync target and sm_90's wgmma; the small tile: sm_90 (mma.sync elsewhere anyway)
            quant, lambda kernel, kw, cc, native=native, kind=kind, dq=dq: ql_gpu(
                kernel, kw, cc, (89, 90) if kind == "fp8" and native else {-4: (80, 90), -5: (90,)}.get(dq, TARGETS)))
    return cases


def _pdl_for(kernel, kw, bound, cc):
    """PDL as the dispatch sets it on a GPU of compute capability cc (ops/_pdl.enabled: sm_90 on), for a kernel
    that takes it: always in the decode kernels, in the RMSNorm forward for a decode step's rows only."""
    from tigon.ops import _launch

    if "PDL" not in bound:
        return {}
    on = cc >= 90 and (kernel != "_rms_norm_fwd_kernel" or bound["M"] <= _launch.DECODE_ROWS)
    return dict(PDL=on, launch_pdl=True) if on else dict(PDL=False)


def _compile(kernel, args, kwargs, cc):
    """Compile one launch for sm_<cc> through Triton's own binder, as `kernel[grid](*args, **kwargs)` would on
    such a GPU. Returns the compiled kernel."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", cc, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, spec, opts = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, spec, opts)
    return triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target, options=options.__dict__)


def _all_kernels():
    """Names of every JITFunction of tigon.ops named *_kernel (the launch targets), by module."""
    import pkgutil

    from triton.runtime.jit import JITFunction

    import tigon.ops

    names = set()
    for info in pkgutil.walk_packages(tigon.ops.__path__, "tigon.ops."):
        mod = importlib.import_module(info.name)
        names |= {f"{info.name}.{n}" for n, v in vars(mod).items() if isinstance(v, JITFunction) and
                  n.endswith("_kernel")}
    return names


def _worker(cc: int, full: bool) -> dict:
    """Compile every case for sm_<cc>; returns {"results": [...], "kernels": [...], "covered": [...]}."""
    import tigon.ops  # noqa: F401  (compiled kernels: imported before the interpreter switch below)

    results, covered = [], set()
    os.environ["TRITON_INTERPRET"] = "1"  # only now, after import: the ops take the kernel path on CPU tensors
    for name, call, gpu in _cases(full, cc):
        try:
            launches = _launches(call)
        except Exception as e:  # noqa: BLE001 (the report names it)
            results.append(dict(case=name, kernel="?", error=f"recording failed: {type(e).__name__}: {e}"))
            continue
        seen = set()
        for kernel, args, kwargs in launches:
            kname = kernel.fn.__name__
            bound = dict(zip(kernel.arg_names, args)) | kwargs
            over = dict(gpu(kname, kwargs, cc))
            only = over.pop("only", TARGETS)
            kw = {k: v for k, v in kwargs.items() if k != "launch_pdl"} | over | _pdl_for(kname, kwargs, bound, cc)
            key = (kname, repr(sorted(kw.items())), tuple(getattr(a, "dtype", type(a)) for a in args))
            if cc not in only or key in seen:
                continue
            seen.add(key)
            covered.add(f"{kernel.fn.__module__}.{kname}")
            t0 = time.perf_counter()
            entry = dict(case=name, kernel=kname, pdl=bool(kw.get("PDL")))
            try:
                compiled = _compile(kernel, args, kw, cc)
                entry.update(shared=compiled.metadata.shared, has_cubin="cubin" in compiled.asm)
            except Exception as e:  # noqa: BLE001
                entry["error"] = f"{type(e).__name__}: {str(e)[-2000:]}"
            entry["seconds"] = round(time.perf_counter() - t0, 3)
            results.append(entry)
    return dict(results=results, kernels=sorted(_all_kernels()), covered=sorted(covered),
                pdl_below_sm90=_pdl_refused(cc) if cc < 90 else None)


def _pdl_refused(cc: int) -> str | None:
    """ptxas's error for an RMSNorm forward compiled with PDL on for sm_<cc> (None if it compiled): what a GPU below
    sm_90 would meet if the dispatch did not gate PDL."""
    from tigon import ops

    x, w = torch.randn(4, 4096).to(torch.bfloat16), torch.randn(4096).to(torch.bfloat16)
    (kernel, args, kwargs), = _launches(lambda: ops.rms_norm(x, w))
    try:
        _compile(kernel, args, dict(kwargs, PDL=True, launch_pdl=True), cc)
    except Exception as e:  # noqa: BLE001
        return str(e)
    return None


def _run_worker(cc: int, tmp_path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton")  # a cold cache: each run compiles
    proc = subprocess.run([sys.executable, __file__, str(cc)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("cc", TARGETS)
def test_every_kernel_compiles_for(cc, tmp_path):
    got = _run_worker(cc, tmp_path)
    failed = [f"{r['case']} {r['kernel']}: {r['error']}" for r in got["results"] if "error" in r]
    assert not failed, f"sm_{cc}:\n" + "\n".join(failed)
    missing = set(got["kernels"]) - set(got["covered"])
    assert not missing, f"no compile case for {sorted(missing)}"
    assert all(r["has_cubin"] for r in got["results"])
    over = [f"{r['case']} {r['kernel']}: {r['shared']} B" for r in got["results"] if r["shared"] > SMEM_OPTIN[cc]]
    assert not over, f"over sm_{cc}'s {SMEM_OPTIN[cc]} B of shared memory a block:\n" + "\n".join(over)
    assert any(r["pdl"] for r in got["results"]) == (cc >= 90)
    if cc < 90:  # the gate matters: PDL's instructions do not assemble below sm_90
        assert got["pdl_below_sm90"] and "griddepcontrol" in got["pdl_below_sm90"], got["pdl_below_sm90"]


@pytest.mark.parametrize("capability", [(8, 0), (8, 6), (8, 9), (9, 0), (10, 0)])
def test_pdl_on_from_sm90_only(monkeypatch, capability):
    """`_pdl.enabled` answers from the device's compute capability: off on A100/A10/L4-class cards, on from
    Hopper (a faked capability: no GPU needed)."""
    _pdl = importlib.import_module("tigon.ops._pdl")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability)
    monkeypatch.setattr(torch.version, "hip", None)
    _pdl._capable.cache_clear()
    try:
        assert _pdl.gdc_wait is not None  # Triton >= 3.3, as the venv's
        assert _pdl.enabled(torch.device("cuda", 0)) == (capability >= (9, 0))
        assert not _pdl.enabled(torch.device("cpu"))
    finally:
        _pdl._capable.cache_clear()


def _pdl_sources():
    """(function, the PDL= expression) of every kernel launch in tigon.ops that passes PDL."""
    import ast
    import inspect
    import pkgutil

    import tigon.ops

    for info in pkgutil.walk_packages(tigon.ops.__path__, "tigon.ops."):
        tree = ast.parse(inspect.getsource(importlib.import_module(info.name)))
        for fn in tree.body:  # module-level functions, with the closures inside them
            if isinstance(fn, ast.FunctionDef):
                for call in ast.walk(fn):
                    if isinstance(call, ast.Call):
                        for kw in call.keywords:
                            if kw.arg == "PDL":
                                yield f"{info.name}.{fn.name}", fn, kw.value


def test_every_pdl_launch_is_gated_by_the_capability():
    """Each launch's PDL is a local set from `_pdl.enabled(...)` (and the launch option from the same local), so
    no launcher turns PDL on below sm_90 by its own rule."""
    import ast

    found = list(_pdl_sources())
    assert {name.rsplit(".", 1)[0] for name, _, _ in found} >= {
        "tigon.ops.decode_linear", "tigon.ops.decode_attention", "tigon.ops.kv_write", "tigon.ops.rms_norm"}
    for name, fn, value in found:
        assert isinstance(value, ast.Name), f"{name}: PDL={ast.unparse(value)}"
        sets = [n.value for n in ast.walk(fn) if isinstance(n, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == value.id for t in n.targets)]
        assert len(sets) == 1 and "_pdl.enabled(" in ast.unparse(sets[0]), f"{name}: {value.id} = " + ", ".join(
            ast.unparse(v) for v in sets)
        # an `and` may narrow it (the RMSNorm forward: a decode step's rows only), never widen it
        expr = sets[0]
        assert (isinstance(expr, ast.Call) or isinstance(expr, ast.BoolOp) and isinstance(expr.op, ast.And)), name
        options = [c for c in ast.walk(fn) if isinstance(c, ast.Call) and ast.unparse(c.func) == "_pdl.launch_options"]
        assert all(ast.unparse(c.args[0]) == value.id for c in options), name


if __name__ == "__main__":
    print(json.dumps(_worker(int(sys.argv[1]), os.environ.get("TIGON_COMPILE_MATRIX") == "full")))
