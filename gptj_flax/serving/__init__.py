"""HTTP serving: the GPT-4chan ``/complete`` API and OpenAI-style completions over a batching worker.

    python scripts/serve.py --checkpoint runs/demo --api-keys-file keys.txt

``create_app(model, settings)`` builds the FastAPI app for a loaded model; ``serve(settings)``
loads the checkpoint and runs it under uvicorn until a signal drains it.
"""

from gptj_flax.serving.app import Service, create_app
from gptj_flax.serving.server import DrainingServer, serve
from gptj_flax.serving.settings import ServeSettings, SettingsError, add_arguments, settings_from

__all__ = ["DrainingServer", "ServeSettings", "Service", "SettingsError", "add_arguments", "create_app", "serve",
           "settings_from"]
