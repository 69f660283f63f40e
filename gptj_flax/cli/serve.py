"""Serve a checkpoint over HTTP: GPT-4chan's /complete, OpenAI-style /v1/completions and
/v1/chat/completions (with the tokenizer's chat template or --chat-template FILE), /health, /metrics,
and the APIs of mesh-transformer-jax's device_serve.py (on /complete) and docker/ server (/model/...).

    python scripts/serve.py --checkpoint runs/demo [--host 127.0.0.1] [--port 8080] [--mesh 1,1,8]
                            [--api-keys-file keys.txt] [--queue-size 1024] [--max-batch 16] [--decode-steps 1]
                            [--log-file requests.jsonl]

Every flag can also be set in the environment as GPTJ_FLAX_<SETTING> (GPTJ_FLAX_PORT=9000,
GPTJ_FLAX_API_KEYS_FILE=keys.txt, …); a flag wins. The GPT-4chan server's own variables
(QUEUE_SIZE, LOG_FILE, API_KEYS_FILE, PRE_PROMPT_LENGTH) still work, with a deprecation notice;
other unprefixed names such as HOST or PORT are ignored. The checkpoint, the keys file, the chat template and the port
are checked before the model loads. SIGTERM or Ctrl-C drains: new requests get 503, those in flight
finish, then the server exits (a second signal exits at once). --cors (off by default) lets web
pages of any origin call the server, as mesh-transformer-jax's servers did.
"""

import argparse
import logging

from gptj_flax.cli.compile_cache import add_compile_cache_flag, run_command
from gptj_flax.errors import MissingExtraError, add_debug_flag, configure_logging, missing_extra

NO_SERVE_EXTRA: MissingExtraError | None = None
try:  # the serve extra: without it the command says which to install, as one error line
    from gptj_flax.serving import LOG_FORMAT, add_arguments, serve, settings_from
except ModuleNotFoundError as e:
    NO_SERVE_EXTRA = missing_extra(e)


def _main() -> int:
    if NO_SERVE_EXTRA is not None:
        raise NO_SERVE_EXTRA
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    add_debug_flag(parser)
    add_compile_cache_flag(parser)
    args = parser.parse_args()
    configure_logging(logging.INFO, LOG_FORMAT)  # for deprecation notices
    return serve(settings_from(args))


def main() -> int:
    """The ``gptj-serve`` command; ``scripts/serve.py`` runs it too."""
    return run_command(_main)
