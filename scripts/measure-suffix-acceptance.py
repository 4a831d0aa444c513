"""Measure the suffix drafter's acceptance rate by match length (drafters/suffix.py SUFFIX_ACCEPTANCE).

Greedy decoding of bench questions on the default model with method ``suffix`` and no tree budget
(every proposed node is verified). For each proposal, the most recent continuation (a chain) is
followed against what the target committed: a node counts as tried when its parent was accepted
(or it is the first), and as accepted when the target took it. Prints the rate per match length.

    PYTHONPATH=src python scripts/measure-suffix-acceptance.py [--limit 12] [--max-new-tokens 96]
"""
from __future__ import annotations

import argparse
import json
from collections import Counter

from lyanna.decoding.decoder import Decoder, GenerationRequest
from lyanna.drafters.suffix import SuffixDrafter
from lyanna.engines.loading import load_target
from lyanna.measure.bench import load_questions


class Recording(SuffixDrafter):
    """The default suffix drafter (one continuation), remembering each proposal's match."""

    def __init__(self) -> None:
        super().__init__()
        self.pending: tuple[int, list[int]] | None = None
        self.tried: Counter[int] = Counter()
        self.accepted: Counter[int] = Counter()

    def propose(self, context, max_depth):
        n, conts = self.match(context, min(self.max_depth, max_depth))
        self.pending = (n, conts[0]) if conts else None
        return super().propose(context, max_depth)

    def commit(self, tokens, hidden):
        """``tokens``: the root, then the accepted drafts."""
        if self.pending is not None:
            n, chain = self.pending
            taken = list(tokens[1:])
            k = len(taken)  # accepted nodes of the chain (the only branch)
            self.accepted[n] += k
            self.tried[n] += k + (k < len(chain))  # the first rejected node was tried too
        self.pending = None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--limit", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    args = ap.parse_args()
    decoder = Decoder(load_target(), default_drafts=False)
    drafter = Recording()
    decoder.add_drafter("suffix-recording", drafter)
    for q in load_questions(limit=args.limit):
        decoder.generate(decoder.encode(q.prompt), GenerationRequest(max_new_tokens=args.max_new_tokens),
                         method="suffix-recording", budget=None)
    print(json.dumps({n: {"accepted": drafter.accepted[n], "tried": drafter.tried[n],
                          "rate": round(drafter.accepted[n] / drafter.tried[n], 3)} for n in sorted(drafter.tried)}))


if __name__ == "__main__":
    main()
