"""Helpers shared by the worker scripts (each worker writes rank<r>.json to --out)."""

import json
import os
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def rank():
    return int(os.environ.get("HOROVOD_RANK", "0"))


def write_result(out_dir, payload):
    path = Path(out_dir) / f"rank{rank()}.json"
    path.write_text(json.dumps(payload))


def weights_as_lists(model):
    return [w.tolist() for w in model.get_weights()]
