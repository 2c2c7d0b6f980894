"""The OpenAI-compatible Batch API (`batchgen serve`): files and batches over one in-process engine.

- `wire_format`: OpenAI batch input lines -> engine Requests, Results -> OpenAI response objects.
- `store`: file contents under an fsspec storage URI, metadata and per-request results in SQLite.
- `runner`: feeds batches into the engine's EngineLoop and commits each result as it finishes.
- `server`: the FastAPI routes (files, batches, models, health).
- `serve_cli`: the `batchgen serve` subcommand.

Nothing is imported here, so `batchgen --help` does not pay for FastAPI.
"""
