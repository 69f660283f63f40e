"""Serve a checkpoint over HTTP: GPT-4chan's /complete, OpenAI-style /v1/completions, /health, /metrics.

    python scripts/serve.py --checkpoint runs/demo [--host 127.0.0.1] [--port 8080] [--mesh 1,1,8]
                            [--api-keys-file keys.txt] [--queue-size 1024] [--max-batch 16] [--log-file requests.jsonl]

Every flag can also be set in the environment under the setting's name (QUEUE_SIZE=64,
API_KEYS_FILE=keys.txt, …), as the GPT-4chan server's settings could; a flag wins. SIGTERM or
Ctrl-C drains: new requests get 503, those in flight finish, then the server exits (a second
signal exits at once).
"""

import argparse
import sys


def main() -> int:
    from gptj_flax.serving import SettingsError, add_arguments, serve, settings_from

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    args = parser.parse_args()
    try:
        settings = settings_from(args)
    except SettingsError as e:
        parser.error(str(e))
    return serve(settings)


if __name__ == "__main__":
    sys.exit(main())
