"""``hybridkv serve``: an OpenAI-compatible HTTP server over one engine (docs/serve.md).

One module per job: :mod:`.settings` (the server's limits), :mod:`.errors` (OpenAI's error
shape), :mod:`.schema` (request validation), :mod:`.media_refs` (image / video URLs resolved
safely), :mod:`.prefix_cache` (compressed prefixes kept between requests), :mod:`.answer_text`
(tokens to text: deltas, stop strings), :mod:`.worker` (the one thread that owns the model),
:mod:`.metrics` (Prometheus text) and :mod:`.app` (the routes).
"""
