"""A SinkRunner in its own process that kills itself (SIGKILL, no cleanup of any kind) at a chosen
step of a chosen checkpoint; run by tests/sinks/test_sinks_faults.py.

    python tests/sinks/sink_worker.py '{"kind": ..., "job": ..., "env": {...}, "kill_step": "saved", "kill_at": 3}'

Exits 0 if it ran to the end without reaching that point (the test then fails: the window was
never exercised).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/, for the helpers package

from helpers.sinkkit import Env, make_sink  # noqa: E402
from onceflow.sinks import SinkRunner, Step  # noqa: E402


def main() -> int:
    config = json.loads(sys.argv[1])
    env = Env(**config["env"])
    sink, kw = make_sink(config["kind"], env, config["job"])
    kill_step, kill_at = config["kill_step"], config["kill_at"]

    def on_step(step: Step, checkpoint_id: int) -> None:
        if step == kill_step and checkpoint_id == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    SinkRunner(env.onceflow, sink, job=config["job"], on_step=on_step, **kw).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
