import time, numpy as np, torch, logging
from bench.peer import OwnerProcess, OwnerSpec, pattern_words
from kvxferd.nixl import NixlAgent, MemType, XferOp, XferState
if __name__ == "__main__":
    t0=time.monotonic()
    o = OwnerProcess(OwnerSpec("owner", (1<<20, 1<<20)))
    print("spawn", time.monotonic()-t0)
    a = NixlAgent("reader"); a.start()
    buf = torch.zeros(1<<20, dtype=torch.uint8)
    reg = np.array([[buf.data_ptr(), buf.numel(), 0]], dtype=np.int64)
    a.register(reg, MemType.DRAM)
    a.add_remote("owner", o.metadata)
    o.call("add_remote", "reader", a.metadata())
    local = np.array([[buf.data_ptr(), 4096, 0],[buf.data_ptr()+8192, 4096, 0]], dtype=np.int64)
    remote = np.array([[o.regions[1,0]+4096, 4096, 0],[o.regions[0,0], 4096, 0]], dtype=np.int64)
    h = a.post(XferOp.READ, local, remote, peer="owner", notif=b"hi")
    while a.poll(h) is XferState.IN_PROGRESS: time.sleep(0.0001)
    print(a.telemetry(h), a.release(h))
    w = buf.view(torch.int64).numpy()
    print(np.array_equal(w[:512], pattern_words(1,1,512,512)), np.array_equal(w[1024:1536], pattern_words(1,0,0,512)))
    o.call("hold","r1",1,5.0)
    print(o.call("released"))
    # kill test: post big read then kill
    big = torch.zeros(256<<20, dtype=torch.uint8)
    o.close(); a.close()
