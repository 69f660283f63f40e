"""Subprocess half of the resume test: restore a saved iterator state, write the next batches."""

import json
import sys

import numpy as np

from gptj_flax.data import make_train_iterator


def main(source: str, settings_json: str, state_json: str, n_batches: int, out_path: str) -> None:
    settings = json.loads(settings_json)
    with open(state_json) as f:
        state = json.load(f)
    it = make_train_iterator(source, state=state, process_index=0, process_count=1, progress=False, **settings)
    batches = [next(it) for _ in range(n_batches)]
    np.savez(
        out_path,
        **{
            f"{field}_{k}": getattr(b, field)
            for k, b in enumerate(batches)
            for field in ("tokens", "segment_ids", "loss_mask")
        },
    )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5])
