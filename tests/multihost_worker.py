"""One process of a two-process jax.distributed run on loopback, for tests/test_sharding.py.

    python tests/multihost_worker.py MODEL_DIR PORT PROCESS_ID MODE

Each process has 2 CPU devices and the model is split over all 4 (TP = 4 across processes). Process 0 runs the
LLM API (scheduler + sampler) and prints the greedy tokens as JSON; process 1 runs the follower loop. MODE "die"
makes process 0 print READY after generating and keep serving, so the test can kill process 1 and check that
process 0 fails (non-zero exit) instead of hanging. MODE "fail" makes process 0's next step fail after generating
(multi-host serving does not recover from that), so the test can check that process 1 is told and exits non-zero.
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
os.environ["JAX_PLATFORMS"] = "cpu"

from tp_workload import ENGINE_ARGS, greedy_tokens  # noqa: E402

from jserve.config import EngineConfig  # noqa: E402


def main(model_dir: str, port: int, process_id: int, mode: str) -> None:
    config = EngineConfig(model=model_dir, tensor_parallel_size=4, coordinator_address=f"127.0.0.1:{port}",
                          num_processes=2, process_id=process_id, **ENGINE_ARGS)
    if process_id > 0:
        from jserve.engine.engine import run_follower

        run_follower(config)
        return
    from jserve import LLM

    llm = LLM(**{k: v for k, v in vars(config).items()})
    print(json.dumps(greedy_tokens(llm)), flush=True)
    if mode == "fail":
        def failing_execute(*args, **kwargs):
            raise RuntimeError("injected leader step failure")

        llm.engine.executor.execute = llm.engine.executor.execute_burst = failing_execute
        try:
            greedy_tokens(llm)
        except RuntimeError as e:
            print(f"LEADER FAILED: {e}", flush=True)
            sys.exit(1)
    if mode == "die":
        print("READY", flush=True)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # keep stepping: the dead follower must make this fail, not hang
            greedy_tokens(llm)
        print("still alive after 120 s", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
