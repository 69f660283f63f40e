"""Run the app under uvicorn with a graceful drain, as ``scripts/serve.py`` does."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket

import uvicorn

from gptj_flax import partitioning
from gptj_flax.convert.hf import HF_PREFIX
from gptj_flax.errors import configure_logging
from gptj_flax.sampling import load
from gptj_flax.sampling.adapter_bank import split_adapter
from gptj_flax.serving.app import create_app
from gptj_flax.serving.chat import read_chat_template
from gptj_flax.serving.service import Service, open_keys, open_request_log, prefill_mesh
from gptj_flax.serving.settings import ServeSettings, ServingError
from gptj_flax.serving.worker import FAILED

logger = logging.getLogger(__name__)

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


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
        if self.service.drained():
            self.should_exit = True
        if self.service.worker.state == FAILED:
            self.should_exit = True
        return await super().on_tick(counter)


def listening_socket(host: str, port: int, backlog: int = 2048) -> socket.socket:
    """A socket listening on ``host:port``, so that a port in use is found before the model loads
    (and no second server can take the port while this one loads)."""
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror as e:
        raise ServingError(f"cannot listen on {where}: {e.strerror} (set --host or GPTJ_FLAX_HOST)") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: restart despite TIME_WAIT
        sock.bind(address)
        sock.listen(backlog)
    except OSError as e:
        sock.close()
        hint = (
            "; another process is listening there: stop it or choose another --port (GPTJ_FLAX_PORT)"
            if e.errno == errno.EADDRINUSE
            else ""
        )
        raise ServingError(f"cannot listen on {where}: {e.strerror}{hint}") from None
    bound = sock.getsockname()[1]  # the port chosen for --port 0
    logger.info(
        "listening on http://%s; requests are answered once the model is loaded and warmed up",
        f"[{host}]:{bound}" if ":" in host else f"{host}:{bound}",
    )
    return sock


def check_checkpoint(checkpoint: str) -> None:
    local = checkpoint.removeprefix(HF_PREFIX)
    if "://" not in local and not os.path.exists(local):
        raise ServingError(f"checkpoint not found: {local} (set --checkpoint or GPTJ_FLAX_CHECKPOINT)")


def serve(settings: ServeSettings) -> int:
    """Check the files and the port, load the checkpoint, then serve until drained after a signal.

    Everything that can be wrong with the settings (a missing checkpoint, keys file or chat template,
    a bad key, a template that is not Jinja, a port in use) raises a :class:`~gptj_flax.errors.GptjFlaxError` before the model loads.
    Returns the exit status.
    """
    configure_logging(settings.log_level.upper(), LOG_FORMAT)

    check_checkpoint(settings.checkpoint)
    for value in settings.adapter:
        path = split_adapter(value)[1]
        if "://" not in path and not os.path.exists(path):
            raise ServingError(f"adapter not found: {path} (set --adapter or GPTJ_FLAX_ADAPTER)")
    if settings.chat_template is not None:
        read_chat_template(settings.chat_template)  # a missing or broken template is found before the model loads
    keys = open_keys(settings)
    if settings.prefill == "beside":  # before the model loads, which can take minutes
        prefill_mesh(partitioning.make_mesh(settings.mesh or partitioning.ONE_DEVICE), settings.prefill)
    with contextlib.ExitStack() as cleanup:
        sock = listening_socket(settings.host, settings.port)
        cleanup.callback(sock.close)
        request_log = open_request_log(settings)
        if request_log is not None:
            cleanup.callback(request_log.close)
        model = load(
            settings.checkpoint,
            mesh=settings.mesh,
            dtype=settings.dtype,
            quantize=settings.quantize,
            adapter=settings.merged_adapter,
            kv_cache=settings.kv_cache,
        )
        logger.info("loaded %s", model)  # its repr states the parameter and compute dtypes
        app = create_app(model, settings, keys=keys, request_log=request_log)
        config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level)
        DrainingServer(config, app.state.service).run(sockets=[sock])
    if app.state.service.worker.state == FAILED:
        logger.error("exiting: %s", app.state.service.worker.error)
        return 1
    return 0
