"""The inference wing: `tigon.generate` and what it is made of.

    from tigon.decode import DecodeSettings, generate
    seqs, stats = generate(model, ids, max_new_tokens=64, return_stats=True,
                           settings=DecodeSettings(eos_check_every=8))

Modules, in the order a decode call meets them:
    settings.py     DecodeSettings: how the loop runs (one frozen value passed in; the tokens never depend on it)
    inputs.py       argument checks, and the stop ids (explicit, else model.generation_config)
    request.py      GenerationRequest: generate's arguments checked once, frozen; what the loop reads
    loop.py         generate: the attention switch, the prefill, the decode steps, the CUDA graph
    prefill_graph.py recorded prefills: a short prompt's prefill replayed from a CUDA graph
    kept.py         what generate keeps with a model between calls (its last cache, the recordings); release()
    layer_step.py   the fused decoder-layer step (decode: 6 kernels; prefill: the direct op calls) and how a
                    model gets it (install / uninstall / fused_decode)
    rotary_table.py the per-call cos/sin table the rotary module reads
    hf_graph.py     HF's own model.generate with a CUDA-graph decode step (tigon.patch(model, cuda_graph=True))
    capture.py      the side-stream warm-up, then CUDA-graph capture without torch.cuda.graph's device sync
    sampling.py     token choice on the device (argmax, temperature / top-k / top-p)
    stats.py        the step clock, the TTFT phases, the one percentile rule, the stats dict
    metrics.py      the stats as Prometheus metrics (`tigon.decode.metrics`, not re-exported here; it reads the
                    stats dict only)

How the fused layer step is reached (the one run-time link between hf/ and this package, hf/ never imports
it): `tigon.patch` gives each Llama-style decoder layer Tigon's forward
(`hf.causal_lm.fused_prenorm_decoder_forward`), which, in a no-grad step with a cache, calls the step held in
`layer.__dict__["_tigon_layer_step"]` if there is one. `layer_step.install(model)` puts it there:
`tigon.patch(model)` (tigon/__init__.py) does so for the instance, so HF's own `model.generate` over a
RollingKVCache on the "tigon" attention runs the fused step; `tigon.generate` holds it for the duration of its
call (`fused_decode`), so a class-level patched model gets it too.

Layering: this package imports ops, memory, modules and hf; tigon/__init__.py (tigon.patch), cli and demo import it.
"""

from . import hf_graph
from .kept import release
from .layer_step import fused_decode, install, uninstall
from .loop import generate
from .settings import DecodeSettings
from .stats import TTFT_PHASES, percentile

__all__ = ["DecodeSettings", "TTFT_PHASES", "fused_decode", "generate", "hf_graph", "install", "percentile", "release",
           "uninstall"]
