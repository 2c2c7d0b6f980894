"""The OpenAI-compatible Batch API (`batchgen serve`): files and batches over one in-process engine, or a Ray
job per batch.

- `wire_format`: OpenAI batch input lines -> engine Requests, Results -> OpenAI response objects.
- `store`: file contents under an fsspec storage URI, metadata and per-request results in SQLite.
- `backend`: what the server asks of a backend, and the batch bookkeeping both backends share.
- `runner`: the engine backend: feeds batches into the engine's EngineLoop and commits each result as it finishes.
- `ray_backend`: the Ray backend: each batch a `batchgen run` job, its part files committed as they appear.
- `server`: the FastAPI routes (files, batches, models, health).
- `serve_cli`: the `batchgen serve` subcommand.

Nothing is imported here, so `batchgen --help` does not pay for FastAPI.
"""
