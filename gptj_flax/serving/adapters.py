"""LoRA adapters loaded and removed while the server runs: ``POST /v1/adapters`` with ``{"name",
"path"}`` and ``DELETE /v1/adapters/NAME``, authenticated as every other route. They change one row
of the server's adapter bank (:mod:`gptj_flax.sampling.adapter_bank`), so nothing recompiles; a
request names an adapter by its ``model`` field (:meth:`Service.adapter_of`).
"""

import asyncio

from fastapi import FastAPI, HTTPException

from gptj_flax.sampling.adapter_bank import AdapterBank, AdapterConflict, AdapterError, ServedAdapter, UnknownAdapter
from gptj_flax.serving import schemas
from gptj_flax.serving.service import ERRORS, Service, error_response

ADAPTER_ERRORS = {
    **ERRORS,
    400: error_response("malformed JSON, or an adapter that cannot be served: unreadable, or made for another base"),
    404: error_response("no adapter of that name"),
    409: error_response("the name is taken, the server holds --max-adapters already, or the adapter is in use"),
}


def _card(adapter: ServedAdapter, base: str) -> schemas.AdapterCard:
    return schemas.AdapterCard(
        id=adapter.name, parent=base, path=adapter.path, rank=adapter.rank, projections=list(adapter.projections)
    )


def _bank(service: Service) -> AdapterBank:
    if service.adapters is None:
        raise HTTPException(
            409,
            "this server holds no adapters: restart it with --max-adapters N (room for N adapters) to load them",
        )
    return service.adapters


async def load_adapter(service: Service, body: schemas.AdapterRequest, lock: asyncio.Lock) -> schemas.AdapterCard:
    """Read and check the adapter in a thread (the event loop keeps serving), then write it into a free row."""
    bank = _bank(service)
    if body.name == service.name:
        raise HTTPException(409, f"{body.name!r} is the base model's name: give the adapter another")
    async with lock:  # one change of the bank at a time
        try:
            found = await asyncio.to_thread(bank.prepare, body.name, body.path)
            return _card(bank.install(body.name, found), service.name)
        except AdapterConflict as e:
            raise HTTPException(409, str(e)) from None
        except AdapterError as e:
            raise HTTPException(400, str(e)) from None


async def remove_adapter(service: Service, name: str, lock: asyncio.Lock) -> schemas.AdapterCard:
    """Take the adapter out, unless a request that named it is still running (409)."""
    bank = _bank(service)
    async with lock:
        try:
            index = bank.index(name)
        except UnknownAdapter as e:
            raise HTTPException(404, str(e)) from None
        busy = service.adapter_busy(index)
        if busy:
            raise HTTPException(
                409, f"adapter {name!r} has {busy} request(s) in flight: remove it once they have finished"
            )
        return _card(bank.remove(name), service.name)


def add_routes(app: FastAPI, service: Service) -> None:
    lock = asyncio.Lock()

    @app.post("/v1/adapters", response_model=schemas.AdapterCard, status_code=201, responses=ADAPTER_ERRORS)
    async def load(body: schemas.AdapterRequest):
        """Load a LoRA adapter (a LoRA run or step directory, or a PEFT directory, on the server's disk)
        beside the base, as model `name`; it is checked against the base as `--adapter` is."""
        return await load_adapter(service, body, lock)

    @app.delete("/v1/adapters/{name}", response_model=schemas.AdapterCard, responses=ADAPTER_ERRORS)
    async def remove(name: str):
        """Remove the adapter `name` (409 while a request that named it is running)."""
        return await remove_adapter(service, name, lock)
