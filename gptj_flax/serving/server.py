"""Run the app under uvicorn with a graceful drain, as ``scripts/serve.py`` does."""

from __future__ import annotations

import logging

import uvicorn

from gptj_flax.serving.app import Service, create_app
from gptj_flax.serving.settings import ServeSettings
from gptj_flax.serving.worker import FAILED

logger = logging.getLogger(__name__)


class DrainingServer(uvicorn.Server):
    """uvicorn with a drain before it stops.

    The first SIGTERM or SIGINT does not close the listening socket (which would turn new clients
    away with connection errors): the service answers new requests 503 while the ones already
    accepted finish, and the server exits once none is left. A second signal exits at once. The
    server also exits if the model fails to warm up.
    """

    def __init__(self, config: uvicorn.Config, service: Service):
        super().__init__(config)
        self.service = service

    def handle_exit(self, sig, frame) -> None:
        if self.service.draining:
            self.should_exit = self.force_exit = True
        else:
            self.service.begin_drain()

    async def on_tick(self, counter: int) -> bool:
        if self.service.draining and self.service.in_flight == 0:
            self.should_exit = True
        if self.service.worker.state == FAILED:
            self.should_exit = True
        return await super().on_tick(counter)


def serve(settings: ServeSettings) -> int:
    """Load the checkpoint, then serve until drained after a signal. Returns the exit status."""
    # force: importing JAX's checkpointing stack may already have configured the root logger
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        force=True)
    from gptj_flax import load  # Orbax checkpoints and HuggingFace directories (hf:DIR) alike

    try:
        model = load(settings.checkpoint, mesh=settings.mesh, dtype=settings.dtype)
        logger.info("loaded %s", model)
        app = create_app(model, settings)
    except (OSError, ValueError) as e:  # the package's errors (checkpoint, config, tokenizer) are ValueErrors
        logger.error("cannot serve %s: %s", settings.checkpoint, e)
        return 1
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level)
    DrainingServer(config, app.state.service).run()
    if app.state.service.worker.state == FAILED:
        logger.error("exiting: %s", app.state.service.worker.error)
        return 1
    return 0
