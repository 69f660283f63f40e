"""GPT-4chan's API: ``POST /complete`` with ``{"prompt", "pre_prompt", …}`` (``docs/reference.md``
§7.1). device_serve.py's body on the same path goes to :mod:`~gptj_flax.serving.legacy`'s route,
registered before this one.
"""

import time

from fastapi import FastAPI, HTTPException, Request

from gptj_flax.serving import schemas
from gptj_flax.serving.service import ERRORS, Service, caller, draw_seed, error_response
from gptj_flax.serving.worker import Job, Prompt


def prompt_tokens(service: Service, body: schemas.CompleteRequest) -> list[int]:
    """The kept pre_prompt tokens, then the prompt's last tokens that fit beside them and ``length``
    new ones (the start token alone if both are empty); 413 if even one prompt token cannot fit."""
    pre = service.encode(body.pre_prompt)[: service.settings.pre_prompt_length]
    prompt = service.encode(body.prompt)
    shortest = len(pre) + min(len(prompt), 1) or 1  # nothing at all: start from the EOS token
    if shortest + body.length > service.context:
        raise HTTPException(
            413,
            f"length {body.length} with a pre_prompt of {len(pre)} tokens and at least one "
            f"prompt token exceeds the model's context of {service.context} tokens",
        )
    room = service.context - body.length - len(pre)
    return pre + prompt[max(0, len(prompt) - room) :] or [service.start_token]


async def complete_text(service: Service, body: schemas.CompleteRequest, request: Request) -> dict:
    started = time.monotonic()
    key = caller(request)
    adapter = service.adapter_of(body.model)
    row = Prompt(prompt_tokens(service, body), body.length, body.sampling, draw_seed(body.seed), adapter=adapter)
    (completion,) = await service.run(request, Job([row]))
    service.log(
        key=key,
        endpoint="/complete",
        prompt=body.prompt,
        pre_prompt=body.pre_prompt,
        settings=dict(
            length=body.length,
            top_p=body.top_p,
            temperature=body.temperature,
            typical_p=body.typical_p,
            seed=row.seed,
        ),
        response=completion.text,
        started=started,
    )
    return {"response": completion.text}


def add_routes(app: FastAPI, service: Service) -> None:
    # 404: a `model` (this server's extension) that names no adapter served here
    responses = {**ERRORS, 404: error_response("unknown model")}

    @app.post("/complete", response_model=schemas.CompleteResponse, responses=responses)
    async def complete(body: schemas.CompleteRequest, request: Request):
        """GPT-4chan's API: continue `pre_prompt` + `prompt`; the prompt loses its oldest tokens to fit
        the context with `length` new tokens (413 if even the pre_prompt and one prompt token cannot)."""
        return await complete_text(service, body, request)
