"""A fake CP implementation for `cpgold shrink --run "... {rank}"`: rank RANK writes the oracle's outputs of its rank
(o, lse) to CANDIDATE, with query heads 0 and 1 exchanged when the case has a GQA group > 1 (so the smallest failing
case has 2 query heads on 1 KV head).

    python3 fake_rank_runner.py FIXTURE CANDIDATE RANK
"""
import sys

import cpgold


def main(fixture, candidate, rank):
    rank = int(rank)
    with cpgold.Fixture(fixture) as fx:
        out = {"o": fx.golden("o", rank), "lse": fx.golden("lse", rank)}
        if fx.heads_q // fx.heads_kv > 1:
            out["o"][:, [0, 1]] = out["o"][:, [1, 0]]
            out["lse"][[0, 1]] = out["lse"][[1, 0]]
        cpgold.write_rank(candidate, rank, out, fixture=fx, lse_layout="ht")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
