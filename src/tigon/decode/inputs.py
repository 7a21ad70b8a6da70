"""The checks of `tigon.generate`'s arguments, before the clock starts: clear errors that name the argument.

Also where the stop ids come from: an explicit `eos_token_id` / `pad_token_id` wins, else the model's
`generation_config` (as `model.generate` reads it), else none (a row never stops; the padding id is then the
first EOS id, or 0).
"""


import torch

NAME = "generate"
ATTENTION = ("auto", "tigon", "hf")


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_int(name, value, minimum):
    if not is_int(value):
        raise TypeError(f"{NAME}: {name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{NAME}: {name} must be >= {minimum}, got {value}")
    return value


def check_bool(name, value):
    if not isinstance(value, bool):
        raise TypeError(f"{NAME}: {name} must be True or False, got {type(value).__name__} {value!r}")
    return value


def token_ids(name, value, vocab):
    if value is None:
        return None
    ids = [value] if is_int(value) else value
    if isinstance(ids, torch.Tensor):
        ids = ids.flatten().tolist()
    if not isinstance(ids, (list, tuple)) or not ids or not all(is_int(i) and i >= 0 for i in ids):
        raise ValueError(f"{NAME}: {name} must be a token id >= 0 or a non-empty list of them, "
                         f"got {value!r}")
    outside = [i for i in ids if vocab is not None and i >= vocab]
    if outside:  # the model could never emit it, so the row would never stop
        raise ValueError(f"{NAME}: {name} {outside} is outside the model's vocabulary (ids 0..{vocab - 1})")
    return list(ids)


def check_model(model):
    """The model must be a decoder-only causal LM with its LM head: what HF's model.generate takes."""
    what = type(model).__name__
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{NAME}: model must be a Hugging Face causal LM (e.g. AutoModelForCausalLM), got {what}")
    config = getattr(model, "config", None)
    if not hasattr(config, "get_text_config") or not callable(getattr(model, "get_output_embeddings", None)):
        raise TypeError(f"{NAME}: model must be a Hugging Face causal LM (e.g. AutoModelForCausalLM), got {what}, "
                        "which has no transformers config")
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(f"{NAME}: model must be a decoder-only causal LM, got the encoder-decoder {what}")
    if model.get_output_embeddings() is None:
        raise ValueError(f"{NAME}: model {what} has no LM head (get_output_embeddings() is None): pass the "
                         "ForCausalLM model, not its base model (e.g. `model`, not `model.model`)")


def vocab_size(model):
    """The model's vocabulary: its input embedding's rows, else the config's vocab_size (None if neither)."""
    emb = model.get_input_embeddings() if callable(getattr(model, "get_input_embeddings", None)) else None
    n = getattr(emb, "num_embeddings", None)
    return n if is_int(n) else getattr(model.config.get_text_config(decoder=True), "vocab_size", None)


def check_prompt(input_ids, attention_mask, vocab):
    """Token ids inside the vocabulary (an id past it is a device-side assert on CUDA, which ends the process's
    CUDA context) and a left-padded 0/1 mask: one host sync, before the clock starts."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype not in (
            torch.int64, torch.int32) or input_ids.shape[0] < 1 or input_ids.shape[1] < 1:
        got = (f"{tuple(input_ids.shape)} {input_ids.dtype}" if isinstance(input_ids, torch.Tensor)
               else type(input_ids).__name__)
        raise ValueError(f"{NAME}: input_ids must be a [batch, seq] int64 (or int32) tensor with batch >= 1 and "
                         f"seq >= 1, got {got}")
    b, p = input_ids.shape
    checks = [input_ids.min(), input_ids.max()]
    if attention_mask is not None:
        if not isinstance(attention_mask, torch.Tensor) or tuple(attention_mask.shape) != (b, p):
            raise ValueError(f"{NAME}: attention_mask must be a [{b}, {p}] tensor like input_ids, got "
                             f"{getattr(attention_mask, 'shape', type(attention_mask).__name__)}")
        if attention_mask.is_complex():
            raise ValueError(f"{NAME}: attention_mask must hold 0 and 1, got a {attention_mask.dtype} tensor")
        m = attention_mask.to(device=input_ids.device)
        checks += [((m != 0) & (m != 1)).any(), (m[:, -1] != 1).any()]
    lo, hi, *mask = torch.stack([c.to(torch.int64) for c in checks]).tolist()
    if lo < 0 or (vocab is not None and hi >= vocab):
        raise ValueError(f"{NAME}: input_ids must be token ids in 0..{vocab - 1 if vocab else '?'} (the model's "
                         f"vocabulary), got values in {lo}..{hi}")
    if mask and mask[0]:
        raise ValueError(f"{NAME}: attention_mask must hold only 0 (padding) and 1 (token)")
    if mask and mask[1]:
        raise ValueError(f"{NAME}: attention_mask: every row must end with a real token (left padding, as "
                         "decoder-only generation needs; a right-padded or all-padding row would continue from "
                         "padding)")


def _config_ids(model, key):
    config = getattr(model, "generation_config", None)
    return getattr(config, key, None) if config is not None else None


def stop_ids(model, eos_token_id, pad_token_id, vocab):
    """(eos ids or None, pad id) for the call. As `model.generate`: an argument left None is read from
    `model.generation_config`; the padding id of a finished row defaults to the first EOS id (0 without any).
    Refuses ids outside the vocabulary: an EOS the model cannot emit never stops a row, a pad id is fed back."""
    if eos_token_id is None:
        eos = token_ids("generation_config.eos_token_id", _config_ids(model, "eos_token_id"), vocab)
    else:
        eos = token_ids("eos_token_id", eos_token_id, vocab)
    source = "pad_token_id"
    if pad_token_id is None and is_int(_config_ids(model, "pad_token_id")):
        pad_token_id, source = _config_ids(model, "pad_token_id"), "generation_config.pad_token_id"
    if pad_token_id is not None:
        check_int(source, pad_token_id, 0)
    pad = pad_token_id if pad_token_id is not None else (eos[0] if eos else 0)
    if vocab is not None and pad >= vocab:  # a finished row feeds it back to the model
        raise ValueError(f"{NAME}: {source} {pad} is outside the model's vocabulary (ids 0..{vocab - 1})")
    return eos, pad
