"""One whole message through the runtime's handling, N times, for an instruction count that the machine's load does
not move: `valgrind --tool=callgrind python scripts/runtime_instructions.py N` for two values of N; the difference
of the two counts over the difference of the Ns is the instructions per message (start-up and imports cancel)."""

import sys

from gpuq_tools.bench import runtime as rb
from shared.events import encode_event
from shared.tracing import traced_event

rb.REPEATS = 1  # one reading: the count, not the least of three, is wanted
raw = encode_event(traced_event(rb._placed(), source="gpuq/scheduler/0", time=rb._T))
rb._whole_message(raw, int(sys.argv[1]))
