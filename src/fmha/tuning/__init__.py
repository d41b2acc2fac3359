"""Step 4: tile configs per GPU and shape.

Lookup order at call time (:mod:`fmha.tuning.lookup`): the on-disk cache
(``$FMHA_CACHE_DIR/tuning.json``, default ``~/.cache/fmha``), then the defaults shipped for
this GPU (``defaults/forward.json``), then a heuristic. ``FMHA_AUTOTUNE=1`` searches a
missing key once and stores it. ``fmha tune`` searches a suite on purpose. The forward and
the backward have their own keys (``fwd|...`` and ``bwd|...``), search spaces and configs.
"""
