"""HTTP serving: the GPT-4chan ``/complete`` API and OpenAI-style completions over a batching worker.

    python scripts/serve.py --checkpoint runs/demo --api-keys-file keys.txt

``create_app(model, settings)`` builds the FastAPI app for a loaded model; ``serve(settings)``
loads the checkpoint and runs it under uvicorn until a signal drains it.
"""

from gptj_flax.serving.app import create_app
from gptj_flax.serving.auth import KeysFileError
from gptj_flax.serving.server import LOG_FORMAT, DrainingServer, serve
from gptj_flax.serving.service import Service
from gptj_flax.serving.settings import ServeSettings, ServingError, SettingsError, add_arguments, settings_from

__all__ = [
    "LOG_FORMAT",
    "DrainingServer",
    "KeysFileError",
    "ServeSettings",
    "Service",
    "ServingError",
    "SettingsError",
    "add_arguments",
    "create_app",
    "serve",
    "settings_from",
]
