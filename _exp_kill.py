import time, numpy as np, sys
sys.path.insert(0, "tests/transfer")
from conftest import make_reader, close_reader, BLOCK
from bench.peer import OwnerProcess, OwnerSpec, pattern_words
from bench.plan import plan_from_blocks
from kvxferd.nixl import XferOp, XferState
if __name__ == "__main__":
    for both in (True, False, True, False):
        o = OwnerProcess(OwnerSpec("v1", (1<<20,)))
        r = make_reader(num_regions=1)
        if both: r.connect(o)
        else: r.engine.connect_peer(o.name, o.metadata, o.regions)
        o.stop_signal()
        loc = np.array([[r.buffers[0].data_ptr()+i*8192, 4096, 0] for i in range(100)], dtype=np.int64)
        rem = np.array([[o.regions[0,0]+i*8192, 4096, 0] for i in range(100)], dtype=np.int64)
        h = r.agent.post(XferOp.READ, loc, rem, peer="v1")
        time.sleep(0.3); print("both" if both else "oneway", "state before kill", r.agent.poll(h))
        t0=time.monotonic(); o.kill()
        seen=[]
        while time.monotonic()-t0 < 3:
            try:
                s = r.agent.poll(h)
            except Exception as e:
                seen.append(("exc", type(e).__name__, str(e)[:100], round(time.monotonic()-t0,3))); break
            if not seen or seen[-1][0]!=s: seen.append((s, round(time.monotonic()-t0,3)))
            if s is XferState.DONE: break
            time.sleep(0.001)
        print(seen)
        w = r.words(0)
        print("data ok:", np.array_equal(w[:512], pattern_words(1,0,0,512)), "nonzero words:", int((w!=0).sum()))
        print("released", r.agent.release(h))
        close_reader(r)
