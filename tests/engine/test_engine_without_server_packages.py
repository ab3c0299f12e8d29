"""The offline engine and the kernels import and run where the HTTP server's packages are absent
(as on the GPU machines the device check runs on: no fastapi, uvicorn or pydantic there).

A fresh interpreter blocks those imports with a `sys.meta_path` finder, then builds a tiny engine,
generates from text (the tokenizer comes through transformers) and from token ids, and reports
which blocked modules anything tried to import.
"""

import json
import subprocess
import sys

SERVER_PACKAGES = ("fastapi", "starlette", "uvicorn", "pydantic", "prometheus_client")

CHILD = r"""
import importlib.abc, json, sys

BLOCKED = set(sys.argv[1].split(","))
tried = []

class BlockServerPackages(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            tried.append(name)
            raise ImportError(f"{name} is blocked (not installed here)")
        return None

sys.meta_path.insert(0, BlockServerPackages())
import kernels_pallas, kernels_pallas.lowering  # noqa: E401
from jaxrunner import Engine

engine = Engine(model_path=sys.argv[2], **json.loads(sys.argv[3]))
params = {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}
by_text = engine.generate(prompt="def main():", sampling_params=params)
by_ids = engine.generate(input_ids=[[5, 6, 7], [9] * 20], sampling_params=params)
engine.shutdown()
print(json.dumps({"text": by_text["text"], "ids": [o["output_ids"] for o in by_ids],
                  "tried": tried,
                  "loaded": sorted(m for m in sys.modules if m.partition(".")[0] in BLOCKED)}))
"""


def test_engine_runs_with_the_server_packages_blocked(checkpoint, engine_kwargs):
    kwargs = dict(engine_kwargs, max_running_requests=2, max_prefill_tokens=32,
                  max_total_tokens=2048)
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, ",".join(SERVER_PACKAGES), str(checkpoint("tiny-llama")),
         json.dumps(kwargs)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["loaded"] == []
    assert [len(ids) for ids in result["ids"]] == [4, 4]
    assert isinstance(result["text"], str)
    # Optional imports that fall back quietly are fine; the engine's own code must not try.
    assert not [m for m in result["tried"] if m.partition(".")[0] in ("fastapi", "uvicorn")], (
        result["tried"])
