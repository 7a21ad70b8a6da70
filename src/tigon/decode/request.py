"""GenerationRequest: one `tigon.generate` call's arguments, checked once and frozen; what the loop reads.

`GenerationRequest.build` runs every check of generate's arguments (`inputs`, `sampling.check_args`) before the
clock starts, in generate's order (so the first bad argument is the one named), and resolves what the model
supplies: the stop ids from its `generation_config`. The loop then reads this one value, never the arguments.
"""

import dataclasses

import torch

from . import inputs, sampling
from .settings import DecodeSettings


@dataclasses.dataclass(frozen=True, eq=False)
class GenerationRequest:
    """What one call asks for, checked (`build`); compared by identity (it holds tensors).

    input_ids: `[B, P]` int64 or int32, as given (the loop copies it to the model's device).
    attention_mask: `[B, P]` left padding (1 = token) as given, or None.
    max_new_tokens: >= 1. capacity: the ring size asked for (>= 1), or None: `ring` is then P + max_new_tokens.
    cuda_graph, return_stats: as generate's. attention: "auto", "tigon" or "hf" (the call decides "auto" when it
        switches the model's attention).
    do_sample, temperature, top_k, top_p, generator: the token choice; without do_sample the off values (1.0, 0,
        1.0, None): generate ignores the arguments then.
    eos: the EOS ids (a tuple), or None: rows never stop. pad: the id a finished row's later tokens get.
    settings: how the loop runs (`DecodeSettings`).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    max_new_tokens: int
    capacity: int | None
    cuda_graph: bool
    attention: str
    return_stats: bool
    do_sample: bool
    temperature: float
    top_k: int
    top_p: float
    generator: torch.Generator | None
    eos: tuple[int, ...] | None
    pad: int
    settings: DecodeSettings

    @property
    def batch(self) -> int:
        return self.input_ids.shape[0]

    @property
    def prompt(self) -> int:
        """P, the prompt's length (left padding included)."""
        return self.input_ids.shape[1]

    @property
    def total(self) -> int:
        """P + max_new_tokens: the output's width before the trim."""
        return self.prompt + self.max_new_tokens

    @property
    def ring(self) -> int:
        """The ring size asked for: capacity, else `total` (exact full attention). A recorded prefill may round
        its own cache's ring up (`prefill_graph.Plan.ring`)."""
        return self.total if self.capacity is None else self.capacity

    def choose(self, logits: torch.Tensor) -> torch.Tensor:
        """The next token `[B]` of last-position logits `[B, V]`, on the device (`sampling.choose`)."""
        return sampling.choose(logits, self.do_sample, self.temperature, self.top_k, self.top_p, self.generator)

    @classmethod
    def build(cls, model, input_ids, *, max_new_tokens, attention_mask, capacity, cuda_graph, attention,
              return_stats, do_sample, temperature, top_k, top_p, eos_token_id, pad_token_id, generator,
              settings) -> "GenerationRequest":
        """The request of `tigon.generate(model, input_ids, ...)`'s arguments, or the TypeError / ValueError of
        the first bad one ("generate: <argument> ..."). Reads the prompt's range once (one host sync)."""
        inputs.check_model(model)
        vocab = inputs.vocab_size(model)
        inputs.check_int("max_new_tokens", max_new_tokens, 1)
        for name, flag in (("do_sample", do_sample), ("cuda_graph", cuda_graph), ("return_stats", return_stats)):
            inputs.check_bool(name, flag)
        if not isinstance(settings, DecodeSettings):
            raise TypeError(f"{inputs.NAME}: settings must be a tigon.decode.DecodeSettings, got "
                            f"{type(settings).__name__}")
        if do_sample:
            # None is "off", as in model.generate's keyword arguments
            temperature = 1.0 if temperature is None else temperature
            top_k, top_p = 0 if top_k is None else top_k, 1.0 if top_p is None else top_p
            sampling.check_args(temperature, top_k, top_p)
            if generator is not None and (not isinstance(generator, torch.Generator)
                                          or generator.device.type != model.device.type):
                raise TypeError(f"{inputs.NAME}: generator must be a torch.Generator on the model's device "
                                f"({model.device.type}), got "
                                f"{getattr(generator, 'device', type(generator).__name__)}")
        else:
            temperature, top_k, top_p, generator = 1.0, 0, 1.0, None
        if not isinstance(attention, str) or attention not in inputs.ATTENTION:
            raise ValueError(f"{inputs.NAME}: attention must be one of {', '.join(map(repr, inputs.ATTENTION))}, "
                             f"got {attention!r}")
        eos, pad = inputs.stop_ids(model, eos_token_id, pad_token_id, vocab)
        if capacity is not None:
            inputs.check_int("capacity", capacity, 1)
        inputs.check_prompt(input_ids, attention_mask, vocab)
        return cls(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens,
                   capacity=capacity, cuda_graph=cuda_graph, attention=attention, return_stats=return_stats,
                   do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator,
                   eos=tuple(eos) if eos else None, pad=pad, settings=settings)
