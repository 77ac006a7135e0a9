"""A fake implementation for the resident-adapter tests (test_serve.py): the fixture's oracle outputs, with dK
doubled when heads_q != heads_kv (a planted GQA bug); it kills its own process when the fixture's name holds "die",
sleeps 30 s when it holds "slow" (first writing FIXTURE.running), raises when it holds "raise", and refuses when it
holds "refuse"."""
import os
import time

from cpgold.outsiders.adapter import Adapter, Outcome, Refused


class Planted(Adapter):
    name = "planted"

    def versions(self):
        return {"planted": "1", "pid": os.getpid()}

    def run(self, fx):
        base = os.path.basename(fx.path)
        if "die" in base:
            os._exit(9)
        if "slow" in base:
            open(fx.path + ".running", "w").close()  # the tests wait for it before they kill the server
            time.sleep(30)
        if "raise" in base:
            raise RuntimeError("planted error")
        if "refuse" in base:
            raise Refused("planted refusal")
        out = {n: fx.golden(n) for n in ("o", "lse", "dq", "dk", "dv")}
        if fx.heads_q != fx.heads_kv:
            out["dk"] = out["dk"] * 2
        return Outcome(outputs=out, backend="planted", notes={"pid": os.getpid()})
