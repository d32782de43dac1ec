"""vLLM's runtime LoRA routes, served with --allow-runtime-lora: POST /v1/load_lora_adapter and
/v1/unload_lora_adapter. They answer as vLLM's do (a line of plain text on success, so its clients' checks pass) and
sit behind the API key like every other route; a load reads a path on the server's disk, which is why they are off
unless asked for.

An adapter is loaded beside the model served (a start with LoRA serves one model): its name is then a `model` that
requests may name, and /v1/models lists it with `parent` set to that model.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import PlainTextResponse

from tokenmill.api import errors
from tokenmill.api.engine_protocol import Engine
from tokenmill.api.protocol import LoadLoraAdapterRequest, UnloadLoraAdapterRequest, parse_request
from tokenmill.engine.outputs import AdapterLoadError

router = APIRouter()


def _served(request: Request) -> tuple[Engine, dict[str, Engine]]:
    engines: dict[str, Engine] = request.app.state.engines
    return next(iter(engines.values())), engines


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(request: Request) -> PlainTextResponse:
    body = parse_request(LoadLoraAdapterRequest, await request.body())
    engine, engines = _served(request)
    if body.lora_name in engines:
        raise errors.invalid_request(f"{body.lora_name!r} is the name of a model served", "lora_name")
    if any(adapter.name == body.lora_name for adapter in engine.adapters()):
        raise errors.invalid_request(f"The lora adapter '{body.lora_name}' has already been loaded.", "lora_name")
    try:
        await engine.load_adapter(body.lora_name, body.lora_path)
    except AdapterLoadError as exc:
        raise errors.invalid_request(str(exc), "lora_path") from None
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(request: Request) -> PlainTextResponse:
    body = parse_request(UnloadLoraAdapterRequest, await request.body())
    engine, _ = _served(request)
    try:
        await engine.unload_adapter(body.lora_name)
    except KeyError:
        raise errors.APIError(
            404,
            f"The lora adapter '{body.lora_name}' cannot be found.",
            errors.INVALID_REQUEST,
            "lora_name",
            "model_not_found",
        ) from None
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
