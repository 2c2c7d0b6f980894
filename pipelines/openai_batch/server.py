"""The OpenAI-compatible Batch API: files, batches and models routes over a BatchStore and a batch backend."""

from __future__ import annotations

import hmac
import time
from collections.abc import Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, BackgroundTasks, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException

from batchgen.engine.sampling_params import InvalidRequestError
from batchgen.pipelines.openai_batch.backend import BatchBackend
from batchgen.pipelines.openai_batch.store import BatchRecord, BatchStore, FileRecord
from batchgen.pipelines.openai_batch.wire_format import ENDPOINTS, completion_window_seconds, error_object

MULTIPART_SLACK = 64 * 1024  # room for the multipart framing around the file itself
CHUNK = 1 << 20


@dataclass
class ServerConfig:
    served_model: str
    api_key: str | None = None
    max_upload_bytes: int = 200 * 1024 * 1024  # OpenAI's own limit for batch input files
    allow_custom_completion_window: bool = False


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_


class UploadLimit:
    """Refuses an upload body larger than the limit while it streams in, before it is spooled to disk."""

    def __init__(self, app: Any, path: str, limit: int) -> None:
        self.app, self.path, self.limit = app, path, limit

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] != self.path:
            await self.app(scope, receive, send)
            return
        seen = 0

        async def limited_receive() -> dict:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                while message.get("more_body", False):  # drain, so the client reads the 413, not a reset
                    message = await receive()
                most = self.limit - MULTIPART_SLACK
                raise HTTPException(413, f"upload larger than the limit of {most} bytes")
            return message

        await self.app(scope, limited_receive, send)


def _error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                    type_: str = "invalid_request_error") -> JSONResponse:
    # None of these errors goes away on retry; the openai client would otherwise retry a 409 twice.
    return JSONResponse(error_object(message, type_, param, code), status_code=status,
                        headers={"x-should-retry": "false"})


def create_app(store: BatchStore, runner: BatchBackend, config: ServerConfig) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        runner.start()
        yield
        await run_in_threadpool(runner.stop)

    app = FastAPI(title="BatchGen Batch API", lifespan=lifespan)
    app.add_middleware(UploadLimit, path="/v1/files", limit=config.max_upload_bytes + MULTIPART_SLACK)
    started = int(time.time())

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return _error_response(exc.status, exc.message, exc.param, exc.code, exc.type)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        return _error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first["loc"][1:]) or None
        return _error_response(400, f"invalid '{param}': {first['msg']}", param)

    def authorize(request: Request) -> None:
        if config.api_key is None:
            return
        header = request.headers.get("authorization", "")
        token = header[7:] if header.startswith("Bearer ") else ""
        if not hmac.compare_digest(token.encode(), config.api_key.encode()):
            raise APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key")

    @app.get("/health")
    def health() -> JSONResponse:
        if runner.failure is not None:
            return JSONResponse({"status": "error", "message": runner.failure}, status_code=503)
        return JSONResponse({"status": "ok"})

    api = APIRouter(prefix="/v1", dependencies=[Depends(authorize)])
    model_object = {"id": config.served_model, "object": "model", "created": started, "owned_by": "batchgen"}

    @api.get("/models")
    def list_models() -> dict:
        return {"object": "list", "data": [model_object]}

    @api.get("/models/{model:path}")
    def get_model(model: str) -> dict:
        if model != config.served_model:
            raise APIError(404, f"The model '{model}' does not exist; this server serves "
                                f"'{config.served_model}'", "model", "model_not_found")
        return model_object

    # ---- files -------------------------------------------------------------------------------------

    def find_file(file_id: str) -> FileRecord:
        return _found(store.get_file(file_id), "File", file_id)

    @api.post("/files")
    async def upload_file(request: Request) -> dict:
        if not request.headers.get("content-type", "").startswith("multipart/form-data"):
            raise APIError(400, "upload a file as multipart/form-data with fields 'file' and 'purpose'")
        form = await request.form(max_files=1, max_fields=8)
        upload, purpose = form.get("file"), form.get("purpose")
        if not isinstance(upload, UploadFile):
            raise APIError(400, "missing multipart field 'file'", "file")
        if purpose != "batch":
            raise APIError(400, f"invalid 'purpose' {purpose!r}: this server only accepts 'batch'", "purpose")
        if upload.size is not None and upload.size > config.max_upload_bytes:
            raise APIError(413, f"file of {upload.size} bytes exceeds the limit of {config.max_upload_bytes} "
                                "bytes", "file", "file_too_large")
        chunks = iter(lambda: upload.file.read(CHUNK), b"")
        record = await run_in_threadpool(store.put_file, upload.filename or "upload.jsonl", purpose, chunks)
        return record.to_openai()

    @api.get("/files")
    def list_files(purpose: str | None = None, after: str | None = None, limit: int = 10000,
                   order: str = "desc") -> dict:
        _check_limit(limit, 10000)
        if order not in ("asc", "desc"):
            raise APIError(400, f"invalid 'order' {order!r}: must be 'asc' or 'desc'", "order")
        try:
            records, has_more = store.list_files(purpose, after, limit, ascending=order == "asc")
        except KeyError:
            raise APIError(400, f"invalid 'after': no file with id {after!r}", "after") from None
        return _page([r.to_openai() for r in records], has_more)

    @api.get("/files/{file_id}")
    def get_file(file_id: str) -> dict:
        return find_file(file_id).to_openai()

    @api.get("/files/{file_id}/content")
    def file_content(file_id: str) -> StreamingResponse:
        record = find_file(file_id)

        def chunks() -> Iterator[bytes]:
            with store.open_file(record.id) as f:
                yield from iter(lambda: f.read(CHUNK), b"")

        return StreamingResponse(chunks(), media_type="application/octet-stream",
                                 headers={"Content-Length": str(record.bytes)})

    @api.delete("/files/{file_id}")
    def delete_file(file_id: str) -> dict:
        record = find_file(file_id)
        users = store.batches_using_file(record.id)
        if users:
            raise APIError(409, f"file {file_id} is the input of unfinished batch {users[0]}; cancel it or "
                                "wait for it to finish", "file_id")
        store.delete_file(record.id)
        return {"id": record.id, "object": "file", "deleted": True}

    # ---- batches -----------------------------------------------------------------------------------

    def find_batch(batch_id: str) -> BatchRecord:
        return _found(store.get_batch(batch_id), "Batch", batch_id)

    @api.post("/batches")
    async def create_batch(request: Request, background: BackgroundTasks) -> dict:
        try:
            body = await request.json()
        except ValueError:
            raise APIError(400, "the request body must be JSON") from None
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object")
        endpoint = body.get("endpoint")
        if endpoint not in ENDPOINTS:
            raise APIError(400, f"invalid 'endpoint' {endpoint!r}: must be one of {list(ENDPOINTS)}",
                           "endpoint")
        window = body.get("completion_window")
        try:
            seconds = completion_window_seconds(window, config.allow_custom_completion_window)
        except InvalidRequestError as exc:
            raise APIError(400, str(exc), "completion_window") from None
        file_id = body.get("input_file_id")
        record = store.get_file(file_id) if isinstance(file_id, str) else None
        if record is None:
            raise APIError(400, f"invalid 'input_file_id': no such file {file_id!r}", "input_file_id")
        if record.purpose != "batch":
            raise APIError(400, f"invalid 'input_file_id': file {file_id} has purpose {record.purpose!r}, "
                                "not 'batch'", "input_file_id")
        metadata = _check_metadata(body.get("metadata"))
        batch = await run_in_threadpool(store.create_batch, endpoint, file_id, window, seconds, metadata)
        background.add_task(runner.validate, batch.id)
        return batch.to_openai(config.served_model)

    @api.get("/batches")
    def list_batches(after: str | None = None, limit: int = 20) -> dict:
        _check_limit(limit, 100)
        try:
            records, has_more = store.list_batches(after, limit)
        except KeyError:
            raise APIError(400, f"invalid 'after': no batch with id {after!r}", "after") from None
        return _page([r.to_openai(config.served_model) for r in records], has_more)

    @api.get("/batches/{batch_id}")
    def get_batch(batch_id: str) -> dict:
        return find_batch(batch_id).to_openai(config.served_model)

    @api.post("/batches/{batch_id}/cancel")
    def cancel_batch(batch_id: str) -> dict:
        find_batch(batch_id)
        if store.set_status(batch_id, "cancelling", only_from=("validating", "in_progress")):
            runner.wake()
        record = find_batch(batch_id)
        if record.status not in ("cancelling", "cancelled"):
            raise APIError(409, f"Cannot cancel a batch with status '{record.status}'", "batch_id")
        return record.to_openai(config.served_model)

    app.include_router(api)
    return app


def _found(record: Any, kind: str, object_id: str) -> Any:
    """The record looked up by a path id, or OpenAI's 404 for it (`param` is file_id / batch_id)."""
    if record is None:
        raise APIError(404, f"No such {kind} object: {object_id}", f"{kind.lower()}_id")
    return record


def _check_limit(limit: int, most: int) -> None:
    if not 1 <= limit <= most:
        raise APIError(400, f"invalid 'limit' {limit}: must be between 1 and {most}", "limit")


def _page(data: list[dict], has_more: bool) -> dict:
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": has_more}


def _check_metadata(metadata: Any) -> dict[str, str] | None:
    """OpenAI's rule: at most 16 string pairs, keys up to 64 characters, values up to 512."""
    if metadata is None:
        return None
    if not isinstance(metadata, dict) or len(metadata) > 16:
        raise APIError(400, "invalid 'metadata': must be an object of at most 16 key-value pairs", "metadata")
    for key, value in metadata.items():
        if len(key) > 64 or not isinstance(value, str) or len(value) > 512:
            raise APIError(400, f"invalid 'metadata' entry {key!r}: keys are at most 64 characters, values "
                                "strings of at most 512", "metadata")
        if not (_utf8(key) and _utf8(value)):  # a lone surrogate ("\ud800") parses as JSON but no response holds it
            raise APIError(400, f"invalid 'metadata' entry {key!r}: not valid Unicode text (a lone surrogate)",
                           "metadata")
    return metadata


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
