"""Match the plan's node names to the names of the graph codegen runs.

The plan is made from a capture of a weightless replica on `meta` (and with the loss); codegen
captures the user's model on its own device. The two graphs have the same ops (the plan's
fingerprint checks it, leaving out layout-only copies), but not always the same node names:
code that branches on the device adds a `contiguous` on one of them, or a symbolic-size `mul`
that takes a name without being an op, and every later node of that kind is numbered one off.
A placement looked up by name would then land on another node (a 1-d tensor asked to be split
on dim 2). So the placements are carried over by aligning the two sequences of op kinds (the
name without its `_N` counter): matched nodes take the plan's placement, and a copy only one
graph has gets none (it runs on whatever placement reaches it, which a copy keeps).
"""

from __future__ import annotations

import re
from difflib import SequenceMatcher

_COUNTER = re.compile(r"_\d+$")


def op_kind(name: str) -> str:
    """`mul_12` -> `mul`: the op an exported node's name was made from."""
    return _COUNTER.sub("", name)


def align_names(plan_names: list[str], graph_names: list[str]) -> dict[str, str]:
    """graph node name -> the plan node it corresponds to (unmatched nodes are left out)."""
    if plan_names == graph_names:
        return {name: name for name in graph_names}
    plan_kinds = [op_kind(name) for name in plan_names]
    graph_kinds = [op_kind(name) for name in graph_names]
    matcher = SequenceMatcher(a=graph_kinds, b=plan_kinds, autojunk=False)
    matched: dict[str, str] = {}
    for block in matcher.get_matching_blocks():
        for offset in range(block.size):
            matched[graph_names[block.a + offset]] = plan_names[block.b + offset]
    return matched
