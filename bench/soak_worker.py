"""``python -m bench.soak_worker --config FILE``: the real ``wsd.programs.worker``, with its applications recorded.

Run by ``torchrun`` for ``bench/soak.py``. It runs ``wsd.programs.worker.main``
unchanged, except that every call of ``AgentCore.apply_up_to`` (the one place
where a rank applies or skips commands, from its engine's step boundary) also
appends one JSON line to ``$WSD_SOAK_RECORD/rank<R>.<pid>.jsonl``:

    {"rank", "pid", "restart", "group", "from", "to", "applied": [[seq, step, ok], ...]}

``from`` is the highest seq applied (or skipped) before the call, ``to`` after
it: the first line's ``from`` is the baseline the coordinator gave this
process. Each line is one ``write`` to a file opened with ``O_APPEND``, so a
SIGKILL leaves every earlier line whole. The soak reads these files to check,
per process, that every seq of its TP group arrived exactly once, in order,
with no gap, across coordinator restarts.

Why a wrapper and not a worker option: the record is the soak's own
instrument, and the worker's code stays the code that ships. Wrapping the
class method observes without changing what it does (same arguments, same
return value, same exceptions).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from wsd.agent.core import AgentCore
from wsd.programs import worker

RECORD_ENV = "WSD_SOAK_RECORD"


def _recording(original: Any, directory: str) -> Any:
    rank = int(os.environ["RANK"])  # torchrun sets it; a missing one must fail loudly
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    path = os.path.join(directory, f"rank{rank}.{os.getpid()}.jsonl")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def apply_up_to(self: AgentCore, agreed: int) -> list[tuple[int, bytes]]:
        # A fresh process stands at its baseline from registration on: the
        # group's desired state it takes on there covers every seq up to it.
        before = max(self.applied, self.baseline)
        done = original(self, agreed)
        # Every command of one call is applied at the same step; whether the
        # manager accepted it is in the link's memory of recent acks.
        ok = {seq: accepted for seq, _, accepted, _ in self._acks}
        applied = [[seq, self.steps, ok.get(seq)] for seq, _ in done]
        line = {"rank": rank, "pid": os.getpid(), "restart": restart, "group": self.tp_index,
                "from": before, "to": max(self.applied, self.baseline), "applied": applied}
        os.write(fd, (json.dumps(line) + "\n").encode())
        return done

    return apply_up_to


def main() -> int | None:  # the worker's main is torch's @record-wrapped: typed int | None
    directory = os.environ.get(RECORD_ENV)
    if not directory or not os.path.isdir(directory):
        print(f"bench.soak_worker: {RECORD_ENV} must name an existing folder, got {directory!r}",
              file=sys.stderr)
        return 2
    AgentCore.apply_up_to = _recording(AgentCore.apply_up_to, directory)  # type: ignore[method-assign]
    return worker.main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
