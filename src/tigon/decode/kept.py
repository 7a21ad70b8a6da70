"""What `tigon.generate` keeps with a model between calls, and `release(model)`, which drops it.

- the last call's cache (`take_cache` / `keep_cache`): the next call of the same batch, ring size, dtype and device
  takes it back emptied by its counters (`RollingKVCache.clear`: two kernels) instead of allocating and zeroing
  every layer's ring and building its views (~2 ms of host time a call for 32 layers on the H200 machine);
- the recorded prefills (`prefill_graph`: each with its own cache and CUDA graph), in `Kept.recordings`;
- the rotary modules and their cos/sin tables (`rotary_table.cached_rotary`'s `store`): the walk over the model's
  ~420 modules and the table's ~10 kernels once, not every call.

All of it lives in the model's `__dict__` and goes with the model; `release(model)` frees it now. A call takes the
cache out while it runs, so two concurrent calls on one model never share one.
"""

import collections

_KEPT = "_tigon_generate_kept"


class Kept:
    """A model's kept state: `cache` ((key, RollingKVCache) or None), `recordings` (key -> prefill_graph
    recording, least recently used first), `refused` (key -> the model's fingerprint when a shape could not be
    recorded), `memory` (the CUDA graph memory pool the model's recorded prefills share), `rotary` (the store of
    `cached_rotary`)."""

    def __init__(self):
        self.cache = None
        self.rotary = {}
        self.recordings = collections.OrderedDict()
        self.refused = {}
        self.memory = None

    # A copy or a pickle of the model (copy.deepcopy(model), as TRL builds a reference model; torch.save(model))
    # gets nothing of it: caches and CUDA graphs belong to this model's storage, and graphs do not pickle.
    def __deepcopy__(self, memo):
        return Kept()

    def __reduce__(self):
        return Kept, ()


def kept(model) -> Kept:
    """The model's Kept, made on first use."""
    state = model.__dict__.get(_KEPT)
    if state is None:
        state = model.__dict__[_KEPT] = Kept()
    return state


def take_cache(model, key):
    """The kept cache built for `key`, emptied, or None (a kept cache of another key is dropped)."""
    state = model.__dict__.get(_KEPT)
    if state is None or state.cache is None:
        return None
    held, state.cache = state.cache, None
    if held[0] != key:
        return None
    held[1].clear()
    return held[1]


def keep_cache(model, key, cache) -> None:
    """Keep `cache` (built for `key`) for the model's next call."""
    kept(model).cache = (key, cache)


def release(model) -> int:
    """Drop what generate keeps with `model` (its last cache, its recorded prefills and their graph memory);
    returns how many caches that freed."""
    state = model.__dict__.pop(_KEPT, None)
    if state is None:
        return 0
    return len(state.recordings) + (state.cache is not None)
