"""Where a compiled program's time goes: a ``jax.profiler`` trace summed per part of the model.

XLA's CPU runtime records one trace event per executed operation (a thunk) on the thread that ran
it. Each event is matched to its instruction in the optimised HLO, whose metadata names the JAX
operation and the module scope it came from (``…/layer_3/mlp/fc_in/dot_general``); the events are
then summed by what the operation is (a matmul or not) and where it sits (attention, MLP, LM head,
sampling, optimiser, the rest of the layer stack …). An event spans one operation from start to
end on the thread that launched it (threads an operation borrows for itself record nothing), so
the sum is of operation times: operations that run at the same time each count, and the sum can
exceed the wall time.
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import re
import tempfile
from collections.abc import Callable, Collection

import jax

# The first scope keyword found in an operation's JAX name gives its part (order matters: a
# matmul inside ``attn`` is attention even when the decode loop wraps it).
PARTS = (
    ("lm_head", "LM head"),
    ("attn", "attention"),
    ("mlp", "MLP"),
    ("ln_", "layer norms"),
    ("_emit", "sampling"),
    ("next_tokens", "sampling"),
    ("chunked_loss", "loss"),
    ("loss", "loss"),
    ("optimizer", "optimiser"),
    ("wte", "embedding"),
    ("_embed", "embedding"),
    ("layer", "layer stack"),  # the rest of a block: residual adds, the scan's slices of weights and grads
)
WAITING = "SlinkyThreadPool::Await"


@dataclasses.dataclass(frozen=True)
class Row:
    part: str
    kind: str  # "matmul", "other" or "waiting"
    op_ms: float  # summed operation time per call of the profiled function
    ops: float  # operations executed per call


def _instructions(hlo_text: str) -> dict[str, tuple[bool, str]]:
    """Instruction name → (is a matmul, its part) for every instruction of the HLO module."""
    found = {}
    for line in hlo_text.splitlines():
        m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = (\S+) ([\w\-]+)\(", line)
        if not m:
            continue
        op_name = re.search(r'op_name="([^"]*)"', line)
        matmul = m.group(3) == "dot" or bool(op_name and op_name.group(1).endswith("dot_general"))
        # XLA's rewrites (a matrix-vector dot, for one) can leave an instruction without its JAX
        # name; its result's shape then says what it is.
        found[m.group(1)] = (matmul, _part(op_name.group(1), matmul) if op_name else m.group(2).split("{")[0])
    return found


def _part(op_name: str, matmul: bool = False) -> str:
    for keyword, part in PARTS:
        if keyword in op_name:
            if part == "attention" and matmul and not _between_activations(op_name):
                return "attn q/k/v/out"
            return part
    return "rest"


def _between_activations(op_name: str) -> bool:
    """Whether an einsum's two operands both have the batch axis ``b``: scores and their weighted
    sum, not a projection by a weight."""
    spec = re.search(r"/([a-z.]+),([a-z.]+)->[a-z.]+/", op_name)
    return bool(spec and "b" in spec.group(1) and "b" in spec.group(2))


def op_events(
    fn: Callable[[], object], instructions: Collection[str] = ()
) -> tuple[collections.Counter, collections.Counter]:
    """Run ``fn`` under the profiler; return (event name → total ms, event name → events) for the
    events on the XLA runtime's threads, and for those named after one of ``instructions`` on any
    other thread (an operation is counted whichever thread ran it)."""
    totals: collections.Counter = collections.Counter()
    events: collections.Counter = collections.Counter()
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            fn()
        (path,) = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)
        trace = jax.profiler.ProfileData.from_file(path)
    for plane in trace.planes:
        for line in plane.lines:
            runtime = line.name.startswith("tf_XLA")  # the runtime's worker threads, not Python's
            for event in line.events:
                name = event.name
                # ThunkExecutor spans a whole program, not one op
                if (runtime and not name.startswith("ThunkExecutor")) or name in instructions:
                    totals[name] += event.duration_ns / 1e6
                    events[name] += 1
    return totals, events


def profile(fn: Callable[[], object], hlo_text: str, calls: int) -> list[Row]:
    """Operation time per part and kind, per call, of ``fn`` running ``calls`` calls of the program
    whose optimised HLO is ``hlo_text``; largest first."""
    instructions = _instructions(hlo_text)
    ms: collections.Counter = collections.Counter()
    count: collections.Counter = collections.Counter()
    totals, events = op_events(fn, instructions.keys())
    for name, total in totals.items():
        if name == WAITING:
            key = ("(thread pool)", "waiting")
        elif name in instructions:
            matmul, part = instructions[name]
            key = (part, "matmul" if matmul else "other")
        else:
            key = ("(runtime)", "other")
        ms[key] += total / calls
        count[key] += events[name]
    return [Row(part, kind, t, count[(part, kind)] / calls) for (part, kind), t in ms.most_common()]


def format_rows(rows: list[Row], wall_ms: float, threads: int) -> str:
    total = sum(r.op_ms for r in rows)
    width = max(14, *(len(r.part) for r in rows))
    lines = [f"    {'part':<{width}} {'kind':<8} {'ops':>6} {'op ms':>9} {'share':>6}"]
    for r in rows:
        if r.op_ms >= 0.005 * total:
            share = 100 * r.op_ms / total
            lines.append(f"    {r.part:<{width}} {r.kind:<8} {r.ops:6.0f} {r.op_ms:9.2f} {share:5.0f}%")
    lines.append(
        f"    operations {total:.2f} ms per call against {wall_ms:.2f} ms of wall time on {threads} threads"
        " (more: operations ran side by side; less: time between operations)"
    )
    return "\n".join(lines)
