"""Setups in processes of their own, for the commands that train models (``tigon bench e2e``,
``tigon bench longctx``): patching is global to a process, and peak memory must start from nothing.

The command runs itself again as a child (its options as given, plus a hidden ``--child``), which
prints its results as ``RESULT <json>`` lines; the last one counts, so a child may print what it has
measured so far as it goes and keep it if it is killed or times out later.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import traceback
from typing import Any

RESULT = "RESULT "


def print_result(result: Any) -> None:
    """Print ``result`` (anything JSON takes) as the child's results so far."""
    print(RESULT + json.dumps(result), flush=True)


def launch(command: list[str], what: str, timeout: float, env: dict[str, str] | None = None) -> Any:
    """Run the child ``command`` (``env``: its environment, this one's by default); its results are
    the JSON of its last ``RESULT`` line, ``None`` if it printed none. A child that fails or runs past
    ``timeout`` seconds is reported with the end of its stderr, and keeps what it printed."""
    # In a session of its own, so that a run past its time goes with all its processes (the ranks
    # torchrun started would otherwise hold their GPUs).
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True, env=env)
    try:
        stdout, stderr = child.communicate(timeout=timeout)
        failure = f"failed (exit {child.returncode})" if child.returncode else None
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        stdout, stderr = child.communicate()
        failure = f"timed out after {timeout:.0f} s"
    lines = [line for line in stdout.splitlines() if line.startswith(RESULT)]
    if failure or not lines:
        print(f"{what}: {failure or 'printed no result'}\n{stderr[-4000:]}", flush=True)
    return json.loads(lines[-1].removeprefix(RESULT)) if lines else None


def failure_record(error: BaseException) -> dict:
    """A result's record of ``error`` (called while handling it): its type and first line, and the
    end of its traceback."""
    first_line = str(error).splitlines()[0] if str(error) else ""
    return {"error": f"{type(error).__name__}: {first_line}"[:500], "traceback": traceback.format_exc()[-3000:]}
